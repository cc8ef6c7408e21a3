"""Megatron-core GPTModel (local layer spec) on one device: ebbtide's
activation budget against Megatron's own recompute and its fine-grained
activation offloading. Prints step time, the allocator's peak and the
activation peak above the step's start per strategy, and writes JSON (--json).

    python bench/megatron_offload.py --device cuda --json out.json

Strategies (--strategies, comma-separated):
  keep              Megatron with everything resident
  megatron-full     Megatron's full recompute of every layer (uniform, 1 layer)
  megatron-flags    the flags `ebbtide plan --megatron` prints for the budget
                    (full recompute of the first layers, --offload-modules)
  ebbtide-budget    ebbtide.integrations.megatron with activation_budget_bytes
  ebbtide-cpu       ebbtide offloading every layer but the last to host memory
  megatron-offload  Megatron's fine-grained offloading of --offload-modules (needs
                    Transformer Engine: the row says so where it is missing)
The budget is --budget-fraction of the saved-activation bytes of one
micro-batch as ebbtide's model counts them (family megatron), for
megatron-flags and ebbtide-budget alike.
One process, world size 1 (nccl on CUDA, gloo on CPU); on CPU Megatron's CUDA
assumptions must be patched first (python/tests/megatron_cpu.py does, for
the small-size run in test_integrations_megatron.py).
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_result  # noqa: E402

STRATEGIES = ("keep", "megatron-full", "megatron-flags", "ebbtide-budget", "ebbtide-cpu", "megatron-offload")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per forward_backward call (a budget plan counts them together)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per strategy")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing (ebbtide profiles the first)")
    p.add_argument("--budget-fraction", type=float, default=0.5)
    p.add_argument("--offload-modules", default="core_attn,attn_proj", help="for megatron-offload")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    bad = [s for s in args.strategies if s not in STRATEGIES]
    if bad:
        p.error(f"unknown strategies {bad} (valid: {', '.join(STRATEGIES)})")
    return args


def init(args):
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29547")
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    if args.device == "cuda":
        torch.cuda.set_device(0)


def seed(value):
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(value)
    mrandom.model_parallel_cuda_manual_seed(value)


def build(args, **extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = DTYPES[args.dtype]
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            use_cpu_initialization=args.device == "cpu", params_dtype=dtype, pipeline_dtype=dtype,
                            bf16=dtype == torch.bfloat16, bias_dropout_fusion=False, **extra)
    seed(7)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=args.seq)
    return model.to(args.device)


def batches(args):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.micro_batches):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        out.append(dict(tokens=ids, position_ids=torch.arange(args.seq).repeat(args.batch, 1),
                        attention_mask=~torch.tril(torch.ones(args.batch, 1, args.seq, args.seq, dtype=torch.bool)),
                        labels=torch.roll(ids, -1, dims=1)))
    return [{k: v.to(args.device) for k, v in b.items()} for b in out]


def forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return out, lambda o: (o.float().mean(), {})


def sync(args):
    if args.device == "cuda":
        torch.cuda.synchronize()


def memory(args):
    return torch.cuda.memory_allocated() if args.device == "cuda" else 0


def run_strategy(args, name, data, budget):
    """{step_seconds, peak_bytes, activation_peak_bytes, ...} for one strategy, or {skipped: reason}."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    extra, cache, row = {}, None, {}
    if name == "megatron-full":
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif name == "megatron-flags" or name == "megatron-offload":
        if name == "megatron-flags":
            from ebbtide.plan.megatron import megatron_flags, transformer_config_kwargs

            # Megatron's offloading needs Transformer Engine and a GPU: without
            # them the flags may only recompute.
            host = 1 << 40 if args.device == "cuda" and importlib.util.find_spec("transformer_engine") else 0
            m = megatron_flags(plan_config(args), activation_budget_bytes=budget, host_budget_bytes=host)
            row["flags"] = m["flags"]
            row["predicted_resident_bytes"] = m["resident_bytes"]
            extra = transformer_config_kwargs(m["flags"])
        else:
            extra = dict(fine_grained_activation_offloading=True, offload_modules=args.offload_modules.split(","))
        if extra.get("fine_grained_activation_offloading") and importlib.util.find_spec("transformer_engine") is None:
            return dict(row, skipped="Transformer Engine is not installed: Megatron's fine-grained offloading needs it")
    model = build(args, **extra)
    if name == "ebbtide-budget":
        from ebbtide.integrations.megatron import offload_megatron

        cache = offload_megatron([model], target="cpu", activation_budget_bytes=budget)
    elif name == "ebbtide-cpu":
        from ebbtide.integrations.megatron import offload_megatron

        cache = offload_megatron([model], target="cpu")
    forward_backward = get_forward_backward_func()
    times, peaks, act_peaks = [], [], []
    for step in range(args.warmup + args.steps):
        seed(100 + step)
        model.zero_grad(set_to_none=True)
        if extra.get("fine_grained_activation_offloading"):
            from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
                FineGrainedActivationOffloadingInterface as off_interface)
            off_interface.reset()
        sync(args)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start_mem = memory(args)
        t0 = time.perf_counter()
        with cache.step() if cache is not None else _null():
            forward_backward(forward_step_func=forward_step, data_iterator=iter(data), model=model,
                             num_microbatches=len(data), seq_length=args.seq, micro_batch_size=args.batch)
        sync(args)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            if args.device == "cuda":
                peaks.append(torch.cuda.max_memory_allocated())
                act_peaks.append(torch.cuda.max_memory_allocated() - start_mem)
    grads = [p.grad.detach().float().cpu() if p.grad is not None else None for p in model.parameters()]
    row.update(step_seconds=statistics.median(times), peak_bytes=max(peaks) if peaks else None,
               activation_peak_bytes=max(act_peaks) if act_peaks else None)
    if cache is not None:
        st = cache.stats()
        row.update(bytes_offloaded=st["bytes_offloaded"], recomputed_blocks=len(st["recomputed_blocks"]),
                   cache_peak_resident_bytes=st["peak_resident_bytes"])
        cache.close()
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row, grads


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def plan_config(args):
    return dict(family="megatron", layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                batch=args.batch, vocab=args.vocab, flash_attn=False, dtype=args.dtype)


