"""bench/budget_bench.py's JSON (before the step trace) as replayable runs
(ebbtide.harness.gpu_runs, ebbtide.plan.replay).

Note [Replaying budget runs without a trace]
The budget stage recorded, per strategy, the step's median, the allocator's
peak and the peak of saved bytes, with how many blocks the budget plan
recomputed and how many bytes it offloaded; nothing per module. The model
is rebuilt from those rows and the model's shape:
- a block saves S = (keep's saved peak - the tail) / layers, where the tail
  (head and loss, kept) is full recompute's saved peak less its inputs, one
  b x s x h activation a block;
- a block's forward is (full recompute's step - keep's) / layers (recompute
  re-runs exactly the blocks' forward); the head's is a block's times the
  FLOPs of the logits over a block's; the backward is keep's step less the
  forward, shared as the forward times are;
- gradients: the parameters of each module (bf16) on the meta device, made
  through its backward as its saves are used; the embedding's as the first
  block's ends;
- temporaries: a block's backward holds its MLP's activation gradients
  (four b x s x ffn tensors, bf16); the head's and the loss's, what keep's
  allocator peak holds above the model's;
- the plan that ran: N blocks recomputed (N as recorded), the first N or the
  last N, whichever the model gives the saved peak the plan predicted (the
  budget 0.5 row's 3,459,416,128 bytes is blocks 3-7's); a row that also moved
  bytes to the SSD (the fraction 0.25 on 2026-11-28) did not record which:
  it is replayed as if those bytes were the first blocks' inputs written to
  the SSD at the rates the same session probed, and kept apart, with the
  reason: where the measured step is shorter than the least time its SSD
  I/O takes at those rates (_ssd_floor_why), the step saw other rates, and
  no placement of the bytes reproduces it; the reason then also names the
  factor on both rates at which the model plays the step in its measured
  time (_rates_to_reproduce: 2.25x on 2026-11-28's budget_a, 1.95x on
  budget_b; bench/probe_bench.py measures the probe against the steps' own
  rates on a disk at hand).
Best plans are made for host memory (the target a user with 125 GiB of host
memory picks), at the run's budget of saved bytes and at its measured
allocator peak.
"""
from __future__ import annotations

import os

__all__ = ["convert_budget_bench", "BUDGET_ASSUMPTIONS"]

BUDGET_ASSUMPTIONS = [
    "a block's saves: (keep's saved peak - the tail) / layers; the tail: full recompute's saved peak less its "
    "inputs (b x s x h a block)",
    "a block's forward: (full recompute's step - keep's) / layers; the head's from the FLOPs of the logits; "
    "backward: keep's step less the forward, shared as the forward times are",
    "gradients: the HF model's parameters per module (bf16), made through its backward",
    "temporaries: a block's backward holds its MLP's activation gradients (4 x b x s x ffn, bf16); the head and "
    "loss's backward, what keep's allocator peak holds above the model's",
    "the plan that ran: the first or the last N blocks recomputed (N as recorded), whichever gives the saved "
    "peak the plan predicted; SSD bytes (not recorded which) as the first blocks' inputs on the SSD, kept apart",
]

GiB = 1 << 30


def _flops_ratio(spec: dict) -> float:
    """The logits' forward FLOPs over one block's."""
    h, s, b, v = spec["hidden"], spec["seq"], spec["batch"], spec["vocab"]
    kv = spec.get("kv_heads") or spec["heads"]
    head_dim = h // spec["heads"]
    params = 2 * h * h + 2 * h * kv * head_dim + 3 * h * spec["ffn_hidden"]
    block = 2 * b * s * params + 4 * b * s * s * h
    return 2 * b * s * h * v / block


def _meta_llama(spec: dict):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"],
                                   intermediate_size=spec["ffn_hidden"], num_hidden_layers=spec["layers"],
                                   num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                                   max_position_embeddings=spec["seq"], use_cache=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _link(path: str):
    """The D2H and H2D rates, and the SSD's, measured in the same session
    (offload_shape_a.json beside the budget JSON), else None."""
    import json

    other = os.path.join(os.path.dirname(path), "offload_shape_a.json")
    try:
        with open(other) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    ssd = {}
    for r in d.get("rows", []):
        m = ((r.get("stats") or {}).get("planner") or {}).get("measured", {}).get("ssd")
        if m:
            ssd = m
    return d["link"]["d2h_gbps"] * 1e9, d["link"]["h2d_gbps"] * 1e9, ssd


def _siblings(path: str, spec: dict) -> list:
    """The budget JSON files beside `path` of the same model."""
    import json

    here = os.path.dirname(path) or "."
    out = []
    for name in sorted(os.listdir(here)):
        other = os.path.join(here, name)
        if not name.endswith(".json") or os.path.samefile(other, path):
            continue
        try:
            with open(other) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and "keep_saved_peak" in d and d.get("model") == spec:
            out.append(d)
    return out


