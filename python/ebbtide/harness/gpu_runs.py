"""Recorded GPU runs as replayable runs (ebbtide.plan.replay; docs/model.md,
"Replays"): the trace the GPU stages write since 2026-11-29 is read as it
is; the JSON files of bench/offload_bench.py and bench/budget_bench.py from
before it are rebuilt into the same shape, each with the assumptions it
forces listed in the run (``assumptions``) and in the file's.

Note [Replaying runs without a trace]
Those files recorded the step's medians and peaks, the plan (per module:
its name, forward time from the profiling step, bytes, placement and
predicted times) and the link, but not the backward per module, the
gradients, the temporaries or the saves in order. So:
- forward: the profile's per-module times, scaled to no offload's measured
  forward (the profiling step timed 28.9 ms of a 27.2 ms forward at shape a);
- backward: no offload's measured step less its forward, shared by the
  modules as their forward times are (one backward/forward factor);
- gradients: each module's parameters, counted on the meta device from the
  same HF config (bf16), made through its backward as its saves are used; a
  tied embedding's with the head's;
- temporaries: a block's backward holds its MLP's activation gradients
  (Llama: four b x s x ffn tensors, GPT-2: two b x s x 4h, bf16); the last
  module's (it holds the head and the loss: the logits' gradients), what no
  offload's measured peak holds above the model's;
- saves: the module's bytes in eight pieces through its forward; the first
  piece is what the cache moved of it (the plan's per-scope
  bytes_offloaded), so that the prefix rule moves the same; HF Llama's
  rotary cos/sin (two storages of seq x head_dim x 2 bytes, the 1 MiB by
  which block 0 exceeds the others) at 15% of each block's saves, owned by
  block 0 and saved by every block (their place in a block's saves, from
  the same model's save order on the CPU);
- the cache's rules at the time: every reload lead the window (four times
  the largest scope's offloaded bytes), a shared storage in its first
  saver's place, loads on demand behind the queued ones, release points
  from the plan's predicted times, the 1 GiB copy bound;
- the link: the D2H and H2D rates the run measured; the SSD (auto rows):
  the rates the plan recorded.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from ebbtide.plan import planner
from ebbtide.plan import replay as _replay

__all__ = ["load", "convert_offload_bench", "param_bytes_by_module"]

GiB = 1 << 30
_CUDA_PREFETCH_MODULES = 4  # the glue's window before 2026-11-29 (ebbtide/cache/adaptive.py)
_PIECES = 8
_SHARED_AT = 0.15  # HF Llama's rotary tables in a block's saves, by bytes (CPU save order)

OFFLOAD_ASSUMPTIONS = [
    "forward per module: the profiling step's times scaled to no offload's measured forward",
    "backward per module: no offload's measured backward shared as the forward times are",
    "gradients: the HF model's parameters per module (bf16), made through its backward",
    "temporaries: a block's backward holds its MLP's activation gradients (Llama 4 x b x s x ffn, GPT-2 "
    "2 x b x s x 4h, bf16); the last module's (head and loss), what no offload's measured peak holds above "
    "the model's",
    "saves: eight pieces per module through its forward, the first the bytes the cache moved; Llama's rotary "
    "tables shared from block 0, at 15% of each block's saves",
    "cache rules then: leads of the window (4 x the largest scope's moved bytes), shared storages in their "
    "first saver's place, loads on demand behind queued loads, release points from the plan's times, "
    "1 GiB copy bound",
]


def load(path: str) -> dict:
    """The runs of a trace or of an older bench JSON file.

    Returns:
        ``{"source", "format", "runs", "assumptions"}``.

    Raises:
        ValueError: a file that is none of those, naming it.
        OSError: the file cannot be read.
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if isinstance(data, dict) and data.get("format") == _replay.TRACE_FORMAT:
        if data.get("version") != _replay.TRACE_VERSION:
            raise ValueError(f"{path}: trace version {data.get('version')!r}, this ebbtide reads "
                             f"{_replay.TRACE_VERSION}")
        return dict(source=path, format="trace", runs=data["runs"], assumptions=data.get("assumptions", []))
    if isinstance(data, dict) and "rows" in data and data.get("trace"):
        # A bench JSON written with --trace: its runs are the trace's, measured, not rebuilt.
        raise ValueError(f"{path}: its runs are in its step trace {data['trace']!r} (beside it): replay that")
    if isinstance(data, dict) and "rows" in data and "link" in data and "eligible_bytes" in data:
        return dict(source=path, format="offload_bench", runs=convert_offload_bench(data),
                    assumptions=OFFLOAD_ASSUMPTIONS)
    if isinstance(data, dict) and "rows" in data and "keep_saved_peak" in data:
        from ebbtide.harness.gpu_budget_runs import BUDGET_ASSUMPTIONS, convert_budget_bench

        return dict(source=path, format="budget_bench", runs=convert_budget_bench(data, path),
                    assumptions=BUDGET_ASSUMPTIONS)
    raise ValueError(f"{path}: neither an ebbtide step trace ({_replay.TRACE_FORMAT!r}) nor the JSON of "
                     "bench/offload_bench.py or bench/budget_bench.py")


