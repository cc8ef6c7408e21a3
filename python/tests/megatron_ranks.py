"""Every Megatron-core case of test_integrations_megatron.py in one launch:
`torchrun --nproc_per_node 2 megatron_ranks.py OUT [FLAGS.json]`, 2 gloo
ranks on CPU (python/tests/megatron_cpu.py patches Megatron's CUDA
assumptions). Writes OUT/rank<R>.json: per case, whether this rank's
gradients after each step equal those of the same run without ebbtide, and
what the case measured. Layouts: "dp2" (no pipelining, data parallel over
both ranks: DDP and finalize_model_grads reduce across them), "1f1b"
(pipeline of 2) and "interleaved" (pipeline of 2, 2 virtual stages).
"""
import json
import os
import sys
import traceback

import torch
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu as mc  # noqa: E402

LAYOUTS = {"dp2": dict(pp=1), "1f1b": dict(pp=2), "interleaved": dict(pp=2, vp=2)}
LAYERS = 4
MICRO_BATCHES = {"dp2": 2, "1f1b": 4, "interleaved": 4}
STEPS = 2
FINE_GRAINED = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]


def mix(modules):
    """recompute, offload, recompute+offload, keep in turn over the recomputable modules (the layers)."""
    cycle = ("recompute", "offload_cpu", "recompute_offload_cpu", "keep")
    out, i = [], 0
    for m in modules:
        out.append(cycle[i % 4] if m.get("recomputable") else "keep")
        i += bool(m.get("recomputable"))
    return out


def forced(choose):
    """Makes every plan of the cache the replay of `choose(modules)` (as test_cache_budget.py's force)."""
    from ebbtide.cache import adaptive
    from ebbtide.plan import planner

    real = planner.plan_offload

    def plan(modules, write_bps, read_bps, **kw):
        modules = list(modules)
        out = planner.simulate(modules, choose(modules), write_bps, read_bps, **kw)
        out.update(activation_budget_bytes=kw.get("activation_budget_bytes", 0), feasible=True)
        real(modules, write_bps, read_bps, **kw)
        return out

    adaptive.planner.plan_offload = plan
    return lambda: setattr(adaptive.planner, "plan_offload", real)