def _ssd_floor_why(modules, placements, limits, moved, inputs, ssd, measured):
    """Why a row that moved `moved` bytes to the SSD is kept apart (Note
    [Replaying budget runs without a trace]): the least time its I/O takes
    at the SSD rates the session probed, against the step measured. Writes
    end in the order they were issued (the cache's store queue is FIFO), so
    the last moved block's bytes are on the SSD only once all `moved` bytes
    are written; they are then read back, and the backward of that block and
    of every block before it runs after. In forward order no other placement
    of the same bytes puts less after the last write (a block's inputs hold
    `inputs` bytes at most; a kept block's own saves would all be read back
    first)."""
    w, rd = ssd.get("write_bps", 0.0), ssd.get("read_bps", 0.0)
    why = "which bytes moved to the SSD was not recorded (replayed as the first blocks' inputs)"
    if not (w > 0 and rd > 0):
        return why + "; nor were the SSD's rates"
    k = max(i for i, lim in enumerate(limits) if placements[i].endswith("_ssd"))
    last = limits[k] if limits[k] >= 0 else inputs
    write, read = moved / w, last / rd
    after = sum(m["backward_seconds"] + (m["forward_seconds"] if placements[i].startswith("recompute") else 0.0)
                for i, m in enumerate(modules[:k + 1]))
    floor = write + read + after
    if measured >= floor:
        return why
    return (f"its measured step ({measured:.3f} s) is shorter than its SSD I/O allows at the rates the session "
            f"probed ({w / 1e9:.2f} GB/s write, {rd / 1e9:.2f} GB/s read): {moved / 1e6:.0f} MB written in issue "
            f"order ({write:.3f} s), the last block's {last / 1e6:.0f} MB read back ({read:.3f} s), then the "
            f"backward of blocks 0-{k} ({after:.3f} s): {floor:.3f} s. The step saw rates the run did not record")


def _rates_to_reproduce(modules, placements, limits, options, measured):
    """The factor m on both SSD rates of `options` at which the step model
    plays the row's plan in its measured time (the step falls as the rates
    rise), or None where no factor in 1..20 does."""
    from ebbtide.plan import planner

    def step(m):
        o = dict(options, write_bps=options["write_bps"] * m, read_bps=options["read_bps"] * m)
        return planner.simulate_ran(modules, placements, offload_limits=limits, **o)["predicted_step_seconds"]

    lo, hi = 1.0, 20.0
    if step(lo) <= measured or step(hi) > measured:
        return None
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) > measured else (lo, mid)
    return hi


