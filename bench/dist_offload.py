#!/usr/bin/env python3
"""Activation offloading under torch.distributed wrappers, launched with torchrun.

    torchrun --standalone --nproc_per_node 2 bench/dist_offload.py [--json FILE]

For each wrapper (--wraps) a random-init GPT-2 is trained for --steps AdamW
steps (after --warmup) under each method (--methods); every method starts from
the same weights and sees the same batches and dropout masks, and the methods'
steps alternate so machine load hits all alike. Rank 0 prints a table:
median step time and its ratio over no offload under the same wrapper, the
step's peak memory (largest over the ranks), tensors and bytes offloaded per
rank, and the largest |gradient difference| against no offload on any rank
and step (0 = bitwise equal).

Wrappers:
  plain     the model on each rank, no communication (the reference for what
            a rank's activations are)
  ddp       DistributedDataParallel
  fsdp2     fully_shard per transformer block and the root (DTensor shards)
  fsdp1     FullyShardedDataParallel per block, use_orig_params=False (flat
            parameters)
  pipeline  torch.distributed.pipelining, one stage per rank (blocks split
            evenly; embeddings on the first, head on the last), Schedule1F1B
            over --microbatches

Parameters (unsharded FSDP weights, flat parameters and their views) must
never be offloaded: under ddp, fsdp1 and fsdp2 the tensors a rank's cache
takes (tensors_saved, saved_bytes_total: after the never-offload filter, before
timing decides what is forwarded) are exactly those it takes under plain. Backend gloo on CPU, nccl on CUDA (one GPU per rank).
"""
import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from bench_common import write_result  # noqa: E402

WRAPS = ("plain", "ddp", "fsdp2", "fsdp1", "pipeline")
METHODS = ("none", "ebbtide-cpu", "ebbtide-ssd")


def _stage_module(model, rank, world):
    """Rank's pipeline stage of a GPT2LMHeadModel: a contiguous run of blocks,
    the embeddings on the first stage, final norm and tied head on the last."""
    import torch
    from torch import nn

    t = model.transformer
    n = len(t.h)
    if n < world:
        raise SystemExit(f"--wraps pipeline: {n} layers cannot make {world} stages (one per rank); "
                         "raise --layers")
    lo, hi = rank * n // world, (rank + 1) * n // world
    first, last = rank == 0, rank == world - 1

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            if first:
                self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
            self.h = nn.ModuleList(t.h[lo:hi])
            if last:
                self.ln_f = t.ln_f
                # The head's weight is the embedding's on one rank only: give
                # the last stage its own copy (pipelines untie it this way).
                self.lm_head = nn.Linear(t.wte.weight.shape[1], t.wte.weight.shape[0], bias=False)
                with torch.no_grad():
                    self.lm_head.weight.copy_(t.wte.weight)

        def forward(self, x):
            if first:
                pos = torch.arange(x.shape[1], device=x.device)
                x = self.drop(self.wte(x) + self.wpe(pos))
            for block in self.h:
                x = block(x)
                if isinstance(x, tuple):
                    x = x[0]
            if last:
                x = self.lm_head(self.ln_f(x))
            return x

    return Stage()


class _Job:
    """One (wrapper, method): its model copy, optimizer and activation handling."""

    def __init__(self, wrap, method, base, make_batch, args, device, workdir):
        import torch
        import torch.distributed as dist

        from ebbtide.harness.methods import _method_context

        self.wrap, self.method, self.args, self.device = wrap, method, args, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.make_batch = make_batch
        model = copy.deepcopy(base)
        self.schedule = None
        if wrap == "plain":
            self.module = model
        elif wrap == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.module = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        elif wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.transformer.h:
                fully_shard(block)
            self.module = fully_shard(model)
        elif wrap == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            block_cls = type(model.transformer.h[0])
            self.module = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block_cls}),
                                                   device_id=device, use_orig_params=False)
        elif wrap == "pipeline":
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            self.module = _stage_module(model, self.rank, self.world)
            stage = PipelineStage(self.module, self.rank, self.world, device)

            def loss_fn(logits, target):
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

            self.schedule = Schedule1F1B(stage, args.microbatches, loss_fn=loss_fn)
        else:
            raise SystemExit(f"--wraps: {wrap!r} is not one of {', '.join(WRAPS)}")
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        sub = os.path.join(workdir, f"{wrap}-{method}-rank{self.rank}")
        os.makedirs(sub, exist_ok=True)
        self.enter, self.cache, self.cleanup = _method_context(method, self.module, device, sub)
        self.times, self.peaks, self.stats, self.max_diff = [], [], [], 0.0

    def step(self, i):
        """Runs step i; returns the local gradients (on the host)."""
        import torch

        from ebbtide.harness.memmeter import PeakMeter

        # Pipeline stages need the same batch on every rank (ids on the first,
        # targets on the last); data parallel ranks each take their own.
        seed = 1000 + i + (0 if self.schedule is not None else 7919 * self.rank)
        inputs = self.make_batch(self.args.batch, torch.Generator().manual_seed(seed))
        torch.manual_seed(i)  # the same dropout masks for every method
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        with PeakMeter(self.device, caches=[self.cache] if self.cache is not None else ()) as meter:
            with self.enter():
                if self.schedule is None:
                    self.module(**inputs).loss.backward()
                elif self.rank == 0:
                    self.schedule.step(inputs["input_ids"])
                elif self.rank == self.world - 1:
                    self.schedule.step(target=inputs["labels"])
                else:
                    self.schedule.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        grads = []
        for p in self.module.parameters():
            g = p.grad
            if g is not None and hasattr(g, "to_local"):  # DTensor: this rank's shard
                g = g.to_local()
            grads.append(None if g is None else g.detach().to("cpu", copy=True))
        self.opt.step()
        return dt, meter.peak_bytes, grads

    def record(self, dt, peak):
        self.times.append(dt)
        self.peaks.append(peak)
        if self.cache is not None:
            self.stats.append(self.cache.stats())


