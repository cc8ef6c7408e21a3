"""Replays of recorded runs through the step model (Note [Step model] in
cpp/src/plan/step_model.cpp; docs/model.md, "Replays").

A run is a dict in the trace format the GPU stages write (``TRACE_FORMAT``;
ebbtide.harness.gpu_runs reads the bench JSON files of older runs into the
same shape):

- ``name``; ``modules``: the planner's module profiles, in forward order
  (forward and backward seconds measured with offloading off, saved bytes
  and saves, gradient bytes, temporaries; see ebbtide.plan.planner);
- ``options``: the planner settings the cache ran with (rates, copy bound,
  its reload rules then), ``ran``: the plan it ran (``placements``,
  ``offload_limits``, ``lead_bytes``, ``release_after``);
- ``measured``: ``step_seconds`` and ``peak_bytes`` (the allocator's peak
  above the step's start), and whatever else the run recorded;
- ``now_options``: the settings the planner would be given today for the
  same run (the cache's rules now, the run's budget), for ``best``.

``replay_run`` predicts the step that ran and plans it anew; ``replay``
does so for every run of a file's worth. No torch here.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping

from ebbtide.plan import planner

__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "replay", "replay_run", "predicted_of", "TOLERANCE"]

TRACE_FORMAT = "ebbtide-step-trace"
TRACE_VERSION = 1
# The bar for a replay: predicted within 5% of measured.
TOLERANCE = 0.05


def predicted_of(plan: Mapping[str, Any]) -> dict:
    """The figures of a planner dict that a run measures."""
    return dict(step_seconds=plan["predicted_step_seconds"], peak_bytes=plan["peak_allocated_bytes"],
                peak_saved_bytes=plan["peak_resident_bytes"], forward_wait_seconds=plan["forward_wait_seconds"],
                backward_wait_seconds=plan["backward_wait_seconds"],
                bytes_offloaded=plan["bytes_cpu"] + plan["bytes_ssd"],
                modules_recomputed=plan["modules_recomputed"])


def _ratio(predicted, measured):
    return None if not measured else predicted / measured


def replay_run(run: Mapping[str, Any]) -> dict:
    """The plan that ran, predicted, against what was measured; and the plan
    the planner chooses now for the same profile, predicted.

    Args:
        run: one run in the trace format (see the module's docstring).

    Returns:
        ``{"name", "kind", "ran": {"predicted", "measured", "ratio",
        "within"}, "best": {"predicted", "plan"}, "assumptions"}``;
        ``ratio`` is predicted / measured for step_seconds and peak_bytes,
        ``within`` whether both are within TOLERANCE.

    Raises:
        ValueError: a run that lacks a field, naming it.
    """
    for key in ("name", "modules", "options", "ran", "measured"):
        if key not in run:
            raise ValueError(f"replay: run {run.get('name', '?')!r} lacks {key!r}")
    modules = run["modules"]
    ran = run["ran"]
    options = dict(run["options"])
    plan = planner.simulate_ran(modules, ran["placements"], offload_limits=ran.get("offload_limits"),
                                lead_bytes=ran.get("lead_bytes"), release_after=ran.get("release_after"),
                                **options)
    measured = {k: run["measured"][k] for k in ("step_seconds", "peak_bytes") if k in run["measured"]}
    predicted = predicted_of(plan)
    ratio = {k: _ratio(predicted[k], measured.get(k)) for k in ("step_seconds", "peak_bytes")}
    within = all(r is not None and abs(r - 1) <= TOLERANCE for r in ratio.values())
    out = dict(name=run["name"], kind=run.get("kind", "offload"),
               ran=dict(predicted=predicted, measured=dict(run["measured"]), ratio=ratio, within=within,
                        plan=_placements(plan)),
               assumptions=list(run.get("assumptions", [])))
    now = run.get("now_options")
    if now is not None:
        best = planner.plan_offload(modules, **dict(now))
        out["best"] = dict(predicted=predicted_of(best), plan=_placements(best), feasible=best["feasible"])
    return out


def _placements(plan: Mapping[str, Any]) -> list:
    """A plan's rows as the replay reports them; with each row's tier, which
    planner.ran_placement needs to name a recompute_offload placement whole."""
    return [dict(name=m["name"], placement=m["placement"], tier=m["tier"], offload_bytes=m["offload_bytes"],
                 lead_bytes=m["lead_bytes"], wait_seconds=m["wait_seconds"]) for m in plan["modules"]]


def replay(runs: Iterable[Mapping[str, Any]], source: str = "") -> dict:
    """``replay_run`` for each run, then the targets of the runs together
    (``targets``): ``{"source", "runs": [...], "within", "targets"}``;
    ``within`` is true when every run not kept ``apart`` reproduces its
    measured step and peak within TOLERANCE."""
    runs = [copy.deepcopy(dict(r)) for r in runs]
    results = [replay_run(r) for r in runs]
    for r, run in zip(results, runs):
        r["apart"] = bool(run.get("apart"))
        if r["apart"] and run.get("apart_why"):
            r["apart_why"] = run["apart_why"]
    return dict(source=source, runs=results, within=all(r["ran"]["within"] for r in results if not r["apart"]),
                targets=targets(runs, results), unpredicted=unpredicted(runs, results))


# ------------------------------------------------------------------ targets
# Issue 40's bar for a plan, as the replay predicts it on a run's profile.
STEP_RATIO = 1.03          # offload: step no more than 3% over no offload's
REACHABLE_FRACTION = 0.8   # offload: the peak cut at least 0.8 of the reachable one
RECOMPUTE_SPEEDUP = 0.95   # budget at full recompute's peak: 5% faster than full recompute
SWEEP_POINTS = 5           # allocator budgets from keep's peak to full recompute's


def reachable_cut(run: Mapping[str, Any], none_peak: float) -> dict:
    """The largest peak cut offloading can reach on this profile, as a
    fraction of no offload's peak: the link's (what it copies during no
    offload's forward) and the backward's floor (every module but the last
    offloaded over a link a thousand times faster, each reloaded as late as
    hides it: the gradients and what backward holds then stay), and the
    smaller of the two."""
    options = dict(run["now_options"] or run["options"])
    modules = run["modules"]
    forward = sum(m["forward_seconds"] for m in modules)
    link = options.get("host_write_bps") or options.get("write_bps") or 0.0
    eligible = sum(m["bytes"] for m in modules[:-1])
    link_cut = min(eligible, link * forward) / none_peak if none_peak else 0.0
    fast = dict(options, host_write_bps=link * 1e3, host_read_bps=(options.get("host_read_bps") or link) * 1e3,
                host_budget_bytes=1 << 60, copy_bound_bytes=0, activation_budget_bytes=0, peak_budget_bytes=0)
    keep_last = int(fast.get("keep_last_modules", 1))
    placements = ["offload_cpu"] * (len(modules) - keep_last) + ["keep"] * keep_last
    floor = planner.simulate(modules, placements, **fast)["peak_allocated_bytes"]
    floor_cut = max(0.0, 1 - floor / none_peak) if none_peak else 0.0
    return dict(link_cut=link_cut, floor_cut=floor_cut, reachable_cut=min(link_cut, floor_cut),
                floor_peak_bytes=floor)


def _check(name, value, limit, op):
    met = value <= limit if op == "<=" else value >= limit
    return dict(name=name, value=value, limit=limit, op=op, met=bool(met))


def targets(runs: list, results: list) -> list:
    """The issue's targets on the best plans, as predicted: per offload run,
    step <= 1.03 x no offload's and a peak cut >= 0.8 of the reachable one
    (both against no offload's run of the same file, as the model predicts
    it); per budget run, the best plan no slower than each single strategy
    whose peak fits the budget, and at full recompute's peak >= 5% faster
    than full recompute."""
    out = []
    none = next(((run, r) for run, r in zip(runs, results) if r["kind"] == "offload"
                 and run["ran"]["placements"] and all(p == "keep" for p in run["ran"]["placements"])), None)
    for run, r in zip(runs, results):
        if "best" not in r:
            continue
        best = r["best"]["predicted"]
        if r["kind"] == "offload" and none is not None:
            base = none[1]["ran"]["predicted"]
            cut = 1 - best["peak_bytes"] / base["peak_bytes"]
            reach = reachable_cut(run, base["peak_bytes"])
            r["reachable"] = reach
            out.append(_check(f"{r['name']}: best step / no offload's", best["step_seconds"] / base["step_seconds"],
                              STEP_RATIO, "<="))
            if reach["reachable_cut"] > 0:
                out.append(_check(f"{r['name']}: best peak cut / reachable cut ({reach['reachable_cut']:.3f})",
                                  cut / reach["reachable_cut"], REACHABLE_FRACTION, ">="))
        elif r["kind"] == "budget":
            out.extend(_budget_checks(run, r, first=not any(x.get("sweep") for x in results)))
    return out


def _unbounded(run) -> dict:
    """The planner settings a run's plan is chosen with now, less its budgets."""
    return {k: v for k, v in run["now_options"].items() if k not in ("activation_budget_bytes", "peak_budget_bytes")}


def _simulated(modules, base, single: str) -> dict:
    """A single strategy played on the profile: "keep" every module, or
    "recompute" every recomputable one (full recompute)."""
    placements = ["recompute" if single == "recompute" and m.get("recomputable") else "keep" for m in modules]
    return planner.simulate(modules, placements, **base)


def unpredicted(runs: list, results: list) -> list:
    """The targets a run's peers set that the model cannot predict, each with
    why, in figures: ``[{"name", "why"}]``. Today: torch's
    activation_memory_budget with compiled blocks (the budget stage's
    "compiler" rows), which issue 40 asks ebbtide to match with its blocks
    compiled too; no profile of compiled blocks is recorded, and the figures
    say whether the uncompiled model could stand in for one."""
    out = []
    seen = set()
    for run, r in zip(runs, results):
        if r["kind"] != "budget" or not run.get("now_options"):
            continue
        for name, peer in sorted((run.get("peers") or {}).items()):
            if not name.startswith("compiler") or name in seen:
                continue
            seen.add(name)
            modules, base = run["modules"], _unbounded(run)
            least, keep = _simulated(modules, base, "recompute"), _simulated(modules, base, "keep")
            at = planner.plan_offload(modules, **dict(base, peak_budget_bytes=int(peer["peak_bytes"])))
            why = (f"torch's activation_memory_budget with compiled blocks ({name}) ran {peer['step_seconds']:.3f} s "
                   f"at an allocator peak of {peer['peak_bytes'] / 1e9:.2f} GB; the recorded profile is of "
                   f"uncompiled blocks, whose keep-all step the model plays in {keep['predicted_step_seconds']:.3f} s "
                   f"and whose peak with every block recomputed is {least['peak_allocated_bytes'] / 1e9:.2f} GB")
            if at["feasible"]:
                why += (f"; uncompiled, the plan at that peak would take {at['predicted_step_seconds']:.3f} s "
                        f"({at['predicted_step_seconds'] / peer['step_seconds']:.2f}x)")
            else:
                why += "; uncompiled, no plan reaches that peak"
            why += ": only a profile of compiled blocks judges it (gpu_check.sh budget_compiled)"
            out.append(dict(name=f"compiled blocks: ebbtide's step / {name}'s, at its allocator peak or lower",
                            why=why))
    return out


def _budget_checks(run, r, first: bool) -> list:
    """A budget run's best plan against the single strategies the model plays
    (keep, full recompute, offloading what hides) whose peak fits its budget;
    for the first budget run of a file (they share the model), the sweep of
    allocator budgets and the plan at full recompute's allocator peak."""
    modules, now = run["modules"], dict(run["now_options"])
    base = _unbounded(run)
    singles = {
        "keep": _simulated(modules, base, "keep"),
        "recompute": _simulated(modules, base, "recompute"),
        "offload": planner.plan_offload(modules, **base),
    }
    out = []
    best = r["best"]["predicted"]
    budget = now.get("activation_budget_bytes", 0)
    fits = [(k, p) for k, p in singles.items() if budget and p["peak_resident_bytes"] <= budget]
    for k, p in fits:
        out.append(_check(f"{r['name']}: best step / {k}'s (its saved peak fits the budget)",
                          best["step_seconds"] / p["predicted_step_seconds"], 1.0 + 1e-9, "<="))
    rec = singles["recompute"]
    if not first:
        return out
    # The sweep of allocator budgets from keep's peak down to full
    # recompute's: never slower than the fastest single strategy that fits.
    top, bottom = singles["keep"]["peak_allocated_bytes"], rec["peak_allocated_bytes"]
    sweep = []
    for k in range(SWEEP_POINTS):
        bound = int(top - (top - bottom) * k / (SWEEP_POINTS - 1))
        plan = planner.plan_offload(modules, **dict(base, peak_budget_bytes=bound))
        fitting = [p["predicted_step_seconds"] for p in singles.values() if p["peak_allocated_bytes"] <= bound]
        fastest = min(fitting) if fitting else None
        sweep.append(dict(peak_budget_bytes=bound, step_seconds=plan["predicted_step_seconds"],
                          peak_bytes=plan["peak_allocated_bytes"], feasible=plan["feasible"],
                          fastest_single_seconds=fastest))
        if fastest is not None:
            out.append(_check(f"{r['name']}: at an allocator budget of {bound / 1e9:.2f} GB, step / the fastest "
                              "single strategy's that fits", plan["predicted_step_seconds"] / fastest,
                              1.0 + 1e-9, "<="))
    r["sweep"] = sweep
    at_rec = planner.plan_offload(modules, **dict(base, peak_budget_bytes=rec["peak_allocated_bytes"]))
    r["at_recompute_peak"] = dict(predicted=predicted_of(at_rec), feasible=at_rec["feasible"],
                                  recompute=predicted_of(rec), plan=_placements(at_rec))
    out.append(_check(f"{r['name']}: at full recompute's peak, step / full recompute's",
                      at_rec["predicted_step_seconds"] / rec["predicted_step_seconds"], RECOMPUTE_SPEEDUP, "<="))
    return out