def convert_budget_bench(d: dict, path: str) -> list:
    """The runs of one bench/budget_bench.py JSON (Note [Replaying budget runs without a trace])."""
    from ebbtide.harness.gpu_runs import mlp_gradient_bytes, param_bytes_by_module
    from ebbtide.plan import planner

    spec = dict(d["model"])
    rows = [r for r in d["rows"] if r.get("allocated_peak_bytes")]
    by = {r["strategy"]: r for r in rows if r["strategy"] in ("keep", "recompute")}
    if "keep" not in by or "recompute" not in by:
        # A stage run in parts (budget_a, budget_b): the rows of the same
        # model from a sibling file of the same session.
        for other in _siblings(path, spec):
            by = {**{r["strategy"]: r for r in other["rows"] if r["strategy"] in ("keep", "recompute")
                     and r.get("allocated_peak_bytes")}, **by}
    if "keep" not in by or "recompute" not in by:
        raise ValueError(f"{path}: budget JSON without keep and recompute rows, here or beside it: nothing to "
                         "rebuild the model from")
    keep, rec = by["keep"], by["recompute"]  # this file's or a sibling's
    n = spec["layers"]
    inputs = spec["batch"] * spec["seq"] * spec["hidden"] * 2
    tail_bytes = rec["peak_bytes"] - n * inputs
    block_bytes = (keep["peak_bytes"] - tail_bytes) // n
    f_block = (rec["step_seconds"] - keep["step_seconds"]) / n
    f_tail = f_block * _flops_ratio(spec)
    forward = n * f_block + f_tail
    beta = (keep["step_seconds"] - forward) / forward
    before, per_block, after = param_bytes_by_module(_meta_llama(spec))
    # The scope before the blocks saves the token ids alone: no time worth planning.
    modules = [dict(name=f"model.layers.{i}", forward_seconds=f_block, backward_seconds=beta * f_block,
                    bytes=block_bytes, recomputable=True, recompute_bytes=inputs, grad_bytes=per_block[i])
               for i in range(n)]
    modules[0]["grad_bytes"] += before  # the embedding's gradient comes as the first block's backward ends
    modules.append(dict(name="<after blocks>", forward_seconds=f_tail, backward_seconds=beta * f_tail,
                        bytes=tail_bytes, grad_bytes=after))
    link = _link(path)
    d2h, h2d, ssd = link if link is not None else (0.0, 0.0, {})
    base = dict(keep_last_modules=2, backward_factor=beta, writes_within_forward=True, copy_bound_bytes=GiB,
                partial_offload=True)
    ran_options = dict(base, write_bps=ssd.get("write_bps", 0.0), read_bps=ssd.get("read_bps", 0.0),
                       lead_per_module=False, shared_at_last_user=False, priority_loads=False)
    keep_all = ["keep"] * len(modules)
    probe = planner.simulate_ran(modules, keep_all, **ran_options)
    # The head's and the loss's backward (the logits' gradients): keep's peak over the model's.
    # A block's backward holds its MLP's activation gradients; the head's and
    # the loss's (the logits' gradients) are keep's peak over the model's.
    for m in modules[:-1]:
        m["backward_temp_bytes"] = mlp_gradient_bytes("llama", spec)
    probe = planner.simulate_ran(modules, keep_all, **ran_options)
    modules[-1]["backward_temp_bytes"] = max(0, keep["allocated_peak_bytes"] - probe["peak_allocated_bytes"])
    now = dict(base, write_bps=0.0, read_bps=0.0, host_budget_bytes=1 << 50, host_write_bps=d2h,
               host_read_bps=h2d)
    runs = []
    for r in rows:
        strategy = r["strategy"]
        placements = list(keep_all)
        limits = None
        why = None  # set for a row kept apart
        if strategy == "recompute":
            placements = ["recompute"] * n + ["keep"]
        elif strategy == "budget":
            k = int(r.get("blocks_recomputed") or 0)
            first = ["recompute"] * k + ["keep"] * (len(modules) - k)
            last = ["keep"] * (n - k) + ["recompute"] * k + ["keep"] * (len(modules) - n)
            want = r.get("predicted_peak_bytes")
            placements = first
            if want and k:
                def miss(pl):
                    return abs(planner.simulate_ran(modules, pl, **ran_options)["peak_resident_bytes"] - want)
                placements = min((first, last), key=miss)
            moved = int(r.get("bytes_offloaded") or 0)
            if moved:
                # Not recorded which bytes moved: the first blocks' inputs on the SSD.
                left = moved
                limits = [-1] * len(modules)
                for i in range(n):
                    if left <= 0:
                        break
                    if placements[i] != "recompute":
                        continue
                    placements[i] = "recompute_offload_ssd"
                    take = min(left, inputs)
                    limits[i] = take if take < inputs else -1
                    left -= take
                why = _ssd_floor_why(modules, placements, limits, moved, inputs, ssd, r["step_seconds"])
                need = _rates_to_reproduce(modules, placements, limits, ran_options, r["step_seconds"]) \
                    if why.startswith("its measured step") else None
                if need is not None:
                    why += (f". The model plays the step in its measured time only with both rates {need:.2f}x the "
                            f"probe's ({ssd['write_bps'] * need / 1e9:.2f} GB/s write, "
                            f"{ssd['read_bps'] * need / 1e9:.2f} GB/s read)")
        elif strategy != "keep":
            continue  # peers whose steps the model does not play (torchtune; compiled blocks: no profile of them)
        label = strategy + (f" {r['fraction']:g}" if r.get("fraction") is not None else "")
        measured = dict(step_seconds=r["step_seconds"], peak_bytes=r["allocated_peak_bytes"],
                        peak_saved_bytes=r.get("peak_bytes"), bytes_offloaded=r.get("bytes_offloaded"),
                        blocks_recomputed=r.get("blocks_recomputed"))
        now_options = None
        if strategy == "budget":
            now_options = dict(now, activation_budget_bytes=int(r["budget_bytes"]))
        runs.append(dict(name=f"budget shape a {label}", kind="budget", modules=modules, options=ran_options,
                         ran=dict(placements=placements, offload_limits=limits), measured=measured,
                         now_options=now_options, apart=why is not None, **({"apart_why": why} if why else {}),
                         peers={p["strategy"] + (f" {p['fraction']:g}" if p.get("fraction") is not None else ""):
                                dict(step_seconds=p["step_seconds"], peak_bytes=p["allocated_peak_bytes"])
                                for p in rows if p["strategy"] in ("recompute", "torchtune", "compiler", "keep")},
                         assumptions=BUDGET_ASSUMPTIONS))
    return runs
