"""The GPU budget stage (bench/budget_bench.py --fractions; scripts/gpu_check.sh's
budget and budget_compiled stages): ebbtide's budget plans on one model
against what a user would pick instead, with the allocator's peak above
the step's start as the memory each one takes.

Strategies (Runner's, harness.budget_sweep), each on its own copy of one
model built on the device, stepped in turn:
- the single strategies: keep, full recompute (HF checkpointing), offload
  (every block, not planned), torchtune (its OffloadActivations with HF
  checkpointing);
- torch's activation_memory_budget at each fraction (compiler; each block
  compiled);
- ebbtide (the cache's target, default "auto": host memory first, as a
  user with 125 GiB of host memory would pick): budget, a budget of saved
  activations at each fraction of keep's; memory, an allocator budget at
  `points` bounds from keep's allocator peak down to full recompute's
  (issue 40's sweep; the cache's memory_budget_bytes);
- ssd: budget at each fraction with target "ssd" (the 2026-11-28 rows), kept
  apart: a VM's disk is no user's choice, and the rows say so.
`compile`: every strategy's blocks compiled (torchtitan style), so that
ebbtide meets torch's activation_memory_budget, compiled no offload and
compiled full recompute on the same graphs.
"""
from __future__ import annotations

import copy
import time
from typing import Callable, Optional

import torch

from ebbtide.harness import budget_sweep
from ebbtide.harness.budget_sweep import _MODEL_KEYS, SHAPE_A, Runner, _scratch, _step_in_turn

STAGE_STRATEGIES = ("keep", "recompute", "offload", "torchtune", "compiler", "budget", "memory", "ssd")
SINGLES = ("keep", "recompute", "offload", "torchtune")  # issue 40: "the fastest single strategy that fits"
PEERS = ("recompute", "offload", "torchtune", "compiler")  # ebbtide must beat each at an equal or higher peak
MINE = ("budget", "memory")  # ebbtide's rows that count (ssd's are apart)
FIT = 1.05                    # a budget is met within 5%
RECOMPUTE_SPEEDUP = 0.95      # at full recompute's own peak: >= 5% faster
REFUSALS = ("cannot be met", "smallest")  # what the cache's refusal of a budget at its first step says
SSD_APART = "target ssd on the machine's disk: no user with host memory to spare picks it (kept apart)"


def _pre_steps(runner: Runner, warmup: int) -> None:
    """A runner's first warm-up steps before the rounds (its peaks then set
    the budgets); the rounds skip as many for it. Two where the warm-up has
    them: a compiled block's first step compiles, and its peak is no step's."""
    for _ in range(max(1, min(2, warmup))):
        runner.step(timed=False)


def _make(s, f, spec, model, common, *, keep_saved, target, compile):
    """The runner of strategy `s` at fraction `f` (None: none), on `model`."""
    if s == "offload":
        return Runner("offload", spec, model=model, target="ssd" if target == "ssd" else "cpu", compile=compile,
                      **common)
    if s in ("budget", "ssd"):
        return Runner("budget", spec, model=model, fraction=f, budget=int(f * keep_saved), compile=compile,
                      target="ssd" if s == "ssd" else target, name=s, **common)
    if s == "compiler":
        return Runner("compiler", spec, model=model, fraction=f, compile=compile, **common)
    return Runner(s, spec, model=model, compile=compile, **common)


