#!/usr/bin/env python3
"""Adaptive offloading under an SSD write cap that cannot carry every activation.

Methods on a GPT-2-style model on CPU (steps alternate between methods so
drifting machine load hits all alike; medians over --steps):
  none     no offloading
  all      TensorCache(target="ssd", adaptive=False, max_write_mbps=CAP):
           every block offloaded through the capped SSD
  planned  TensorCache(target="auto", host_budget_bytes=0, max_write_mbps=CAP):
           the first step profiles, the planner offloads what the cap can hide
Prints median step time, its ratio over none, peak_resident_bytes over
saved_bytes_total (activation peak fraction: 1.0 = no reduction) and what the
plan chose; --json FILE writes the numbers. Target (issue 4): planned step
time within 1.05x of none while it offloads what fits.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from bench_common import gpt2_batch, timed_step  # noqa: E402


def run(args):
    import torch

    import ebbtide

    model, batch = gpt2_batch(args)

    workdir = args.path or tempfile.mkdtemp(prefix="ebbtide-planner-bench-")
    methods = [m for m in args.methods.split(",") if m]
    for sub in ("all", "planned"):
        os.makedirs(os.path.join(workdir, sub), exist_ok=True)
    caches = {}
    for m in methods:
        if m == "none":
            caches[m] = None
        elif m == "all":
            caches[m] = ebbtide.TensorCache(target="ssd", path=os.path.join(workdir, "all"), adaptive=False,
                                            max_write_mbps=args.max_write_mbps)
        elif m == "planned":
            caches[m] = ebbtide.TensorCache(target="auto", path=os.path.join(workdir, "planned"),
                                            host_budget_bytes=0, max_write_mbps=args.max_write_mbps)
        else:
            raise SystemExit(f"--methods: {m!r} is not one of none, all, planned")
    # One model, one cache attached at a time: hooks of the others must not fire.
    times = {m: [] for m in methods}
    stats = {}
    first = {}
    for i in range(args.warmup + args.steps):
        for name in methods:
            cache = caches[name]
            if cache is not None:
                cache.attach(model)
            dt, _ = timed_step(model, batch, cache)
            if cache is not None:
                cache.detach()
                s = cache.stats()
                stats.setdefault(name, []).append(s)
                first.setdefault(name, dt)
            if i >= args.warmup:
                times[name].append(dt)
    load = os.getloadavg()
    base = statistics.median(times["none"]) if "none" in times else None
    rows = []
    for name in methods:
        med = statistics.median(times[name])
        row = dict(method=name, median_step_seconds=med, steps=times[name],
                   step_time_ratio=med / base if base else None)
        if caches[name] is not None:
            measured = stats[name][args.warmup:]
            peak_frac = [s["peak_resident_bytes"] / s["saved_bytes_total"] for s in measured if s["saved_bytes_total"]]
            row.update(peak_resident_fraction=statistics.median(peak_frac),
                       saved_bytes=measured[-1]["saved_bytes_total"],
                       peak_resident_bytes=measured[-1]["peak_resident_bytes"],
                       bytes_offloaded=statistics.median(s["bytes_offloaded"] for s in measured),
                       stall_seconds=statistics.median(s["stall_seconds"] for s in measured),
                       first_step_seconds=first[name])
            last = measured[-1]
            if last.get("planner"):
                p = last["planner"]
                row.update(plan=[d["placement"] for d in p["modules"]],
                           predicted_stall_seconds=p["predicted_stall_seconds"],
                           predicted_peak_fraction=p["peak_resident_fraction"],
                           planned_write_bps=p["planned_write_bps"], replans=last["replans"],
                           measured_bandwidth=last["measured_bandwidth"])
        else:
            row.update(peak_resident_fraction=1.0)
        rows.append(row)
    for c in caches.values():
        if c is not None:
            c.close()
    return dict(config=dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                            batch=args.batch, threads=torch.get_num_threads(), steps=args.steps,
                            warmup=args.warmup, max_write_mbps=args.max_write_mbps),
                loadavg=list(load), rows=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="steps not timed (the planned run profiles in the first)")
    ap.add_argument("--max-write-mbps", type=float, default=200.0)
    ap.add_argument("--methods", default="none,all,planned")
    ap.add_argument("--path", default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.warmup < 1 and "planned" in args.methods:
        ap.error("--warmup must be >= 1: the planned run's first step is its profiling step")
    result = run(args)
    c = result["config"]
    print(f"GPT-2 layers={c['layers']} hidden={c['hidden']} seq={c['seq']} batch={c['batch']} "
          f"threads={c['threads']} steps={c['steps']} SSD write cap {c['max_write_mbps']:g} MB/s; "
          f"load average {' '.join(f'{x:.2f}' for x in result['loadavg'])}")
    print(f"{'method':<8} {'median s':>9} {'ratio':>6} {'peak/saved':>10} {'offl MiB':>9} {'stall s':>8}  plan")
    for r in result["rows"]:
        ratio = f"{r['step_time_ratio']:.3f}" if r.get("step_time_ratio") else "-"
        plan = ""
        if r.get("plan"):
            short = {"keep": "k", "offload_cpu": "c", "offload_ssd": "s"}
            plan = ("".join(short[p] for p in r["plan"]) +
                    f"  predicted stall {r['predicted_stall_seconds']:.3f} s, peak {r['predicted_peak_fraction']:.2f}"
                    f", planned write {r['planned_write_bps'] / 1e6:.0f} MB/s, replans {r['replans']}")
        print(f"{r['method']:<8} {r['median_step_seconds']:>9.3f} {ratio:>6} {r['peak_resident_fraction']:>10.3f} "
              f"{r.get('bytes_offloaded', 0) / 2**20:>9.1f} {r.get('stall_seconds', 0):>8.3f}  {plan}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