def keep_all_bytes(cfg, data):
    """Distinct storages one micro-batch's forward saves, parameters excluded."""
    mc.seed(7)
    chunks = mc.build(cfg, ddp=False)
    params = {p.untyped_storage()._cdata for c in chunks for p in c.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        b = data[0]
        chunks[0](b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return sum(seen.values())


def run(layout, out_dir, recompute=None, placements=None, budget=None, offload_modules=None, dropout=0.1):
    """Gradients of STEPS steps without ebbtide and with it; the result dict."""
    from ebbtide.integrations.megatron import offload_megatron

    extra = {}
    if recompute == "full":
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        extra.update(recompute_granularity="selective")
    if offload_modules:
        extra.update(fine_grained_activation_offloading=True, offload_modules=list(offload_modules),
                     min_offloaded_tensor_size=1024)
    cfg = mc.config(layers=LAYERS, dropout=dropout, **LAYOUTS[layout], **extra)
    data = mc.batches(MICRO_BATCHES[layout])
    result = {}

    def steps(chunks, cache=None):
        grads = []
        for s in range(STEPS):
            mc.seed(100 + s)
            if cache is None:
                mc.train_step(chunks, data)
            else:
                with cache.step():
                    mc.train_step(chunks, data)
            grads.append(mc.gradients(chunks))
        return grads

    reset_offloading()
    mc.seed(7)
    ref = steps(mc.build(cfg))
    reset_offloading()
    mc.seed(7)
    chunks = mc.build(cfg)
    kwargs = dict(target="cpu", min_bytes=0)
    if budget is not None:
        kwargs = dict(target="ssd", path=os.path.join(out_dir, f"ssd{torch.distributed.get_rank()}"),
                      min_bytes=0, max_write_mbps=1, activation_budget_bytes=int(budget * keep_all_bytes(cfg, data)))
        os.makedirs(kwargs["path"], exist_ok=True)
        result["budget"] = kwargs["activation_budget_bytes"]
    undo = forced(placements) if placements else None
    if placements:
        kwargs["activation_budget_bytes"] = 1 << 40  # a plan (forced) without a bound
    try:
        cache = offload_megatron(chunks, keep_last_modules=0 if placements else 1, **kwargs)
        if offload_modules:
            OVERLAP.__init__()
            watch_packs(cache)
        got = steps(chunks, cache)
        st = cache.stats()
        cache.close()
    finally:
        if undo:
            undo()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    result["schedule"] = get_forward_backward_func().__name__
    result["mismatch"] = compare(ref, got)
    result.update(bytes_offloaded=st["total"]["bytes_offloaded"], tensors_saved=st["tensors_saved"],
                  saved_bytes=st["saved_bytes_total"], peak_resident_bytes=st["peak_resident_bytes"],
                  recomputed_blocks=st["recomputed_blocks"], blocks=[p["module"] for p in st["plan"]],
                  placements=[m["placement"] for m in (st["planner"] or {}).get("modules", [])],
                  feasible=(st["planner"] or {}).get("feasible"))
    if offload_modules:
        result.update(split())
    return result


def reset_offloading():
    """A fresh manager for Megatron's fine-grained offloading (its first iteration is a warm-up again)."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    if fgo.PipelineOffloadManager.OFFLOAD_MGR is not None:
        fgo.PipelineOffloadManager.reset_instance()


class Overlap:
    """Storages the cache's pack hook and Megatron's offloading hooks are
    given, and how many live storages both were given (weak references: an
    address counts again only after its storage died)."""

    def __init__(self):
        self.cache: dict = {}
        self.megatron: dict = {}
        self.both = 0

    def saw(self, mine: dict, other: dict, t):
        st = t.untyped_storage()
        key = st._cdata
        ref = other.get(key)
        if ref is not None and not ref.expired() and not isinstance(t, torch.nn.Parameter):
            self.both += 1
        mine[key] = StorageWeakRef(st)


OVERLAP = Overlap()


def watch_packs(cache):
    """Records the storage of every tensor the cache's pack hook is given."""
    pack = cache._pack_hook

    def watched(t):
        OVERLAP.saw(OVERLAP.cache, OVERLAP.megatron, t)
        return pack(t)

    cache._pack_hook = watched


def watch_megatron():
    """Records the storage of every tensor Megatron's offloading hooks are given."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    push = fgo.ChunkOffloadHandler.tensor_push

    def tensor_push(self, tensor):
        OVERLAP.saw(OVERLAP.megatron, OVERLAP.cache, tensor)
        return push(self, tensor)

    fgo.ChunkOffloadHandler.tensor_push = tensor_push


def split():
    """What Megatron's offloading and the cache took in the last case."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    mgr = fgo.PipelineOffloadManager.get_instance()
    out = dict(megatron_offloaded_bytes=int(getattr(mgr, "_offload_summary_total_bytes", 0)),
               megatron_took=len(OVERLAP.megatron), cache_took=len(OVERLAP.cache), both=OVERLAP.both)
    OVERLAP.__init__()
    return out


def compare(ref, got):
    """None when every step's gradients are bitwise equal, else where they first differ."""
    for s, (a, b) in enumerate(zip(ref, got)):
        if len(a) != len(b):
            return f"step {s}: {len(a)} gradients vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                return f"step {s}: gradient {i} differs (max |diff| {float((x - y).abs().max()):.3g})"
    return None


def refuse_cpu_offloading():
    from ebbtide.integrations.megatron import offload_megatron

    chunks = mc.build(mc.config(layers=2), ddp=False)
    chunks[0].config.cpu_offloading = True
    try:
        offload_megatron(chunks, target="cpu")
    except RuntimeError as exc:
        return dict(error=str(exc))
    return dict(error=None)


def measure_flags(case):
    """Saved bytes left in memory after a forward of the model with `case`'s Megatron flags
    (the second iteration: Megatron's first one is its warm-up, which offloads every group)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off_interface)

    c = case["config"]
    extra = dict(c.get("megatron", {}))
    reset_offloading()
    cfg = mc.config(layers=c["layers"], hidden=c["hidden"], heads=c["heads"], seq=c["seq"], dropout=0.0, **extra)
    mc.seed(7)
    model = mc.build(cfg, vocab=c["vocab"], seq=c["seq"], ddp=False)[0]
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    b = mc.batches(1, vocab=c["vocab"], seq=c["seq"], batch=c["batch"])[0]
    resident = None
    for it in range(2):
        off_interface.reset()
        refs = {}

        def pack(t):
            st = t.untyped_storage()
            if st._cdata not in params:
                refs[st._cdata] = (StorageWeakRef(st), st)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        kept = {k: v[0] for k, v in refs.items()}
        refs.clear()  # drop our references: only the graph and Megatron's groups hold storages now
        megatron = {}
        if extra.get("fine_grained_activation_offloading"):
            from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

            for chunk in fgo.PipelineOffloadManager.get_instance()._cached_chunks_forward:
                for group in chunk.offload_groups:
                    for t in group._tensors.values():
                        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in params:
                            megatron[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        if it == 1:
            live = {k: ref for k, ref in kept.items() if not ref.expired()}
            resident = sum(_nbytes(ref) for ref in live.values()) + sum(
                v for k, v in megatron.items() if k not in live)
        loss.sum().backward()
        model.zero_grad()
    return dict(resident_bytes=int(resident))


def _nbytes(ref):
    """The bytes of a live storage now (Megatron resizes what it released to 0)."""
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()


def main():
    out_dir = sys.argv[1]
    flag_cases = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else []
    mc.patch()
    mc.init_distributed()
    rank = torch.distributed.get_rank()
    watch_megatron()
    from megatron.core import parallel_state as ps

    cases = {
        "dp2": [("plain", {}), ("full", dict(recompute="full")), ("selective", dict(recompute="selective")),
                ("mix", dict(placements=mix)), ("selective+mix", dict(recompute="selective", placements=mix)),
                ("budget", dict(budget=0.7)),
                ("fine-grained", dict(offload_modules=FINE_GRAINED, dropout=0.0))],
        "1f1b": [("plain", {}), ("full", dict(recompute="full")), ("selective", dict(recompute="selective")),
                 ("mix", dict(placements=mix))],
        "interleaved": [("plain", {}), ("full", dict(recompute="full")), ("selective", dict(recompute="selective")),
                        ("mix", dict(placements=mix))],
    }
    results = {}
    for layout, todo in cases.items():
        spec = LAYOUTS[layout]
        ps.initialize_model_parallel(pipeline_model_parallel_size=spec["pp"],
                                     virtual_pipeline_model_parallel_size=spec.get("vp"))
        for name, kw in todo:
            key = f"{layout}/{name}"
            try:
                results[key] = run(layout, out_dir, **kw)
            except Exception:
                results[key] = dict(error=traceback.format_exc())
        if layout == "dp2":
            try:
                results["refuse/cpu_offloading"] = refuse_cpu_offloading()
            except Exception:
                results["refuse/cpu_offloading"] = dict(error=traceback.format_exc(), crashed=True)
            for i, case in enumerate(flag_cases):
                try:
                    results[f"flags/{i}"] = measure_flags(case)
                except Exception:
                    results[f"flags/{i}"] = dict(error=traceback.format_exc())
        ps.destroy_model_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