def main(argv=None):
    args = parse_args(argv)
    # Exit code 10 with the reason last: "not applicable here" to scripts/gpu_check.sh.
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        print("n/a: megatron-core is not installed (scripts/device_deps.sh carries its wheel in .deps/wheels)")
        return 10
    try:
        import megatron.core  # noqa: F401  (numpy and packaging are its dependencies)
    except ImportError as exc:
        print(f"n/a: megatron-core cannot be imported here: {exc}")
        return 10
    if args.device == "cuda" and not torch.cuda.is_available():
        print("n/a: no CUDA device (torch.cuda.is_available() is False)")
        return 10
    init(args)
    data = batches(args)
    rows, ref = {}, None
    from ebbtide.plan import model as plan_model

    a = plan_model.activation_bytes(plan_config(args))
    budget = int(args.budget_fraction * (a["per_step"] + a["outside"] + a["logits"]))
    order = ["keep"] + [s for s in args.strategies if s != "keep"]
    for name in order:
        try:
            out = run_strategy(args, name, data, budget)
        except Exception as exc:  # a strategy that fails is reported, the others still run
            rows[name] = dict(error=f"{type(exc).__name__}: {exc}")
            continue
        if isinstance(out, dict):
            rows[name] = out
            continue
        row, grads = out
        if name == "keep":
            ref = grads
        elif ref is not None:
            row["same_grads"] = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                                    for a, b in zip(ref, grads))
        rows[name] = row
    rows = {k: v for k, v in rows.items() if k in args.strategies}
    print_table(args, rows, budget)
    write_result(dict(device=args.device, shape=dict(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                                     seq=args.seq, batch=args.batch, dtype=args.dtype,
                                                     micro_batches=args.micro_batches),
                      budget_bytes=budget, strategies=rows), args.json)
    torch.distributed.destroy_process_group()
    return 0


def print_table(args, rows, budget):
    def gib(v):
        return "-" if v is None else f"{v / 2**30:.2f} GiB"

    print(f"Megatron-core GPTModel (local spec) {args.layers} layers, h={args.hidden}, s={args.seq}, b={args.batch}, "
          f"{args.dtype}, {args.micro_batches} micro-batches, {args.device}; budget {gib(budget)} "
          f"({args.budget_fraction:g} of the model's saved bytes)")
    print(f"{'strategy':<17} {'step':>9} {'peak':>11} {'act. peak':>11} {'offloaded':>11} {'grads':>6}  notes")
    for name, r in rows.items():
        if "step_seconds" not in r:
            print(f"{name:<17} {'-':>9} {'-':>11} {'-':>11} {'-':>11} {'-':>6}  {r.get('skipped') or r.get('error')}")
            continue
        same = {True: "same", False: "differ", None: "-"}[r.get("same_grads")]
        note = " ".join(r.get("flags", []))
        print(f"{name:<17} {r['step_seconds'] * 1e3:>7.1f}ms {gib(r['peak_bytes']):>11} "
              f"{gib(r['activation_peak_bytes']):>11} {gib(r.get('bytes_offloaded')):>11} {same:>6}  {note}")


if __name__ == "__main__":
    sys.exit(main())