def run_fractions(spec: Optional[dict] = None, *, fractions=(0.5, 0.25), strategies=budget_sweep.STRATEGIES,
                  steps: int = 4, warmup: int = 2, device: str = "cuda", dtype=torch.bfloat16,
                  path: Optional[str] = None, log: Callable[[str], None] = print, time_limit: Optional[float] = None,
                  strategy_limit: Optional[float] = None, points: int = 5, target: str = "auto",
                  compile: bool = False, trace_name: Optional[str] = None) -> dict:
    """The stage (see the module's docstring): every strategy of `strategies`
    (ssd and memory are the stage's names, the rest Runner's), budgets at
    `fractions` of keep's peak of saved activations, `points` allocator
    budgets from keep's allocator peak down to full recompute's. A strategy
    that cannot run here, or that a budget refuses, is a row of ``failed``
    with its error. `time_limit` (seconds from the call) and `strategy_limit`
    (seconds of one strategy's steps): _step_in_turn's; what they cut is a
    failed row marked cut. With `trace_name`, ``trace_runs`` holds the step
    trace's runs (ebbtide.harness.step_trace).

    Returns:
        dict: model, rows, failed, checks (ebbtide against each peer at an
        equal or higher allocator peak), sweep (each allocator budget against
        the fastest single strategy that fits it), target_met, ...
    """
    deadline = time.monotonic() + time_limit if time_limit is not None else None
    spec = dict(SHAPE_A, **(spec or {}))
    if points < 2 and "memory" in strategies:
        raise ValueError(f"points={points}: the allocator sweep needs at least 2 budgets")
    failed: list = []
    common = dict(device=device, dtype=dtype, path=path, meter=True, probe=True)
    with _scratch(path) as (path, runners):
        common["path"] = path
        t0 = time.perf_counter()
        template = budget_sweep.build_llama(**{k: spec[k] for k in _MODEL_KEYS}, device=torch.device(device),
                                            dtype=dtype)
        log(f"[budget] model built on {device} in {time.perf_counter() - t0:.1f} s")
        wanted = []
        for s in strategies:
            if s == "keep":
                continue
            if s in ("budget", "compiler", "ssd"):
                wanted += [(s, f) for f in fractions]
            elif s == "memory":
                wanted += [(s, k) for k in range(points)]
            else:
                wanted.append((s, None))
        # The copies first: the template then has no gradients to copy.
        t0 = time.perf_counter()
        copies = [copy.deepcopy(template) for _ in wanted]
        log(f"[budget] {len(copies)} copies in {time.perf_counter() - t0:.1f} s")
        keep = Runner("keep", spec, model=template, compile=compile, **common)
        runners.append(keep)
        _pre_steps(keep, warmup)
        keep_saved, keep_alloc = keep.last_saved_peak, keep.last_alloc_peak
        log(f"[budget] keep-all peak of saved activations {keep_saved / 2**30:.2f} GiB, of the allocator "
            f"{keep_alloc / 2**30:.2f} GiB (first steps {keep.seconds:.2f} s)")
        rec_alloc = None
        memory = []
        for (s, f), model in zip(wanted, copies):
            if s == "memory":
                memory.append((f, model))
                continue
            t0 = time.perf_counter()
            try:
                r = _make(s, f, spec, model, common, keep_saved=keep_saved, target=target, compile=compile)
                if s == "recompute":
                    _pre_steps(r, warmup)  # its allocator peak is the sweep's floor
                    rec_alloc = r.last_alloc_peak
            except Exception as exc:  # a peer missing here is a row, not a failed stage
                failed.append(dict(strategy=s, fraction=f, error=f"{type(exc).__name__}: {exc}", cut=False))
                log(f"[budget] {s}" + (f" {f:g}" if f is not None else "") + f" cannot run: {failed[-1]['error']}")
                continue
            runners.append(r)
            log(f"[budget] {r.label} set up in {time.perf_counter() - t0:.1f} s")
        bounds = []
        if memory and rec_alloc is None:
            failed.append(dict(strategy="memory", fraction=None, cut=False,
                               error="needs full recompute's allocator peak (the recompute strategy did not run)"))
        elif memory:
            bounds = [int(keep_alloc - (keep_alloc - rec_alloc) * k / (points - 1)) for k, _ in memory]
            log(f"[budget] allocator budgets from keep's {keep_alloc / 2**30:.2f} GiB to full recompute's "
                f"{rec_alloc / 2**30:.2f} GiB: " + ", ".join(f"{b / 2**30:.2f}" for b in bounds))
            for bound, (_, model) in zip(bounds, memory):
                r = Runner("memory", spec, model=model, memory_budget=bound, target=target, compile=compile,
                           **common)
                runners.append(r)
        del copies, memory
        _step_in_turn(runners, keep, warmup, steps, log, failed, each_step=True, deadline=deadline,
                      strategy_limit=strategy_limit, compare=True)
        rows = []
        for r in runners:
            rows.append(r.result(reference=keep))
            if r.name == "ssd":
                rows[-1].update(apart=True, apart_why=SSD_APART)
        runs = _trace_runs(runners, rows, trace_name, device) if trace_name is not None else None
    for f in failed:
        if any(w in f["error"] for w in REFUSALS):
            f["refused"] = True
    result = dict(model=spec, device=str(device), dtype=str(dtype), fractions=list(fractions), target=target,
                  compiled=bool(compile), keep_saved_peak=keep_saved, keep_allocated_peak=keep_alloc,
                  recompute_allocated_peak=rec_alloc, memory_budgets=bounds, rows=rows, failed=failed)
    result.update(judge(rows, failed, bounds, rec_alloc))
    if runs is not None:
        result["trace_runs"] = runs
    return result


