"""`ebbtide demo`: the main job (see ebbtide.harness.demo)."""
import sys

from ebbtide.commands import report


def register(subparsers):
    from ebbtide.harness.methods import EXTRA_METHODS, METHODS
    from ebbtide.harness.models import DEFAULT_MODEL, MODELS

    p = subparsers.add_parser(
        "demo", help="train a small HF model with and without offloading and compare")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=MODELS,
                   help=f"random-init HF model (default {DEFAULT_MODEL}; Llama-family first)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per method (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--seq", type=int, help="sequence length (default: 256 CPU, 1024 GPU)")
    p.add_argument("--batch", type=int, help="micro-batch size (default: 4 CPU, 8 GPU)")
    p.add_argument("--layers", type=int, help="transformer blocks (default: 4 CPU, 12 GPU)")
    p.add_argument("--hidden", type=int, help="hidden size (default: 256 CPU, 1024 GPU)")
    p.add_argument("--heads", type=int, help="attention heads (default: 8 CPU, 16 GPU)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of {','.join(METHODS + EXTRA_METHODS)} (default: {','.join(METHODS)})")
    p.add_argument("--path", help="directory for ebbtide's SSD files (default: a temporary one)")
    p.add_argument("--png", default="ebbtide-demo.png",
                   help="plot of throughput against peak memory (default ebbtide-demo.png; "
                        "'' for none)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args):
    from ebbtide._progress import progress, wanted
    from ebbtide.harness.demo import format_table, plot, run_demo
    from ebbtide.harness.methods import EXTRA_METHODS, METHODS

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    valid = METHODS + EXTRA_METHODS
    bad = [m for m in methods if m not in valid]
    if bad:
        raise ValueError(f"--methods: {', '.join(bad)} not valid (valid: {', '.join(valid)})")
    shown = wanted(args.json)
    with progress(total=max(args.warmup, 0) + max(args.steps, 0), desc="ebbtide demo",
                  shown=shown) as bar:
        log = bar.log(sys.stderr if args.json else sys.stdout)
        result = run_demo(model=args.model, methods=methods, steps=args.steps, warmup=args.warmup,
                          seq=args.seq, batch=args.batch, layers=args.layers, hidden=args.hidden,
                          heads=args.heads, device=args.device, dtype=args.dtype, path=args.path,
                          log=log, progress=bar if shown else None)
    return report(args, result, format_table, plot)