# ------------------------------------------------------------------ the model
def _meta_model(name: str, layers: int, hidden: int, heads: int, seq: int):
    """The harness's HF model on the meta device (no memory, no init)."""
    import torch
    import transformers as tf

    from ebbtide.harness.models import _make_hf_model

    tf.logging.set_verbosity_error()
    common = dict(vocab_size=8192, attn_implementation="sdpa", use_cache=False)
    with torch.device("meta"):
        return _make_hf_model(tf, name, layers, hidden, heads, seq, common)


def param_bytes_by_module(model, element_bytes: int = 2) -> tuple:
    """(before, [per block], after): the gradient bytes each part's backward
    allocates: the blocks the cache scopes by, what comes before them (the
    embeddings) and after (final norm, head). A weight the head shares with
    the embedding (GPT-2) gets its gradient when the head's backward begins."""
    from ebbtide.cache.tensor_cache import _find_blocks

    blocks = [m for _, m in _find_blocks(model)]
    in_blocks = set()
    per_block = []
    for b in blocks:
        ps = list(b.parameters())
        in_blocks.update(id(p) for p in ps)
        per_block.append(sum(p.numel() for p in ps) * element_bytes)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    before = after = 0
    for name, p in model.named_parameters():
        if id(p) in in_blocks:
            continue
        nbytes = p.numel() * element_bytes
        if id(p) not in head_ids and any(k in name for k in ("embed", "wte", "wpe")):
            before += nbytes
        else:
            after += nbytes
    return before, per_block, after


def _ffn_of(model) -> int:
    cfg = model.config
    return getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size


def mlp_gradient_bytes(family: str, spec: dict, element_bytes: int = 2) -> int:
    """A block's backward temporaries: its MLP's activation gradients (the
    largest tensors a block's backward makes and frees): Llama's gate, up,
    act and product, four b x s x ffn tensors; GPT-2's c_fc and GELU outputs,
    two b x s x 4h."""
    tokens = spec["batch"] * spec["seq"]
    if family in ("llama", "qwen2", "mistral", "mixtral"):
        return 4 * tokens * spec["ffn_hidden"] * element_bytes
    return 2 * tokens * spec["ffn_hidden"] * element_bytes


