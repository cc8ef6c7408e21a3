#!/usr/bin/env python3
"""Quick CPU check of activation offloading on a GPT-2-style model.

Median step time with offload over no offload, and peak_resident_bytes over the
no-offload activation peak (every saved activation is resident at the end of a
forward without offloading, which is the step's saved_bytes_total). Prints a
table; --json FILE writes the numbers. Steps alternate between methods so
drifting machine load hits both alike.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from bench_common import gpt2_batch, timed_step  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--targets", default="ssd,cpu")
    ap.add_argument("--path", default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    import ebbtide

    model, batch = gpt2_batch(args)

    workdir = args.path or tempfile.mkdtemp(prefix="ebbtide-bench-")
    caches = {"none": None}
    for t in args.targets.split(","):
        if t:
            caches[t] = ebbtide.TensorCache(target=t, path=workdir if t == "ssd" else None)
            caches[t].attach(model)
    times = {k: [] for k in caches}
    cpu_times = {k: [] for k in caches}  # process CPU seconds (all threads): robust to other load
    stats = {}
    for i in range(args.warmup + args.steps):
        for name, cache in caches.items():
            dt, dc = timed_step(model, batch, cache)
            if i >= args.warmup:
                times[name].append(dt)
                cpu_times[name].append(dc)
            if cache is not None:
                stats[name] = cache.stats()
    base = statistics.median(times["none"])
    cpu_base = statistics.median(cpu_times["none"])
    rows = []
    print(f"GPT-2 layers={args.layers} hidden={args.hidden} seq={args.seq} batch={args.batch} "
          f"threads={torch.get_num_threads()} steps={args.steps}")
    print(f"{'method':<8} {'median s':>9} {'ratio':>7} {'peak MiB':>9} {'saved MiB':>10} {'peak/saved':>10} "
          f"{'offl MiB':>9} {'stall s':>8} {'cpu ratio':>9}")
    for name in caches:
        med = statistics.median(times[name])
        s = stats.get(name)
        cmed = statistics.median(cpu_times[name])
        row = dict(method=name, median_s=med, ratio=med / base, cpu_s=cmed, cpu_ratio=cmed / cpu_base)
        if s:
            row.update(peak_resident_bytes=s["peak_resident_bytes"], saved_bytes_total=s["saved_bytes_total"],
                       peak_ratio=s["peak_resident_bytes"] / max(1, s["saved_bytes_total"]),
                       bytes_offloaded=s["bytes_offloaded"], stall_seconds=s["stall_seconds"],
                       tensors_forwarded=s["tensors_forwarded"])
            print(f"{name:<8} {med:9.3f} {med / base:7.3f} {s['peak_resident_bytes'] / 2**20:9.1f} "
                  f"{s['saved_bytes_total'] / 2**20:10.1f} {row['peak_ratio']:10.3f} "
                  f"{s['bytes_offloaded'] / 2**20:9.1f} {s['stall_seconds']:8.3f} {cmed / cpu_base:9.3f}")
        else:
            print(f"{name:<8} {med:9.3f} {1.0:7.3f} {'':>9} {'':>10} {'':>10} {'':>9} {'':>8} {1.0:9.3f}")
        rows.append(row)
    for c in caches.values():
        if c is not None:
            c.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, times=times, cpu_times=cpu_times), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