def judge(rows: list, failed: list, bounds: list, rec_alloc: Optional[int]) -> dict:
    """The stage's checks: ebbtide (budget, memory) faster than each peer
    whose allocator peak is at or above its own; each allocator budget met
    within 5% (or refused) and no slower than the fastest single strategy
    whose peak fits it; at full recompute's own peak >= 5% faster than it."""
    checks = []
    for m in (r for r in rows if r["strategy"] in MINE):
        for peer in rows:
            if peer["strategy"] not in PEERS or peer["allocated_peak_bytes"] is None:
                continue
            if peer["allocated_peak_bytes"] >= m["allocated_peak_bytes"]:
                checks.append(dict(ebbtide=_label(m), budget_fraction=m["fraction"], peer=peer["strategy"],
                                   peer_fraction=peer["fraction"], step_ratio=m["step_seconds"] / peer["step_seconds"],
                                   faster=m["step_seconds"] < peer["step_seconds"]))
    sweep = []
    memory = {r["memory_budget_bytes"]: r for r in rows if r["strategy"] == "memory"}
    gone = {f.get("memory_budget_bytes"): f for f in failed if f["strategy"] == "memory"}
    for bound in bounds:
        r = memory.get(bound)
        singles = [s for s in rows if s["strategy"] in SINGLES and s["allocated_peak_bytes"] is not None
                   and s["allocated_peak_bytes"] <= bound]
        fastest = min(singles, key=lambda s: s["step_seconds"]) if singles else None
        entry = dict(memory_budget_bytes=bound, fastest_single=fastest["strategy"] if fastest else None)
        if r is None:
            f = gone.get(bound)
            entry.update(status=("refused: " if f.get("refused") else "cut: " if f.get("cut") else "failed: ")
                         + f["error"] if f else "did not run", met=False)
        else:
            entry.update(status="ran", allocated_peak_bytes=r["allocated_peak_bytes"], step_seconds=r["step_seconds"],
                         fits=r["allocated_peak_bytes"] <= FIT * bound)
            entry["vs_fastest_single"] = r["step_seconds"] / fastest["step_seconds"] if fastest else None
            entry["met"] = entry["fits"] and (fastest is None or entry["vs_fastest_single"] <= 1.0)
        if rec_alloc is not None and bound == rec_alloc:
            rec = next((s for s in rows if s["strategy"] == "recompute"), None)
            if rec is not None and r is not None:
                entry["vs_recompute"] = r["step_seconds"] / rec["step_seconds"]
                entry["met"] = entry["met"] and entry["vs_recompute"] <= RECOMPUTE_SPEEDUP
        sweep.append(entry)
    judged = bool(checks) or bool(sweep)
    return dict(checks=checks, sweep=sweep,
                target_met=judged and all(c["faster"] for c in checks) and all(e["met"] for e in sweep))


def _label(row):
    """A row's (or failed row's) name: its strategy and budget, as Runner.label."""
    if row.get("memory_budget_bytes") is not None:
        return f"{row['strategy']} {row['memory_budget_bytes'] / 1e9:.3g} GB"
    return row["strategy"] + (f" {row['fraction']:g}" if row.get("fraction") is not None else "")