def _diff(grads, ref):
    from ebbtide.harness.demo import max_grad_diff

    return max_grad_diff([grads], [ref])


def run(args):
    import torch
    import torch.distributed as dist

    from ebbtide.harness.models import build_model

    if args.device not in (None, "cpu", "cuda"):
        raise SystemExit(f"--device {args.device!r}: use cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to torch")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    base, make_batch = build_model("gpt2", args.layers, args.hidden, args.heads, args.seq, dtype, device)
    wraps = [w for w in args.wraps.split(",") if w]
    methods = ["none"] + [m for m in args.methods.split(",") if m and m != "none"]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"--methods: {m!r} is not one of {', '.join(METHODS)}")
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="ebbtide-dist-", dir=args.path) as workdir:
            for wrap in wraps:
                jobs = [_Job(wrap, m, base, make_batch, args, device, workdir) for m in methods]
                try:
                    order = list(jobs)
                    for i in range(args.warmup + args.steps):
                        if rank == 0:
                            print(f"[dist] {wrap}: step {i + 1}/{args.warmup + args.steps}", file=sys.stderr)
                        grads = {}
                        for job in order:
                            dt, peak, grads[job.method] = job.step(i)
                            if i >= args.warmup:
                                job.record(dt, peak)
                        for job in jobs:
                            job.max_diff = max(job.max_diff, _diff(grads[job.method], grads["none"]))
                        order = order[1:] + order[:1]
                finally:
                    for job in jobs:
                        job.cleanup()
                rows.extend(_gather_rows(wrap, jobs, world))
    finally:
        dist.destroy_process_group()
    return dict(model="gpt2", layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                batch=args.batch, dtype=args.dtype, microbatches=args.microbatches, world_size=world,
                device=device.type, steps=args.steps, warmup=args.warmup, rows=rows) if rank == 0 else None


def _gather_rows(wrap, jobs, world):
    import torch.distributed as dist

    mine = []
    for job in jobs:
        last = job.stats[-1] if job.stats else {}
        mine.append(dict(method=job.method, step_seconds=statistics.median(job.times), peak_bytes=max(job.peaks),
                         max_grad_diff=job.max_diff,
                         tensors_offloaded=last.get("tensors_offloaded", 0),
                         bytes_offloaded=last.get("bytes_offloaded", 0),
                         tensors_saved=last.get("tensors_saved", 0),
                         tensors_forwarded=last.get("tensors_forwarded", 0),
                         peak_resident_bytes=last.get("peak_resident_bytes", 0),
                         saved_bytes_total=last.get("saved_bytes_total", 0)))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    rows = []
    for k, job in enumerate(jobs):
        per_rank = [r[k] for r in everyone]
        rows.append(dict(wrap=wrap, method=job.method,
                         step_seconds=max(r["step_seconds"] for r in per_rank),
                         peak_bytes=max(r["peak_bytes"] for r in per_rank),
                         max_grad_diff=max(r["max_grad_diff"] for r in per_rank),
                         ranks=per_rank))
    ref = rows[0]
    for row in rows:
        row["step_time_ratio"] = row["step_seconds"] / ref["step_seconds"]
        row["peak_ratio"] = row["peak_bytes"] / ref["peak_bytes"] if ref["peak_bytes"] else None
    return rows


def format_table(result):
    from ebbtide import _core

    fb = _core.format_bytes
    lines = [f"dist_offload: gpt2 layers={result['layers']} hidden={result['hidden']} heads={result['heads']} "
             f"seq={result['seq']} batch={result['batch']} {result['dtype']} on {result['world_size']} "
             f"{result['device']} ranks, {result['steps']} steps (+{result['warmup']} warm-up)",
             f"{'wrap':<10}{'method':<13}{'step s':>9}{'ratio':>7}{'peak mem':>12}{'ratio':>7}"
             f"{'offloaded/rank':>28}{'max|dgrad|':>12}"]
    for r in result["rows"]:
        peak_ratio = f"{r['peak_ratio']:.2f}" if r["peak_ratio"] is not None else "-"
        t = sorted({x["tensors_offloaded"] for x in r["ranks"]})
        b = sorted({x["bytes_offloaded"] for x in r["ranks"]})
        off = f"{'/'.join(map(str, t))} ({'/'.join(fb(x) for x in b)})"
        lines.append(f"{r['wrap']:<10}{r['method']:<13}{r['step_seconds']:>9.3f}{r['step_time_ratio']:>7.2f}"
                     f"{fb(r['peak_bytes']):>12}{peak_ratio:>7}{off:>28}{r['max_grad_diff']:>12.3g}")
    lines.append("step s: the slowest rank's median; peak mem: the largest rank's step peak above its start; "
                 "offloaded/rank: the distinct per-rank counts of the last step.")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--wraps", default=",".join(WRAPS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches per step")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    ap.add_argument("--path", default=None, help="directory for the SSD files")
    ap.add_argument("--json", default=None, help="rank 0 writes every number to this file")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("dist_offload.py runs under torchrun: torchrun --standalone --nproc_per_node 2 "
                         "bench/dist_offload.py")
    if args.batch % args.microbatches and "pipeline" in args.wraps:
        raise SystemExit(f"--batch {args.batch} is not divisible by --microbatches {args.microbatches}")
    result = run(args)
    if result is None:
        return 0
    print(format_table(result))
    write_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
