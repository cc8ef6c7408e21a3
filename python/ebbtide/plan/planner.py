"""Adaptive offload planner: from one profiled step decide, per module, keep /
offload_cpu / offload_ssd so that the writes and reloads hide behind compute;
with an activation budget, also recompute / recompute_offload, so that the
predicted peak fits the budget at the least step time. The rules are
``ebbtide::plan::plan_offload`` and ``plan_budget`` (Note [Offload rule] in
cpp/src/plan/planner.cpp, Note [Budget plan] in planner_budget.cpp,
docs/model.md). Plain dicts in and out; no torch.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from ebbtide import _core
from ebbtide._records import as_dict, make

__all__ = ["plan_offload", "simulate", "simulate_ran", "needs_replan", "link_faster", "rate_change_words", "ran_placement",
           "PLACEMENTS"]

PLACEMENTS = ("keep", "offload_cpu", "offload_ssd", "recompute", "recompute_offload")


def plan_offload(modules: Iterable[Mapping[str, Any]], write_bps: float, read_bps: float, *,
                 target: str = "auto", max_write_mbps: float | None = None, host_budget_bytes: int = 0,
                 host_write_bps: float = 0.0, host_read_bps: float = 0.0,
                 keep_last_modules: int = 1, backward_factor: float = 2.0,
                 prefetch_modules: int = 2, stall_tolerance_seconds: float = 0.0,
                 replan_fraction: float = 0.7, writes_within_forward: bool = False,
                 guarded_writes: bool = False, activation_budget_bytes: int = 0,
                 copy_bound_bytes: int = 0, partial_offload: bool = False, peak_budget_bytes: int = 0,
                 window_bytes: int = 0, lead_per_module: bool = True, kept_in_distance: bool = True,
                 shared_at_last_user: bool = True, priority_loads: bool = True,
                 staging_bytes: int = 1 << 30) -> dict:
    """Plans where each module's saved activations go.

    modules: forward order, each ``{"name": str, "forward_seconds": float, "bytes": int}``,
    optionally ``"fixed_bytes"`` (saved bytes that stay resident: tensors too small
    to move), and for budget plans ``"recomputable": bool`` (default False),
    ``"recompute_bytes"`` (what it saves when recomputed: its inputs) and
    ``"recompute_seconds"`` (forward re-run in backward; default forward_seconds).
    write_bps / read_bps: measured SSD bandwidth in bytes/s (0 disables the SSD).
    max_write_mbps: cap on SSD writes in MB/s (1e6 bytes/s). host_budget_bytes with
    host_write_bps / host_read_bps enable host memory as a second tier.
    target: "auto" (SSD, and host memory when a budget is given), "ssd" (host
    memory ignored) or "cpu" (host memory only; needs host_budget_bytes).
    writes_within_forward: GPU offload: a module is offloaded only if its copy
    ends before the forward does (Note [Release points] in tensor_cache_device.cpp).
    guarded_writes: the worker path (host tensors): a tensor's memory comes
    back when its own write ends, and under a budget saves wait while more
    than the budget less the kept bytes wait to be stored; the forward then
    waits (``forward_wait_seconds``, part of the stall) rather than exceed the
    budget (Note [Guarded writes] in planner.cpp).
    copy_bound_bytes: GPU: the cache's device_inflight_bytes; the forward
    waits, as on the device, while more host-tier copies than this are queued
    (Note [Copy bound in the plan] in planner.cpp; 0: no bound).
    partial_offload: a module may move only the first ``offload_bytes`` of its
    saves, in save order, where the whole would stall or miss the forward
    (Note [Partial offload]).
    activation_budget_bytes: bound on the predicted peak of resident saved
    bytes (0: none, offload what hides). A budget no mix meets gives
    ``feasible`` False and ``min_budget_bytes``, the smallest it can meet.
    peak_budget_bytes: bound on the predicted allocator peak above the
    step's start (saved bytes, reload buffers, gradients, temporaries: what
    torch.cuda.max_memory_allocated() shows); ``min_peak_budget_bytes`` when
    no mix meets it.
    The cache's reload rules (Note [Reload lead] in cpp/src/plan/step_model.cpp):
    lead_per_module (each offloaded module's reload starts as late as hides
    it, ``lead_bytes``), window_bytes (bytes loading or loaded ahead; 0:
    unbounded with lead_per_module, else prefetch_modules times the largest
    offloaded module), kept_in_distance, shared_at_last_user, priority_loads;
    staging_bytes (GPU: page-locked bytes for SSD-tier saves on their way).
    Modules may also carry what the allocator sees (Note [Step model]):
    ``backward_seconds`` (measured; default backward_factor * forward_seconds),
    ``grad_bytes``, ``forward_temp_bytes``, ``backward_temp_bytes``, and
    ``saves``: their saves in order as (bytes, shared id or -1) pairs.

    Returns ``{"modules": [{"name", "placement", "tier" ("cpu", "ssd" or None),
    "bytes", "saved_bytes", "fixed_bytes", "recompute_seconds", "forward_end_seconds",
    "write_done_seconds", "read_start_seconds", "backward_start_seconds",
    "offload_bytes" (bytes moved: saved_bytes, or less for a partial module),
    "lead_bytes", "wait_seconds", "forwarded_bytes"}, ...],
    "forward_seconds", "backward_seconds", "predicted_stall_seconds", "forward_wait_seconds",
    "backward_wait_seconds", "recompute_seconds", "predicted_step_seconds", "all_resident_bytes",
    "peak_resident_bytes", "peak_allocated_bytes", "window_bytes", "peak_resident_fraction",
    "bytes_keep", "bytes_cpu", "bytes_ssd", "bytes_recomputed", "modules_recomputed",
    "activation_budget_bytes", "feasible", "min_budget_bytes", "peak_budget_bytes",
    "min_peak_budget_bytes", "planned_write_bps", "planned_read_bps", "replan_fraction"}``.
    Raises ValueError naming a bad module or setting.
    """
    options = _options(write_bps, read_bps, target=target, max_write_mbps=max_write_mbps,
                       host_budget_bytes=host_budget_bytes, host_write_bps=host_write_bps,
                       host_read_bps=host_read_bps, keep_last_modules=keep_last_modules,
                       backward_factor=backward_factor, prefetch_modules=prefetch_modules,
                       stall_tolerance_seconds=stall_tolerance_seconds, replan_fraction=replan_fraction,
                       writes_within_forward=writes_within_forward, guarded_writes=guarded_writes,
                       activation_budget_bytes=activation_budget_bytes, copy_bound_bytes=copy_bound_bytes,
                       partial_offload=partial_offload, peak_budget_bytes=peak_budget_bytes,
                       window_bytes=window_bytes, lead_per_module=lead_per_module,
                       kept_in_distance=kept_in_distance, shared_at_last_user=shared_at_last_user,
                       priority_loads=priority_loads, staging_bytes=staging_bytes)
    profiles = [_module(i, dict(m)) for i, m in enumerate(modules)]
    return as_dict(_core.plan_budget(profiles, options))


def simulate(modules: Iterable[Mapping[str, Any]], placements: Iterable[str], write_bps: float = 0.0,
             read_bps: float = 0.0, *, offload_limits: Iterable[int | None] | None = None, **settings) -> dict:
    """The timing model replayed for given placements, one per module:
    "keep", "offload_cpu", "offload_ssd", "recompute", "recompute_offload_cpu"
    or "recompute_offload_ssd" (a fixed strategy's row of a ROK curve, or a
    plan forced in tests). ``offload_limits``: per module, the bytes an
    offloaded module moves (the first of its saves; None: all of them; Note
    [Partial offload]). ``settings`` are plan_offload's keywords; returns
    the same dict."""
    options = _options(write_bps, read_bps, **settings)
    profiles = [_module(i, dict(m)) for i, m in enumerate(modules)]
    limits = [] if offload_limits is None else [-1 if v is None else int(v) for v in offload_limits]
    return as_dict(_core.plan_simulate(profiles, options, [str(p) for p in placements], limits))


def simulate_ran(modules: Iterable[Mapping[str, Any]], placements: Iterable[str], write_bps: float = 0.0,
                 read_bps: float = 0.0, *, offload_limits: Iterable[int | None] | None = None,
                 lead_bytes: Iterable[int] | None = None, release_after: Iterable[int] | None = None,
                 **settings) -> dict:
    """A step as it ran (a replay, Note [Step model]): ``simulate`` with the
    reload leads it used (bytes per module, 0: the window) and, on a GPU,
    its release points (``release_after[b]``: the last module released after
    module b's forward, -1 none; None: the glue's rule on the model's times)."""
    options = _options(write_bps, read_bps, **settings)
    profiles = [_module(i, dict(m)) for i, m in enumerate(modules)]
    limits = [] if offload_limits is None else [-1 if v is None else int(v) for v in offload_limits]
    return as_dict(_core.plan_simulate_ran(profiles, options, [str(p) for p in placements], limits,
                                           [int(v) for v in lead_bytes or ()],
                                           [int(v) for v in release_after or ()]))


def _options(write_bps, read_bps, *, target="auto", max_write_mbps=None, host_budget_bytes=0, host_write_bps=0.0,
             host_read_bps=0.0, keep_last_modules=1, backward_factor=2.0, prefetch_modules=2,
             stall_tolerance_seconds=0.0, replan_fraction=0.7, writes_within_forward=False,
             guarded_writes=False, activation_budget_bytes=0, copy_bound_bytes=0, partial_offload=False,
             peak_budget_bytes=0, window_bytes=0, lead_per_module=True, kept_in_distance=True,
             shared_at_last_user=True, priority_loads=True, staging_bytes=1 << 30):
    if target not in ("auto", "ssd", "cpu"):
        raise ValueError(f"planner target {target!r} is not valid (valid: auto, ssd, cpu)")
    if target == "cpu" and int(host_budget_bytes) <= 0:
        raise ValueError("planner target 'cpu' needs host_budget_bytes > 0")
    if target == "ssd":
        host_budget_bytes = 0
    elif target == "cpu":
        write_bps = read_bps = 0.0
    # Checked here to name the argument: the core sees max_write_bps, in bytes/s.
    if max_write_mbps is not None and max_write_mbps < 0:
        raise ValueError(f"planner setting 'max_write_mbps' must be >= 0, got {max_write_mbps}")
    return make(_core.PlannerOptions, {
        "write_bps": float(write_bps),
        "read_bps": float(read_bps),
        "max_write_bps": float(max_write_mbps) * 1e6 if max_write_mbps else 0.0,
        "host_budget_bytes": int(host_budget_bytes),
        "host_write_bps": float(host_write_bps),
        "host_read_bps": float(host_read_bps),
        "keep_last_modules": int(keep_last_modules),
        "backward_factor": float(backward_factor),
        "prefetch_modules": int(prefetch_modules),
        "stall_tolerance_seconds": float(stall_tolerance_seconds),
        "replan_fraction": float(replan_fraction),
        "writes_within_forward": bool(writes_within_forward),
        "guarded_writes": bool(guarded_writes),
        "activation_budget_bytes": int(activation_budget_bytes),
        "copy_bound_bytes": int(copy_bound_bytes),
        "partial_offload": bool(partial_offload),
        "peak_budget_bytes": int(peak_budget_bytes),
        "window_bytes": int(window_bytes),
        "lead_per_module": bool(lead_per_module),
        "kept_in_distance": bool(kept_in_distance),
        "shared_at_last_user": bool(shared_at_last_user),
        "priority_loads": bool(priority_loads),
        "staging_bytes": int(staging_bytes),
    }, "planner")


def _module(i: int, m: dict):
    name = str(m["name"]) if "name" in m else f"module{i}"
    for key in ("forward_seconds", "bytes"):
        if key not in m:
            raise ValueError(f"module {i} ('{name}') lacks '{key}'")
    fields = {"name": name, "forward_seconds": m["forward_seconds"], "bytes": m["bytes"]}
    for key in ("fixed_bytes", "recomputable", "recompute_bytes", "recompute_seconds", "backward_seconds",
                "grad_bytes", "forward_temp_bytes", "backward_temp_bytes"):
        if key in m:
            fields[key] = m[key]
    if "saves" in m:
        try:
            fields["saves"] = [(int(b), int(sh)) for b, sh in m["saves"]]
        except (TypeError, ValueError):
            raise ValueError(f"module {i} ('{name}'): saves must be (bytes, shared id or -1) pairs") from None
    return make(_core.ModuleProfile, fields, f"module {i} ('{name}')")


def ran_placement(module: Mapping[str, Any]) -> str:
    """A plan row's placement as ``simulate`` and ``simulate_ran`` take it: the
    plan writes ``recompute_offload`` with the tier apart, they take it whole
    (``recompute_offload_cpu``, ``recompute_offload_ssd``)."""
    placement = module["placement"]
    return f"{placement}_{module['tier']}" if placement == "recompute_offload" else placement


def needs_replan(plan: Mapping[str, Any], measured_bps: float, direction: str = "write") -> bool:
    """True when ``plan`` offloads to the SSD and the measured bandwidth of
    `direction` ("write" or "read") fell below ``plan["replan_fraction"]``
    (default 0.7) of what it planned for."""
    return _core.plan_needs_replan(int(plan["bytes_ssd"]), float(plan[_planned_key(direction)]),
                                   float(plan["replan_fraction"]), _rate(measured_bps, direction))


def link_faster(plan: Mapping[str, Any], measured_bps: float, direction: str = "write") -> bool:
    """True when ``plan`` offloads to the SSD and the measured bandwidth of
    `direction` rose above what it planned for divided by
    ``plan["replan_fraction"]``: the profiling step writes fresh files, slower
    than later steps do, and the probe reads back what it has just written."""
    return _core.plan_link_faster(int(plan["bytes_ssd"]), float(plan[_planned_key(direction)]),
                                  float(plan["replan_fraction"]), _rate(measured_bps, direction))


def rate_change_words(plan: Mapping[str, Any], rates: Mapping[str, Any]) -> str:
    """'SSD writes ran at X MB/s, below 70% of the Y MB/s the plan assumed'
    for each direction of `rates` ({"write": bps or None, "read": ...})
    whose measured rate crossed one of `plan`'s re-plan bounds."""
    out = []
    for d, v in rates.items():
        if v is None:
            continue
        if needs_replan(plan, v, d):
            how = f"below {100 * plan['replan_fraction']:.0f}% of"
        elif link_faster(plan, v, d):
            how = f"above {100 / plan['replan_fraction']:.0f}% of"
        else:
            continue
        out.append(f"SSD {d}s ran at {v / 1e6:.1f} MB/s, {how} the {plan[f'planned_{d}_bps'] / 1e6:.1f} MB/s "
                   "the plan assumed")
    return "; ".join(out)


def _rate(bps: float, direction: str) -> float:
    bps = float(bps)
    if not math.isfinite(bps) or bps < 0:
        raise ValueError(f"measured {direction} bandwidth must be a non-negative number of bytes/s, got {bps}")
    return bps


def _planned_key(direction: str) -> str:
    if direction not in ("write", "read"):
        raise ValueError(f"direction {direction!r} is not valid (valid: 'write', 'read')")
    return f"planned_{direction}_bps"
