"""`ebbtide rok`: recompute-offload-keep curves (see ebbtide.harness.rok)."""
import sys

from ebbtide.commands import report


def register(subparsers):
    from ebbtide.harness.models import DEFAULT_MODEL, MODELS

    p = subparsers.add_parser("rok", help="throughput against activation peak for keep / "
                                          "offload / recompute per micro-batch size")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=MODELS)
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated micro-batch sizes")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seq", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device")
    p.add_argument("--path", help="directory for ebbtide's SSD files")
    p.add_argument("--png", help="write the plot to this file")
    p.add_argument("--budget", action="store_true",
                   help="the activation-budget curve instead (ebbtide.harness.budget_sweep, a Llama-style model): keep, "
                        "offload, full recompute and ebbtide at --budget-points budgets from the smallest the "
                        "planner meets to the keep-all peak; --batch takes one size, the model flags override")
    p.add_argument("--budget-points", type=int, default=6)
    p.add_argument("--max-write-mbps", type=float, help="with --budget: cap the SSD writes (MB/s)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run_budget(args):
    from ebbtide.harness import budget_sweep

    spec = {k: v for k, v in dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq).items()
            if v is not None}
    if args.batch != "1,2,4,8":  # given: one micro-batch size
        spec["batch"] = int(args.batch)
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    result = budget_sweep.run_sweep(spec, points=args.budget_points, steps=args.steps,
                                    warmup=max(args.warmup, 2), max_write_mbps=args.max_write_mbps,
                                    path=args.path, log=log)
    return report(args, result, budget_sweep.format_table, lambda r, png: budget_sweep.plot([r], png))


def run(args):
    if args.budget:
        return run_budget(args)
    from ebbtide._progress import progress, wanted
    from ebbtide.harness.rok import format_table, plot, run_rok

    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batch {args.batch!r}: expected comma-separated integers") from None
    shown = wanted(args.json)
    rounds = len(batches) * (max(args.warmup, 0) + max(args.steps, 0))
    with progress(total=rounds, desc="ebbtide rok", shown=shown) as bar:
        log = bar.log(sys.stderr if args.json else sys.stdout)
        result = run_rok(model=args.model, batches=batches, steps=args.steps, warmup=args.warmup,
                         device=args.device, dtype=args.dtype, path=args.path, log=log,
                         seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                         progress=bar if shown else None)
    return report(args, result, format_table, plot)
