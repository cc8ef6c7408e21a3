#!/usr/bin/env python3
"""Issue 40's CPU budget case: 8 blocks of Linear(1024, 4096) -> GELU ->
Linear(4096, 1024) at batch 256 (9 MiB saved per block, 72 MiB in all),
SSD target, under activation and memory budgets (Note [Two budgets] in
python/ebbtide/cache/budget.py). At ba3f2cb a 20 MiB budget held 28 MiB
(predicted 19) and 40 MiB held 46 (predicted 37), nothing recomputed and
nothing said.

Per budget: the largest peak of resident saved bytes over the steps after
the profiling step, its ratio to the budget, the plan's predicted peak and
its ratio to the measured one, what was recomputed or offloaded, and the
median step time. Targets (issue 40): the budget held within 5% (or
refused at the first step, naming the smallest), the prediction within
10%. Exit code 3 when a target is missed. --json FILE writes the table.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from bench_common import write_result  # noqa: E402

MiB = 1 << 20


def mlp(torch, blocks, batch):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(1024, 4096)
            self.g = torch.nn.GELU()
            self.b = torch.nn.Linear(4096, 1024)

        def forward(self, x):
            return self.b(self.g(self.a(x)))

    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(blocks)]), torch.randn(batch, 1024)


def one(args, knob, mib, path):
    import torch

    import ebbtide

    model, x = mlp(torch, args.blocks, args.batch)
    budget = int(mib * MiB)
    row = dict(knob=knob, budget_bytes=budget)
    try:
        cache = ebbtide.TensorCache("ssd", path, **{knob: budget}).attach(model)
    except ValueError as e:
        return dict(row, refused=str(e))
    peaks, times = [], []
    try:
        for i in range(args.steps + 1):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with cache.step():
                model(x).sum().backward()
            s = cache.stats()
            if i:  # the first step profiles
                peaks.append(s["peak_resident_bytes"])
                times.append(time.perf_counter() - t0)
    except ValueError as e:
        cache.close()
        return dict(row, refused=str(e))
    cache.close()
    peak = max(peaks)
    predicted = s["predicted_peak_bytes"]
    return dict(row, peak_bytes=peak, peak_over_budget=peak / budget, predicted_peak_bytes=predicted,
                predicted_over_measured=predicted / peak if peak else None,
                recomputed=list(s["recomputed_blocks"]), bytes_offloaded=s["bytes_offloaded"],
                step_seconds=statistics.median(times), replans=s["replans"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="20,40", help="MiB, comma-separated (default 20,40)")
    p.add_argument("--knobs", default="activation_budget_bytes,memory_budget_bytes")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="measured steps after the profiling step")
    p.add_argument("--path", help="SSD folder (default: a temporary one)")
    p.add_argument("--json", help="write the table here")
    args = p.parse_args(argv)
    rows = []
    for knob in [k for k in args.knobs.split(",") if k]:
        for mib in [float(b) for b in args.budgets.split(",") if b]:
            with tempfile.TemporaryDirectory(dir=args.path) as d:
                rows.append(one(args, knob, mib, d))
    print(f"{'budget':>22} {'MiB':>6} {'peak MiB':>9} {'/budget':>8} {'predicted':>10} {'/measured':>10} "
          f"{'step s':>7}  recomputed, offloaded")
    missed = []
    for r in rows:
        name = r["knob"].replace("_budget_bytes", "")
        if "refused" in r:
            print(f"{name:>22} {r['budget_bytes'] / MiB:6.1f}  refused: {r['refused']}")
            continue
        print(f"{name:>22} {r['budget_bytes'] / MiB:6.1f} {r['peak_bytes'] / MiB:9.1f} {r['peak_over_budget']:8.3f} "
              f"{r['predicted_peak_bytes'] / MiB:10.1f} {r['predicted_over_measured']:10.3f} {r['step_seconds']:7.3f}  "
              f"{r['recomputed'] or '-'}, {r['bytes_offloaded'] / MiB:.1f} MiB")
        if r["peak_over_budget"] > 1.05:
            missed.append(f"{name} {r['budget_bytes'] / MiB:.0f} MiB: peak {r['peak_over_budget']:.3f}x the budget")
        if abs(r["predicted_over_measured"] - 1) > 0.10:
            missed.append(f"{name} {r['budget_bytes'] / MiB:.0f} MiB: prediction {r['predicted_over_measured']:.3f}x")
    for m in missed:
        print("target missed:", m)
    if args.json:
        write_result(dict(rows=rows, targets_missed=missed, blocks=args.blocks, batch=args.batch), args.json)
    return 3 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