def _trace_runs(runners, rows, label, device) -> list:
    """The step trace's runs: each planned ebbtide runner's cache run, then
    keep's and full recompute's on the first one's profile (Note [Runs
    without a cache] in ebbtide/harness/step_trace.py)."""
    from ebbtide.harness import step_trace

    cuda = str(device).startswith("cuda")
    by = {id(r): row for r, row in zip(runners, rows)}
    keep = next(r for r in runners if r.strategy == "keep")
    rec = next((r for r in runners if r.strategy == "recompute"), None)
    blocks_off = step_trace.with_names(keep.probe.names, step_trace.block_medians(keep.blocks)) if keep.blocks else None

    def measured(r):
        row = by[id(r)]
        out = dict(step_seconds=row["step_seconds"], peak_bytes=row["allocated_peak_bytes"],
                   peak_source=step_trace.PEAK_SOURCES["cuda" if cuda else "cpu"],
                   forward_seconds=row.get("forward_seconds"), peak_saved_bytes=row["peak_bytes"],
                   none_step_seconds=by[id(keep)]["step_seconds"],
                   none_peak_bytes=by[id(keep)]["allocated_peak_bytes"], blocks_off=blocks_off)
        if rec is not None:
            out.update(recompute_step_seconds=by[id(rec)]["step_seconds"],
                       recompute_peak_bytes=by[id(rec)]["allocated_peak_bytes"])
        for k in ("budget_bytes", "memory_budget_bytes", "target"):
            if row.get(k) is not None:
                out[k] = row[k]
        if r.cache is not None:
            out.update(step_trace.cache_counters(r.cache.stats()))
        if r.blocks:
            out.update(block_levels=step_trace.with_names(r.probe.names, r.blocks[-1]["levels"]),
                       level_source=step_trace.LEVEL_SOURCES["cuda" if cuda else "cpu"])
        return out

    runs = []
    for r in runners:
        run = r.trace_run(f"{label} {r.label}")
        if run is None:
            continue
        run["measured"] = measured(r)
        if by[id(r)].get("apart"):
            run.update(apart=True, apart_why=by[id(r)]["apart_why"])
        runs.append(run)
    if runs:
        template = runs[0]
        runs.insert(0, step_trace.strategy_run(template, f"{label} keep", ["keep"] * len(template["modules"]),
                                               measured(keep)))
        if rec is not None:
            runs.append(step_trace.strategy_run(template, f"{label} recompute",
                                                step_trace.recompute_placements(template), measured(rec),
                                                kind="recompute", apart=step_trace.RECOMPUTE_APART))
    return runs


def format_fractions(result) -> str:
    from ebbtide import _core

    fmt = lambda n: _core.format_bytes(n) if n is not None else "-"  # noqa: E731
    m = result["model"]
    lines = [f"activation budget vs peers on {result['device']}: Llama {m['layers']} layers, h={m['hidden']}, "
             f"s={m['seq']}, b={m['batch']}, {result['dtype']}"
             + (", blocks compiled" if result.get("compiled") else "")
             + f"; ebbtide's target {result.get('target', 'ssd')}; keep-all saved {fmt(result['keep_saved_peak'])}, "
             f"allocator {fmt(result.get('keep_allocated_peak'))}",
             f"{'strategy':<16}{'budget':>11}{'step s':>9}{'alloc peak':>12}{'saved peak':>12}{'recomp':>7}"
             f"{'grad diff':>10}"]
    for r in result["rows"]:
        if r.get("memory_budget_bytes") is not None:
            budget = fmt(r["memory_budget_bytes"])
        else:
            budget = f"{r['fraction']:g}" if r["fraction"] is not None else "-"
        diff = f"{r['max_grad_diff']:.1g}" if r["max_grad_diff"] is not None else "-"
        lines.append(f"{r['strategy']:<16}{budget:>11}{r['step_seconds']:>9.3f}{fmt(r['allocated_peak_bytes']):>12}"
                     f"{fmt(r['peak_bytes']):>12}{r['blocks_recomputed']:>7}{diff:>10}"
                     + ("  (apart)" if r.get("apart") else ""))
    for f in result["failed"]:
        what = "cut" if f.get("cut") else "refused" if f.get("refused") else "did not run"
        lines.append(f"{_label(f):<11} {what}: {f['error'].removeprefix('cut: ')}")
    for c in result["checks"]:
        lines.append(f"{c['ebbtide']} vs {c['peer']}"
                     + (f" {c['peer_fraction']:g}" if c["peer_fraction"] is not None else "")
                     + f" (peak >= ebbtide's): step {c['step_ratio']:.2f}x {'ok' if c['faster'] else 'NOT FASTER'}")
    for e in result.get("sweep", []):
        text = f"allocator budget {fmt(e['memory_budget_bytes'])}: "
        if e["status"] != "ran":
            text += e["status"]
        else:
            text += (f"peak {fmt(e['allocated_peak_bytes'])}" + ("" if e["fits"] else " OVER BUDGET")
                     + (f", step {e['vs_fastest_single']:.2f}x the fastest single that fits ({e['fastest_single']})"
                        if e.get("vs_fastest_single") is not None else ", no single strategy fits"))
            if "vs_recompute" in e:
                text += f", {e['vs_recompute']:.2f}x full recompute (target <= {RECOMPUTE_SPEEDUP})"
        lines.append(text + ("  ok" if e["met"] else "  MISSED"))
    lines.append("target (faster than each peer at equal or higher peak; each allocator budget met and no slower "
                 f"than the fastest single strategy that fits): {'met' if result['target_met'] else 'NOT met'}")
    return "\n".join(lines)
