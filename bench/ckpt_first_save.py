"""First and later synchronous checkpoint saves in one fresh process, and the
memory the writer keeps: the A/B of Note [Save ring] (docs/benchmarks.md,
session 14). Run it once per build, alternating builds, each in its own
process (PYTHONPATH=python:<build>/python):

    python bench/ckpt_first_save.py --mode native --dir /var/tmp/ckb/ab [--json out.json]
    python bench/ckpt_first_save.py --mode dcp --dir /var/tmp/ckb/ab

Prints one JSON line: the first save's seconds, the later ones', the CPU
seconds of each, the growth of the process's RSS and the writer's buffers.
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("native", "dcp"), default="native")
    ap.add_argument("--dir", required=True, help="scratch directory (emptied first)")
    ap.add_argument("--size", type=float, default=1.0, help="state size in GB")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()

    import torch.distributed.checkpoint as dcp

    from ckpt_bench import weights_like
    from ebbtide import checkpoint
    from ebbtide.dcp import EbbtideWriter

    state = weights_like(args.size)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    target = os.path.join(args.dir, "c")
    rss0 = rss_bytes()
    if args.mode == "native":
        writer = checkpoint.Writer()
        native = writer._native
        save = lambda: writer.save(state, target)  # noqa: E731
    else:
        writer = EbbtideWriter(target)
        native = writer._native
        save = lambda: dcp.save(state, storage_writer=writer)  # noqa: E731
    wall, cpu = [], []
    for _ in range(args.saves):
        c0, t0 = time.process_time(), time.perf_counter()
        save()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        writer.join()
    out = {"mode": args.mode, "state_bytes": sum(t.nbytes for t in state.values()),
           "first_s": round(wall[0], 3), "later_s": [round(t, 3) for t in wall[1:]],
           "cpu_s": [round(c, 3) for c in cpu], "rss_growth_mb": round((rss_bytes() - rss0) / 2**20),
           "writer_buffers_mb": native.snapshot_capacity >> 20}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
