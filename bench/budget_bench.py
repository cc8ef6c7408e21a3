#!/usr/bin/env python3
"""Activation budgets on CPU (issue 29): a Llama-style model, keep / ebbtide
offloading every block / full recompute (HF gradient checkpointing) / ebbtide
with a budget at --points budgets from the smallest the planner meets to the
keep-all peak, stepped in turn (ebbtide.harness.budget_sweep). Runs twice: SSD writes
uncapped, then capped (--cap MB/s; default a quarter of what offloading every
block during the forward would need) so the link cannot carry everything.
Prints a table per sweep; --json FILE and --png FILE (step time against
measured peak: the ROK frontier) write the results.

Targets (issue 29): the measured peak at most 5% over each budget; step time
never above the fastest fixed strategy that fits the same budget (5%); below
both offload and recompute somewhere in the capped sweep; gradients bitwise.

GPU stage (--fractions, e.g. `--device cuda --shape a --fractions 0.5,0.25`,
scripts/gpu_check.sh's `budget` and `budget_compiled`;
ebbtide.harness.budget_stage): one model built on the device, a copy per
strategy, stepped in turn: the single strategies (keep, full recompute with
HF checkpointing, offload of every block, torchtune's offloading with HF
checkpointing), torch's activation_memory_budget at the fractions with each
block compiled, and ebbtide with --target (default auto: host memory first,
what a user with 125 GiB of host memory picks) at budgets of those fractions
of keep's saved activations (budget) and at --points allocator budgets from
keep's allocator peak down to full recompute's (memory: the cache's
memory_budget_bytes); ssd, the same budgets with target ssd, is kept apart (rows and
trace say so). --compile block compiles every strategy's blocks
(torchtitan style): compiled keep, compiled full recompute and ebbtide on
the compiled blocks against activation_memory_budget. --strategies narrows
them. Peaks are the allocator's above the step's start
(max_memory_allocated; on the CPU the heap meter's). Targets: ebbtide
(budget, memory) faster than each peer whose peak is at or above its own;
each allocator budget met within 5% (or refused at the first step) and no
slower than the fastest single strategy whose peak fits it; at full
recompute's own peak at least 5% faster than it. Exit code 3 when a target
is missed. Progress goes to stderr, flushed, each line with the seconds
since the start: the model built (once, on the device), each strategy set
up, each strategy's step. --time-limit stops the rounds so the table comes
out in time (a strategy left without a timed step is a row marked cut);
--strategy-limit cuts a strategy whose steps, compiles included, take
longer; --watchdog dumps every thread's stack when no progress line came
for that long (and on SIGTERM: a killed run shows where it was). --trace
FILE writes the step trace `ebbtide plan --replay` reads: one run per
ebbtide row that planned (kind budget; ssd's apart), keep's and full
recompute's on the first one's profile, each with its measured step,
allocator peak, per-block allocator levels and keep's per-block times
(docs/benchmarks.md, "Step traces").
"""
import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from bench_common import write_trace  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn-hidden", "vocab", "seq", "batch"):
        ap.add_argument(f"--{name}", type=int, help="model shape (default: ebbtide.harness.budget_sweep.DEFAULT_MODEL, "
                                                     "or the --shape)")
    ap.add_argument("--points", type=int, default=None, help="budgets per sweep (default 6; the GPU stage's "
                    "allocator budgets: 5)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per strategy (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (the first profiles)")
    ap.add_argument("--cap", type=float, default=None, help="SSD write cap of the second sweep in MB/s")
    ap.add_argument("--only", choices=["uncapped", "capped"], help="run one sweep")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--shape", choices=["a"], help="bench/offload_bench.py's shape (a); flags override it")
    ap.add_argument("--fractions", help="GPU stage: comma-separated fractions of the keep-all peak")
    ap.add_argument("--strategies", default="keep,recompute,offload,torchtune,compiler,budget,memory,ssd",
                    help="GPU stage: which strategies run (default: all)")
    ap.add_argument("--target", default="auto", choices=["auto", "cpu", "ssd"],
                    help="GPU stage: the cache's target for budget and memory (default auto)")
    ap.add_argument("--compile", default="none", choices=["none", "block"],
                    help="GPU stage: block compiles every strategy's blocks")
    ap.add_argument("--trace", help="GPU stage: write the step trace (ebbtide plan --replay) to this file")
    ap.add_argument("--time-limit", type=float, help="GPU stage: seconds from the start after which no step "
                    "starts (nor a round that would end past it); the table comes out with what ran")
    ap.add_argument("--strategy-limit", type=float, help="GPU stage: cut a strategy (not keep) whose steps, "
                    "compiles included, took longer than this many seconds in all")
    ap.add_argument("--watchdog", type=float, default=120.0, help="GPU stage: dump every thread's stack to "
                    "stderr when no progress line came for this many seconds (0: off; default 120)")
    ap.add_argument("--path", help="directory for ebbtide's SSD files (default: a temporary one)")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--png", help="write the plot to this file")
    args = ap.parse_args()
    started = time.monotonic()
    # A run killed by a timeout (SIGTERM) first shows where each thread was.
    faulthandler.register(signal.SIGTERM, chain=True)

    import torch

    from ebbtide.harness import budget_stage, budget_sweep

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = dict(budget_sweep.SHAPE_A if args.shape == "a" else budget_sweep.DEFAULT_MODEL)
    spec = dict(base, **{k: v for k, v in dict(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                                kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden,
                                                vocab=args.vocab, seq=args.seq, batch=args.batch).items()
                         if v is not None})
    watchdog = args.watchdog if args.fractions else 0

    def log(msg):
        print(f"[{time.monotonic() - started:6.1f} s] {msg}", file=sys.stderr, flush=True)
        if watchdog > 0:
            faulthandler.dump_traceback_later(watchdog, file=sys.stderr)

    if args.fractions:
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
            args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")]
        if "compiler" in strategies or args.compile == "block":
            torch._logging.set_logs(recompiles=True)  # a recompile between steps is in the log, with its reason
        log(f"[budget] {', '.join(strategies)} at {args.fractions} on {args.device}, target {args.target}"
            + (", blocks compiled" if args.compile == "block" else "") + f", {args.warmup} + {args.steps} steps"
            + (f", time limit {args.time_limit:g} s" if args.time_limit else ""))
        time_limit = args.time_limit - (time.monotonic() - started) if args.time_limit else None
        label = f"shape {args.shape}" if args.shape else f"llama h={spec['hidden']}"
        label += " compiled" if args.compile == "block" else ""
        result = budget_stage.run_fractions(spec, fractions=fractions, strategies=strategies,
                                            steps=args.steps, warmup=args.warmup, device=args.device,
                                            dtype=dtype, path=args.path, log=log, time_limit=time_limit,
                                            strategy_limit=args.strategy_limit, points=args.points or 5,
                                            target=args.target, compile=args.compile == "block",
                                            trace_name=label if args.trace else None)
        faulthandler.cancel_dump_traceback_later()
        from torch._dynamo.utils import counters

        # One graph per compiled fraction; frames: how many times dynamo compiled a frame.
        result["dynamo"] = dict(stats=dict(counters["stats"]), frames=dict(counters["frames"]))
        result["strategies"] = strategies
        result["seconds"] = round(time.monotonic() - started, 1)
        log(f"[budget] done; dynamo: {result['dynamo']}")
        print(budget_stage.format_fractions(result), flush=True)
        runs = result.pop("trace_runs", None)
        if args.trace:
            result["trace"] = os.path.basename(args.trace)
            write_trace(args.trace, runs or [], bench="budget_bench", device=args.device, shape=args.shape,
                        compiled=args.compile == "block", target=args.target)
            print(f"trace: {args.trace} ({len(runs or [])} runs)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        sys.exit(0 if result["target_met"] else 3)
    results = []
    if args.only != "capped":
        results.append(budget_sweep.run_sweep(spec, points=args.points or 6, steps=args.steps, warmup=args.warmup,
                                              path=args.path, log=log))
        print(budget_sweep.format_table(results[-1]), flush=True)
    if args.only != "uncapped":
        cap = args.cap
        if cap is None:
            base = results[0] if results else budget_sweep.run_sweep(spec, points=2, steps=1, warmup=2,
                                                                     path=args.path, log=log)
            keep = next(r for r in base["rows"] if r["strategy"] == "keep")
            # Offloading every block during the forward (about a third of the step) would need this rate.
            cap = round(0.25 * keep["peak_bytes"] / (keep["step_seconds"] / 3) / 1e6, 1)
        results.append(budget_sweep.run_sweep(spec, points=args.points or 6, steps=args.steps, warmup=args.warmup,
                                              max_write_mbps=cap, path=args.path, log=log))
        print(budget_sweep.format_table(results[-1]), flush=True)
    try:
        load = os.getloadavg()
        print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    except OSError:
        pass
    if args.png:
        budget_sweep.plot(results, args.png)
        print(f"plot: {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(sweeps=results, png=args.png), f, indent=2)


if __name__ == "__main__":
    main()
