"""First and later checkpoint saves in one fresh process: the synchronous
A/B of Note [Save ring] (docs/benchmarks-journal.md, session 14), and what an async
save blocks its caller for (issue 31 §2).

    python bench/ckpt_first_save.py --mode native --dir /var/tmp/ckb/ab [--json out.json]
    python bench/ckpt_first_save.py --mode dcp --dir /var/tmp/ckb/ab
    python bench/ckpt_first_save.py --mode async --dir /var/tmp/ckb/as --size 1.3 [--json out.json]

native / dcp: one JSON line: the first synchronous save's seconds, the later
ones', the CPU seconds of each, the growth of the process's RSS and the
writer's buffers.

async: for ebbtide.checkpoint.save and for dcp.async_save through
EbbtideWriter, each way of copying in a fresh process of its own (the
default copy; snapshot="none" / staging="none", which copy nothing): the
first async save's blocking time, the later ones' (median), and the median
synchronous save of the same state in the same process, with the ratios;
a table, and with --json every time measured and the load average.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def sync_saves(args):
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
    return {"mode": args.mode, "state_bytes": sum(t.nbytes for t in state.values()),
            "first_s": round(wall[0], 3), "later_s": [round(t, 3) for t in wall[1:]],
            "cpu_s": [round(c, 3) for c in cpu], "rss_growth_mb": round((rss_bytes() - rss0) / 2**20),
            "writer_buffers_mb": native.snapshot_capacity >> 20}


def async_run(path, copy, size, directory, saves):
    """In this (fresh) process: the first async save, `saves` - 1 later ones,
    then `saves` synchronous ones, all of one state to one path. Each async
    save is waited for (and the writer joined) before the next. copy=None:
    the synchronous saves only (the first one in a fresh process)."""
    import torch.distributed.checkpoint as dcp

    from ckpt_bench import weights_like
    from ebbtide import checkpoint
    from ebbtide.dcp import EbbtideWriter

    state = weights_like(size)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    target = os.path.join(directory, "c")
    if path == "native":
        w = checkpoint.Writer()
        snapshot = "blocking" if copy else "none"

        def asave():
            return w.save(state, target, async_=True, snapshot=snapshot)

        def finish(h):
            h.wait()

        def ssave():
            w.save(state, target)
    else:
        w = EbbtideWriter(target, staging="copy" if copy else "none")

        def asave():
            return dcp.async_save(state, storage_writer=w)

        def finish(f):
            f.result()

        def ssave():
            dcp.save(state, storage_writer=w)
    blocked, total = [], []
    for _ in range(saves if copy is not None else 0):
        t0 = time.perf_counter()
        h = asave()
        blocked.append(time.perf_counter() - t0)
        finish(h)
        total.append(time.perf_counter() - t0)
        w.join()
    sync = []
    for _ in range(saves):
        t0 = time.perf_counter()
        ssave()
        sync.append(time.perf_counter() - t0)
        w.join()
    if copy is None:
        return {"path": path, "sync_s": sync, "loadavg": os.getloadavg()}
    return {"path": path, "copy": copy, "state_bytes": sum(t.nbytes for t in state.values()),
            "first_blocked_s": blocked[0], "later_blocked_s": blocked[1:], "async_total_s": total,
            "sync_s": sync, "loadavg": os.getloadavg()}


ROWS = (("native", True, "checkpoint.save(async_=True)"),
        ("native", False, "checkpoint.save(async_=True, snapshot='none')"),
        ("dcp", True, "dcp.async_save, EbbtideWriter()"),
        ("dcp", False, "dcp.async_save, EbbtideWriter(staging='none')"))


def child(args, path, copy, tag):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{path},{tag}", "--size", str(args.size),
           "--dir", os.path.join(args.dir, f"{path}-{tag}"), "--saves", str(args.saves)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"ckpt_first_save: the {path} run ({tag}) failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def async_bench(args):
    runs, first_sync = [], {}
    for path, copy, name in ROWS:
        if args.only and path != args.only:
            continue
        if path not in first_sync:  # the first synchronous save in a fresh process, for comparison
            first_sync[path] = child(args, path, None, "sync")["sync_s"][0]
        r = child(args, path, copy, int(copy))
        sync = statistics.median(r["sync_s"])
        later = statistics.median(r["later_blocked_s"]) if r["later_blocked_s"] else float("nan")
        r.update(name=name, sync_median_s=sync, later_blocked_median_s=later, first_sync_s=first_sync[path],
                 first_ratio=r["first_blocked_s"] / sync, first_vs_first_sync=r["first_blocked_s"] / first_sync[path],
                 later_ratio=later / sync)
        runs.append(r)
    print(f"{'async save':<46} {'sync s':>6} {'1st sync':>8} {'first blocked (/sync, /1st sync)':>33} "
          f"{'later blocked (med)':>20} {'load':>5}")
    for r in runs:
        print(f"{r['name']:<46} {r['sync_median_s']:6.3f} {r['first_sync_s']:8.3f} {r['first_blocked_s']:9.3f} s "
              f"{r['first_ratio']:7.1%} {r['first_vs_first_sync']:7.1%} {r['later_blocked_median_s']:10.3f} s "
              f"{r['later_ratio']:6.1%} {r['loadavg'][0]:5.2f}")
    gb = runs[0]["state_bytes"] / 1e9 if runs else 0
    print(f"state {gb:.3f} GB, {args.saves} async and {args.saves} sync saves per fresh process ('sync s': their "
          "median; '1st sync': the first sync save in a fresh process of its own); targets: first <= 100%, later "
          "<= 10% of the sync save")
    return {"size_gb": gb, "saves": args.saves, "first_sync_s": first_sync, "runs": runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("native", "dcp", "async"), default="native")
    ap.add_argument("--dir", required=True, help="scratch directory (emptied first)")
    ap.add_argument("--size", type=float, default=1.0, help="state size in GB")
    ap.add_argument("--saves", type=int, default=4, help="saves of each kind per process")
    ap.add_argument("--only", choices=("native", "dcp"), help="--mode async: one of the two paths")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # PATH,COPY: one async run, in this process
    args = ap.parse_args()
    if args.saves < 2:
        ap.error("--saves must be at least 2 (a first save and a later one)")
    if args.child:
        path, copy = args.child.split(",")
        print(json.dumps(async_run(path, None if copy == "sync" else copy == "1", args.size, args.dir, args.saves)))
        return
    if args.mode == "async":
        out = async_bench(args)
    else:
        out = sync_saves(args)
        print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