# -------------------------------------------------------- offload_bench.py
def _pieces(total: int, moved: int, limit: Optional[int]) -> list:
    """`total` bytes in _PIECES pieces whose first is `moved` (what the cache
    moved), so that a prefix limit of `limit` moves exactly that."""
    if total <= 0:
        return []
    chunk = max(1, -(-total // _PIECES))
    out = []
    left = total
    if 0 < moved < total - (64 << 10):  # a partial scope (the small saves never move)
        out.append(moved)
        left -= moved
        if limit is not None and limit > moved:
            chunk = max(chunk, limit - moved + 1)  # the next piece passes the limit: the prefix stops there
    elif moved == 0 and limit is not None and limit > 0:
        chunk = max(chunk, limit + 1)
    while left > 0:
        b = min(chunk, left)
        out.append(b)
        left -= b
    return out


def _with_shared(pieces: list, table_bytes: int, tables: int) -> list:
    """Saves: the pieces, with `tables` shared storages (ids 0..) at _SHARED_AT of them by bytes."""
    total = sum(pieces)
    at = _SHARED_AT * total
    out, cum, placed = [], 0, False
    for b in pieces:
        if not placed and cum + b > at and cum > 0:
            out.extend([table_bytes, t] for t in range(tables))
            placed = True
        out.append([b, -1])
        cum += b
    if not placed:
        out.extend([table_bytes, t] for t in range(tables))
    return out


def _release_after(mods: list) -> list:
    """The glue's release points from a plan's predicted times (ebbtide/cache/adaptive.py):
    after module b, through the last module whose copies were predicted done by b's forward end;
    none after the scope before the blocks (no block hook runs there)."""
    out = []
    for b, mb in enumerate(mods):
        if b == 0:
            out.append(-1)
            continue
        done = [s for s, ms in enumerate(mods[:b + 1])
                if ms["tier"] is not None and ms["write_done_seconds"] <= mb["forward_end_seconds"]]
        out.append(max(done) if done else -1)
    return out


def convert_offload_bench(d: dict) -> list:
    """The runs of one bench/offload_bench.py JSON (Note [Replaying runs without a trace])."""
    rows = {r["method"]: r for r in d["rows"] if r.get("status") == "ok"}
    none = rows.get("none")
    if none is None:
        raise ValueError("offload_bench JSON without a 'none' row: nothing to calibrate against")
    planned = [r for m, r in rows.items() if m.startswith("ebbtide") and (r.get("stats") or {}).get("planner")]
    if not planned:
        raise ValueError("offload_bench JSON without an ebbtide row that recorded its plan")
    link = d["link"]
    d2h, h2d = link["d2h_gbps"] * 1e9, link["h2d_gbps"] * 1e9
    shape = f"shape {d['shape']}" if d.get("shape") else f"{d['model']} h={d['hidden']}"
    ref = planned[0]["stats"]["planner"]["modules"]
    scale = none["forward_seconds"] / sum(m["forward_seconds"] for m in ref)
    beta = (none["step_seconds"] - none["forward_seconds"]) / none["forward_seconds"]
    model = _meta_model(d["model"], d["layers"], d["hidden"], d["heads"], d["seq"])
    before, per_block, after = param_bytes_by_module(model)
    llama = d["model"] in ("llama", "qwen2", "mistral", "mixtral")
    head_dim = d["hidden"] // d["heads"]
    table_bytes = d["seq"] * head_dim * 2
    if len(ref) != len(per_block) + 1:
        raise ValueError(f"offload_bench JSON: {len(ref)} planned modules for {len(per_block)} blocks")

    def modules_for(row):
        """The profile, with each module's saves shaped by what this row's cache moved."""
        plan_rows = {p["module"]: p for p in row["stats"]["plan"]}
        limits = {m["name"]: m["offload_bytes"] for m in row["stats"]["planner"]["modules"]
                  if m["tier"] is not None and 0 < m["offload_bytes"] < m["saved_bytes"]}
        out = []
        for i, m in enumerate(ref):
            f = m["forward_seconds"] * scale
            grads = before if i == 0 else per_block[i - 1] + (after if i == len(ref) - 1 else 0)
            mod = dict(name=m["name"], forward_seconds=f, backward_seconds=beta * f, bytes=m["bytes"],
                       grad_bytes=grads)
            moved = plan_rows.get(m["name"], {}).get("bytes_offloaded", 0)
            pieces = _pieces(m["bytes"] - (table_bytes * 2 if llama and i == 1 else 0), moved,
                             limits.get(m["name"]))
            if llama and i >= 1:
                mod["saves"] = _with_shared(pieces, table_bytes, 2)
            else:
                mod["saves"] = [[b, -1] for b in pieces]
            out.append(mod)
        return out

    def options(row, now: bool):
        measured = row["stats"]["planner"].get("measured", {})
        ssd = measured.get("ssd", {})
        o = dict(write_bps=ssd.get("write_bps", 0.0), read_bps=ssd.get("read_bps", 0.0), host_budget_bytes=1 << 50,
                 host_write_bps=d2h, host_read_bps=h2d, keep_last_modules=1, backward_factor=beta,
                 writes_within_forward=True, copy_bound_bytes=GiB, partial_offload=True)
        if now:
            o.update(lead_per_module=True, shared_at_last_user=True, priority_loads=True)
        else:
            moved = max((p["bytes_offloaded"] for p in row["stats"]["plan"]), default=0)
            o.update(lead_per_module=False, window_bytes=max(_CUDA_PREFETCH_MODULES * moved, 64 << 10),
                     shared_at_last_user=False, priority_loads=False)
        return o

    runs = []
    block_temp = mlp_gradient_bytes(d["model"], dict(hidden=d["hidden"], seq=d["seq"], batch=d["batch"],
                                                     ffn_hidden=_ffn_of(model)))
    base = modules_for(planned[0])
    for m in base[1:-1]:
        m["backward_temp_bytes"] = block_temp
    keep_all = dict(placements=["keep"] * len(base))
    # Temporaries: no offload's measured peak over the model's.
    probe = _replay.planner.simulate_ran(base, keep_all["placements"], **options(planned[0], False))
    temp = max(0, none["peak_bytes"] - probe["peak_allocated_bytes"])
    base[-1]["backward_temp_bytes"] = temp
    runs.append(dict(name=f"{shape} none", kind="offload", modules=base, options=options(planned[0], False),
                     ran=keep_all, measured=_measured(none), now_options=None,
                     assumptions=OFFLOAD_ASSUMPTIONS))
    for row in planned:
        mods = modules_for(row)
        for m in mods[1:-1]:
            m["backward_temp_bytes"] = block_temp
        mods[-1]["backward_temp_bytes"] = temp
        pm = row["stats"]["planner"]["modules"]
        ran = dict(placements=[planner.ran_placement(m) for m in pm],
                   offload_limits=[m["offload_bytes"] if m["tier"] is not None and 0 < m["offload_bytes"] <
                                   m["saved_bytes"] else -1 for m in pm],
                   release_after=_release_after(pm))
        runs.append(dict(name=f"{shape} {row['method']}", kind="offload", modules=mods,
                         options=options(row, False), ran=ran, measured=_measured(row, none),
                         now_options=options(row, True), assumptions=OFFLOAD_ASSUMPTIONS))
    return runs


def _measured(row: dict, none: Optional[dict] = None) -> dict:
    out = dict(step_seconds=row["step_seconds"], peak_bytes=row["peak_bytes"],
               forward_seconds=row.get("forward_seconds"))
    if none is not None:
        out.update(none_step_seconds=none["step_seconds"], none_peak_bytes=none["peak_bytes"])
    s = row.get("stats") or {}
    if s:
        out.update(bytes_offloaded=s.get("bytes_offloaded"), copy_waits=s.get("copy_waits"))
    return out


def default_runs_dir() -> str:
    """bench/gpu-runs of the source tree this module belongs to (a checkout), or ''."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.normpath(os.path.join(here, "..", "..", "..", "bench", "gpu-runs"))
    return path if os.path.isdir(path) else ""
