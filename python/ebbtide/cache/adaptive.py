"""Adaptive placement for TensorCache: the profiling step, the plan, re-plans.

The tensor cache (ebbtide/cache/tensor_cache.py) calls into one ``Adaptive`` per cache:
``mark(scope)`` at every scope change of a forward (block pre-hooks, root
hooks), ``placement(scope)`` from the pack hook, ``begin_step`` /
``end_step`` around each step. The decision itself is the C++ planner's
(``ebbtide.plan.planner.plan_offload``, Note [Offload rule] in
cpp/src/plan/planner.cpp); this module only measures and passes numbers.

Note [Profiling step]
The first step (and the step after ``TensorCache.profile()``) offloads every
eligible tensor as a non-adaptive cache would (host tier first, spilling to
the SSD when the host budget is full), and measures:
- per scope, forward compute time: host clocks on CPU; on CUDA, events
  recorded in the hooks (no host sync) and read after the step;
- per scope, the bytes saved (the cache's per-scope bookkeeping);
- per tier, write and read bandwidth: bytes / busy time from the store's own
  meters over the step (Note [Tier meters] in cpp/src/cache/tiered_store.cpp).
  A tier the step moved less than 1 MiB through is measured by a short probe
  (8 MiB written and read back through the same store, cap included).
Offloading during the profile measures the bandwidth under the real load (the
store competing with compute, the cap applied); the compute times then include
what offloading costs the compute, which errs on the side of a longer forward,
i.e. it slightly favours offloading. Keeping everything and probing would give
cleaner compute times but an idle-disk bandwidth that training never sees.

Note [Budget profile]
For budget plans (Note [Budget plan] in cpp/src/plan/planner_budget.cpp) the
profiling step also records, per block: the bytes of its positional tensor
inputs (what torch's checkpoint saves when the block is recomputed) from its
pre-hook, and its own time and saved bytes between its pre- and post-hook.
A scope's recompute then leaves saved its inputs and what the scope saves
after the block, and re-runs the block's time. The last block's scope also
holds the head and the loss; with a budget, when keep_last_modules keeps it,
that tail is a planner module of its own ("<after blocks>", kept, never recomputed), so the
block's recompute is judged on the block alone, and a backward that holds the
recomputed block does not count the tail, which backward has freed by then.
With a budget the profiling step offloads on a GPU as on CPU (Note
[Profiling on a GPU] keeps everything resident otherwise), so the step that
measures does not exceed the budget by the whole keep-all peak.
"""
from __future__ import annotations

import copy
import logging
import time
import weakref
from typing import Optional

import torch

from ebbtide import _core
from ebbtide.cache import profile as _profile
from ebbtide.cache.summary import plan_line
from ebbtide.cache.budget import (Budgets, SlowLink, fmt_bytes as _fmt_bytes, infeasible_message, inflight_bound,
                                  ssd_view)
from ebbtide.plan import planner

logger = logging.getLogger("ebbtide")

_TIER_NAMES = {_core.TIER_CPU: "cpu", _core.TIER_SSD: "ssd"}
_TIER_OF = {"cpu": _core.TIER_CPU, "ssd": _core.TIER_SSD}
_MIN_MEASURED_BYTES = 1 << 20
# On a GPU the prefetch window spans this many of the largest blocks, and the
# plan assumes the same lead for reloads (Note [Release points]); on CPU one
# (prefetch_modules, the window of Note [Prefetch window] in tensor_cache.py).
_CUDA_PREFETCH_MODULES = 4
_PROBE_BYTES = 8 << 20


class Adaptive:
    """Profile -> plan -> apply -> watch, for one TensorCache."""

    def __init__(self, cache, *, max_write_bps: float, host_budget_bytes: int, backward_factor: float = 2.0,
                 prefetch_modules: int = 1, replan_fraction: float = 0.7, budgets: Budgets = Budgets()):
        self.cache = cache
        self.budgets = budgets
        self.max_write_bps = float(max_write_bps)
        self.host_budget_bytes = int(host_budget_bytes)
        self.backward_factor = backward_factor
        self.default_backward_factor = backward_factor
        self._step_begin = None
        self.prefetch_modules = prefetch_modules
        self.replan_fraction = replan_fraction
        self.profiling = True        # this (or the next) step profiles
        self.retiming = False        # this step times the blocks again (Note [Re-timed profile])
        self._retime_next = False
        self._retimes_left = 0          # planned steps that may still re-time (Note [Re-timed profile])
        self._timed_recomputes: set = set()  # scopes whose kept recompute time was timed as it ran
        self.last_profiled = False   # the last step begun was a profiling step
        self._profile_next = True
        self.plan: Optional[dict] = None
        self.decisions: dict = {}    # scope -> (offload, tier)
        self.limits: dict = {}       # scope -> bytes of its saves offloaded (Note [Partial offload]); absent: all
        self.profile_modules: list = []
        self.measured: dict = {}     # tier name -> {"write_bps", "read_bps", "source"}
        self.replans = 0
        self.plans = 0
        self.release_bytes: dict = {}  # scope -> offloaded bytes released after its forward
        self.leads: dict = {}          # scope -> reload lead in bytes (0: the window)
        self._marks: list = []       # (scope or None, float seconds | torch.cuda.Event)
        self._meter0: dict = {}
        self._cuda = False
        # Note [Budget profile]: per scope of the profiling step, what a
        # recompute would leave saved and re-run.
        self._inputs: dict = {}        # scope -> bytes of the block's positional tensor inputs
        self._block_open: dict = {}    # scope -> (time at the pre-hook, bytes saved in the scope by then)
        self._block: dict = {}         # scope -> [[(start, end) clocks or CUDA events], bytes saved inside the block]
        self.recomputable: dict = {}   # scope -> False when the user already checkpoints the block
        self.recompute_scopes: set = set()
        self.infeasible: Optional[str] = None  # the error of a budget no plan meets
        self._slow = SlowLink()  # Note [Budget at a slower link]
        self.max_inflight_bytes = int(cache._max_inflight)  # Note [Budget guard]
        self._bmarks: list = []      # Note [Backward profile]: (scope, point) as backward reaches blocks
        self._recomputes: dict = {}  # Note [Re-timed profile]: scope -> [(start, end)] of its recomputes
        self._grads = None           # (before, [per block], after) gradient bytes of the profiling step
        self._alloc = None           # the step's AllocatorWindow
        # The step's allocator peak above its start (CUDA, when the step raised
        # max_memory_allocated; None else): what memory_budget_bytes bounds.
        self.peak_allocated_bytes: Optional[int] = None

    # ---------------------------------------------------------------- control
    def request_profile(self) -> None:
        self._profile_next = True

    def begin_step(self, core_stats: dict) -> None:
        # _profile_next stays set until a profiling step completes: a step
        # that raised leaves the next one to profile.
        self.profiling = self._profile_next
        self.last_profiled = self.profiling
        # Note [Re-timed profile] (ebbtide/cache/profile.py): the first planned steps time the blocks again.
        self.retiming = self._retime_next and not self.profiling and self.plan is not None
        self._retime_next = False
        self._marks = []
        self._recomputes = {}  # scope -> [(start, end)] of its recomputes in this re-timed step
        self._inputs, self._block_open, self._block = {}, {}, {}
        self.infeasible = None
        if self.profiling:
            # The profile measures every block as the model runs it.
            self.cache._set_recompute(())
            self._guard(None)
        self._step_begin = self._now() if self.profiling or self.retiming else None
        self._meter0 = {t["tier"]: dict(t) for t in core_stats.get("tiers", [])}
        # Note [Backward profile]: the backward's marks, the gradients this
        # step makes (counted before it makes them), the allocator's window.
        self._bmarks = []
        if self.profiling:
            cache = self.cache
            model = cache._model_ref() if cache._model_ref is not None else None
            self._grads = _profile.gradient_bytes(cache._blocks, model) if model is not None else None
        self._alloc = _profile.AllocatorWindow(self.cache._device)

    def _now(self):
        """A point in time: a CUDA event on the compute stream (no sync) or a host clock."""
        dev = self.cache._device
        if dev is not None and dev.type == "cuda":
            self._cuda = True
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(dev))
            return ev
        return time.perf_counter()

    def mark(self, scope: Optional[int]) -> None:
        """A scope begins (None: the forward ended). Only while profiling or re-timing."""
        if self.profiling or self.retiming:
            self._marks.append((scope, self._now()))

    def recomputed(self, scope: int, start) -> None:
        """Block `scope`'s recompute in backward, begun at `start` (a _now()
        point), ends now. Only while re-timing (Note [Re-timed profile])."""
        if self.retiming:
            self._recomputes.setdefault(scope, []).append((start, self._now()))

    def mark_backward(self, scope: int) -> None:
        """Block `scope`'s backward begins (Note [Backward profile]). Only while profiling or re-timing."""
        if self.profiling or self.retiming:
            self._bmarks.append((scope, self._now()))

    def block_begins(self, scope: int, module, args) -> None:
        """Block pre-hook while profiling: its inputs (what a recompute saves)
        and whether the user already checkpoints it (Note [Budget profile])."""
        if not self.profiling:
            return
        cache = self.cache
        seen, nbytes = set(), 0
        for a in args:
            if isinstance(a, torch.Tensor):
                st = cache._eligible(a)
                if st is not None and st._cdata not in seen:
                    seen.add(st._cdata)
                    nbytes += st.nbytes()
        self._inputs[scope] = self._inputs.get(scope, 0) + nbytes
        # A block called with keyword tensors only is not recomputed: torch's
        # checkpoint saves (and picks the devices whose RNG it restores from)
        # the positional arguments alone.
        self.recomputable[scope] = (self.recomputable.get(scope, True) and bool(seen)
                                    and cache._may_recompute(module))
        self._block_open[scope] = (self._now(), cache._scope_bytes(scope))

    def block_ends(self, scope: int) -> None:
        """Block post-hook while profiling: the block's own time and bytes."""
        opened = self._block_open.pop(scope, None)
        if opened is None:
            return
        start, before = opened
        entry = self._block.setdefault(scope, [[], 0])
        entry[0].append((start, self._now()))
        entry[1] += self.cache._scope_bytes(scope) - before

    def _keeps_tail(self, scope: int) -> bool:
        """`scope` is the last block's, kept whole (keep_last_modules): what
        follows the block in it (head, loss) can be planned apart."""
        cache = self.cache
        return cache.keep_last_modules > 0 and cache._model_ref is not None and scope == cache._expected_blocks - 1

    def _block_seconds(self, scope: int) -> float:
        spans = self._block.get(scope, [[], 0])[0]
        if self._cuda:
            return sum(a.elapsed_time(b) / 1e3 for a, b in spans)
        return sum(b - a for a, b in spans)

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self._cuda else b - a

    def _measured_backward_factor(self, forward_seconds: float, stall_seconds: float) -> Optional[float]:
        """(step time - forward - stall) / forward of the profiling step, or None.

        Note [Backward factor]: the paper's backward ~ 2 x forward holds for
        large GPU matmuls; on CPU (and for small models) backward measured
        0.6-1x forward, and planning with 2x then offloads more than the step
        can hide. The step's wall time includes whatever else runs inside
        step() (an optimizer step, say), so this errs towards a longer backward.
        """
        a, b = self._step_begin, self._now()
        if forward_seconds <= 0 or a is None or type(a) is not type(b):
            return None
        if self._cuda:
            b.synchronize()
            total = a.elapsed_time(b) / 1e3
        else:
            total = b - a
        backward = total - forward_seconds - stall_seconds
        return min(max(backward / forward_seconds, 0.25), 4.0)

    def placement(self, scope: int):
        """(offload, tier) for a tensor saved in `scope` (tier -1: the store's order)."""
        if self.cache._model_ref is None:
            return True, -1  # unscoped (no attach): nothing to plan by
        if self.profiling:
            # Note [Profiling on a GPU]: the compute is timed undisturbed and
            # the link is probed apart, so a profile that offloads everything
            # (copies throttled by Note [Copy bound]) cannot inflate the
            # forward times the plan is made from.
            # With a budget the profile offloads on a GPU too: keeping every
            # block resident for it would exceed the budget (Note [Budget profile]).
            return not self.cache._on_cuda() or bool(self.budgets), -1
        if self.plan is None:
            return True, -1
        return self.decisions.get(scope, (False, -1))

    def offload_limit(self, scope: int) -> int:
        """The bytes of `scope`'s saves the plan offloads, the first in save
        order (Note [Partial offload] in cpp/src/plan/planner.cpp, Note [Scope
        byte limits] in python/src/torch/hooks.cpp); -1: all of them."""
        if self.cache._model_ref is None or self.plan is None or self.profiling:
            return -1
        return self.limits.get(scope, -1)

    def release_point(self, scope: int) -> tuple:
        """After block `scope`'s forward: (the last scope whose copies may be
        released, the micro-batch's offloaded bytes through which they are;
        -1: no bound). The plan's release points by bytes (Note [Release by
        bytes] in cpp/src/cache/tensor_cache_device.cpp): the copies the step
        model has done by the block's end, in copy order; the profiling step
        releases every block before this one."""
        if self.plan is None or self.profiling:
            return scope - 1, -1
        return scope, self.release_bytes.get(scope, 0)

    def lead(self, scope: int) -> int:
        """The reload lead in bytes of `scope`'s offloaded saves (Note
        [Reload lead] in cpp/src/plan/step_model.cpp); 0: the window."""
        if self.cache._model_ref is None or self.plan is None or self.profiling:
            return 0
        return self.leads.get(scope, 0)

    def window_bytes(self) -> Optional[int]:
        """The prefetch window the plan assumes (None: the cache's own rule)."""
        if self.plan is None or self.profiling:
            return None
        return int(self.plan["window_bytes"])

    # ------------------------------------------------------------ measurement
    def _scope_times(self) -> dict:
        marks = self._marks
        times: dict = {}
        if not marks:
            return times
        if self._cuda:
            marks[-1][1].synchronize()  # after the step: the hooks never sync
        for (scope, a), (_, b) in zip(marks, marks[1:]):
            if scope is None:
                continue
            dt = a.elapsed_time(b) / 1e3 if self._cuda else b - a
            times[scope] = times.get(scope, 0.0) + max(dt, 0.0)
        return times

    def _tier_rates(self, core_stats: dict) -> dict:
        out = {}
        for t in core_stats.get("tiers", []):
            t0 = self._meter0.get(t["tier"], {})
            dw = t["bytes_written"] - t0.get("bytes_written", 0)
            sw = t["write_seconds"] - t0.get("write_seconds", 0.0)
            dr = t["bytes_read"] - t0.get("bytes_read", 0)
            sr = t["read_seconds"] - t0.get("read_seconds", 0.0)
            out[t["tier"]] = dict(bytes_written=dw, write_bps=dw / sw if sw > 0 and dw else 0.0,
                                  bytes_read=dr, read_bps=dr / sr if sr > 0 and dr else 0.0)
        return out

    def _measure_tiers(self, core_stats: dict) -> dict:
        rates = self._tier_rates(core_stats)
        measured = {}
        for t in core_stats.get("tiers", []):
            name = t["tier"]
            if name == "cpu" and self.cache._on_cuda():
                # The device path copies over the link straight into host memory.
                try:
                    w, rd = self.cache._link_bandwidth()
                    measured[name] = dict(write_bps=w, read_bps=rd, source="link")
                except (OSError, RuntimeError) as exc:
                    logger.warning("ebbtide: measuring the GPU link failed (%s); the planner will not use "
                                   "host memory", exc)
                    measured[name] = dict(write_bps=0.0, read_bps=0.0, source="failed")
                continue
            r = rates[name]
            entry = dict(write_bps=r["write_bps"], read_bps=r["read_bps"], source="step")
            if r["bytes_written"] < _MIN_MEASURED_BYTES or r["bytes_read"] < _MIN_MEASURED_BYTES:
                tier = _core.TIER_CPU if name == "cpu" else _core.TIER_SSD
                nbytes = _PROBE_BYTES
                if name == "cpu" and self.host_budget_bytes:
                    nbytes = max(4096, min(nbytes, self.host_budget_bytes - t["bytes_held"]))
                try:
                    w, rd = self._probe(tier, nbytes)
                    if r["bytes_written"] < _MIN_MEASURED_BYTES:
                        entry["write_bps"] = w
                    if r["bytes_read"] < _MIN_MEASURED_BYTES:
                        entry["read_bps"] = rd
                    entry["source"] = "probe" if entry["source"] == "step" and r["bytes_written"] < _MIN_MEASURED_BYTES \
                        else "step+probe"
                except (OSError, RuntimeError) as exc:
                    logger.warning("ebbtide: probing the %s tier failed (%s); the planner will not use it", name, exc)
                    entry = dict(write_bps=0.0, read_bps=0.0, source="failed")
            measured[name] = entry
        return measured

    def end_step(self, core_stats: dict) -> None:
        self.peak_allocated_bytes = self._alloc.peak() if self._alloc is not None else None
        if self.profiling:
            times = self._scope_times()
            step_plan = self.cache._plan
            modules = []
            for scope in sorted(set(times) | set(step_plan)):
                p = step_plan.get(scope)
                if p is None and scope < 0:
                    continue  # no time worth planning before the first block
                name = p["module"] if p else self.cache._scope_name(scope)
                # Offloadable bytes: what the profile offloaded; kept scopes (keep_last) count whole.
                # What stays anyway (below min_bytes) is fixed: in the peak, never moved.
                total = 0 if p is None else p["bytes"]
                nbytes = 0 if p is None else (total if p["decision"] == "keep" else p["bytes_offloaded"])
                m = dict(name=name, scope=scope, forward_seconds=times.get(scope, 0.0), bytes=nbytes,
                         fixed_bytes=total - nbytes)
                tail = None
                if scope in self._block and self.recomputable.get(scope):
                    # Note [Budget profile]: a recompute re-runs the block and
                    # leaves saved its inputs and what the scope saves after it.
                    inside = min(self._block[scope][1], total)
                    seconds = self._block_seconds(scope)
                    m.update(recomputable=True, recompute_bytes=self._inputs.get(scope, 0) + total - inside,
                             recompute_seconds=seconds)
                    if self.budgets and self._keeps_tail(scope) and total > inside:
                        # The head and the loss follow the last block in its
                        # scope, kept: a module of their own, so the block's
                        # recompute is judged on the block alone.
                        m.update(bytes=inside, fixed_bytes=0, recompute_bytes=self._inputs.get(scope, 0),
                                 forward_seconds=min(seconds, m["forward_seconds"]))
                        tail = dict(name="<after blocks>", scope=scope, tail=True, bytes=total - inside,
                                    forward_seconds=max(times.get(scope, 0.0) - seconds, 0.0))
                modules.append(m)
                if tail is not None:
                    modules.append(tail)
            self.profiling = False
            if not self._marks or cache_unscoped(self.cache):
                return  # no module scopes to time: profile again once attached
            self._profile_next = False
            self.profile_modules = modules
            fwd = sum(m["forward_seconds"] for m in modules)
            end = self._now()
            factor = self._measured_backward_factor(fwd, core_stats["step"]["stall_seconds"])
            self.backward_factor = factor if factor is not None else self.default_backward_factor
            self._profile_backward(modules, end)
            self.measured = self._measure_tiers(core_stats)
            self._calibrate_temporaries(modules)
            self._make_plan(reason="profile")
            self._retime_next = True
            self._retimes_left, self._timed_recomputes = _profile.RETIMED_STEPS, set()
            return
        retiming, self.retiming = self.retiming, False
        if self._shape_changed():
            return  # the next step profiles: this one's times are of another shape
        if retiming:  # the rates are checked (and the probe run) after its timings are read
            remade, change = self._retime(core_stats)
            if remade:
                return  # the plan is made again, at the step's rates too
        else:
            change = self._ssd_rate_change(core_stats)  # once a step: it may run the probe
        if change is not None:
            rates, slower = change
            # Note [Quiet re-plan]: the plan is remade with the measured rates;
            # only a plan that places blocks differently is a re-plan users hear
            # of (`replans`, the INFO line; a WARNING when the SSD got slower).
            # Small steps measure noisy rates; a slower SSD that still hides
            # every copy changes nothing. Faster writes: the profiling step
            # writes fresh files (CI VM: 0.8-1.0 GB/s, later steps 2.4), so its
            # plan may recompute or keep what the link can carry. Reads: a GPU's
            # profiling step keeps everything resident, so its SSD rates are the
            # probe's, which reads back what it has just written (CI VM:
            # 1.16-1.64x the steps' rate, bench/probe_bench.py).
            old = self.plan
            self._take_rates(rates)
            self._make_plan(reason="replan", log=False)
            self._budget_at_measured_rates()
            words = planner.rate_change_words(ssd_view(old), rates)
            if [m["placement"] for m in self.plan["modules"]] == [m["placement"] for m in old["modules"]]:
                logger.debug("ebbtide: %s; the plan at the measured rates is unchanged", words)
                self.plan["reason"] = old["reason"]
                return
            self.replans += 1
            (logger.warning if slower else logger.info)("ebbtide: %s; re-planned for the next step", words)
            self._log_plan()

    def _ssd_rate_change(self, core_stats: dict):
        """(the step's SSD rates, slower) when a measured rate, of writes or
        of reads, is far enough from the plan's to make it again (Note [Quiet
        re-plan]); None otherwise. The rates are those the step measured (at
        least 1 MiB moved that way), each None where it did not; the probe's
        while a plan that misses its budget moves nothing to the SSD (Note
        [Budget at a slower link])."""
        if self.plan is None:
            return None
        if self.plan["bytes_ssd"]:
            r = self._tier_rates(core_stats).get("ssd")
        elif self._slow.probe_due():
            r = self._ssd_probe()
        else:
            return None
        if r is None:
            return None
        rates = {}
        for d, moved in (("write", "bytes_written"), ("read", "bytes_read")):
            ok = r[moved] >= _MIN_MEASURED_BYTES and r[f"{d}_bps"] > 0
            rates[d] = r[f"{d}_bps"] if ok else None
        plan = ssd_view(self.plan)
        slower = any(v is not None and planner.needs_replan(plan, v, d) for d, v in rates.items())
        # A plan at the cap gains nothing from faster writes (the cap lets
        # bursts through, so a step may measure above it).
        at_cap = self.max_write_bps and self.plan["planned_write_bps"] >= self.max_write_bps * (1 - 1e-9)
        faster = any(v is not None and not (d == "write" and at_cap) and planner.link_faster(plan, v, d)
                     for d, v in rates.items())
        if slower or faster:
            return rates, slower
        return None

    def _take_rates(self, rates: dict) -> None:
        """The step's SSD rates replace the plan's (Note [Quiet re-plan]); the probe's where it moves none."""
        ssd = self.measured.setdefault("ssd", {})
        ssd.update({f"{d}_bps": v for d, v in rates.items() if v is not None},
                   source="step" if self.plan["bytes_ssd"] else "probe")

    def _backward_times(self, end) -> dict:
        """Seconds of each module's backward in the step just ended (keys:
        scopes, "tail" for what follows the last block; Note [Backward
        profile]); empty when the backward was not marked. A module missing
        from it is planned with backward_factor x its forward."""
        forward_end = next((p for scope, p in reversed(self._marks) if scope is None), None)
        if forward_end is None or not self._bmarks or type(forward_end) is not type(end):
            return {}
        tail = any(m.get("tail") for m in (self.profile_modules or []))
        return _profile.backward_seconds(self._bmarks, forward_end, end, self._elapsed, tail)

    def _profile_backward(self, modules: list, end) -> None:
        """Each module's backward time and gradient bytes (Note [Backward profile])."""
        back = self._backward_times(end)
        if back:
            for m in modules:
                key = "tail" if m.get("tail") else m["scope"]
                if key in back:
                    m["backward_seconds"] = back[key]
                elif m["scope"] < 0:
                    m["backward_seconds"] = 0.0
        if self._grads is None:
            return
        before, per, after = self._grads
        blocks = [m for m in modules if m["scope"] >= 0 and not m.get("tail")]
        for m in blocks:
            m["grad_bytes"] = per[m["scope"]] if m["scope"] < len(per) else 0
        if not blocks:
            return
        last = modules[-1]
        last["grad_bytes"] = last.get("grad_bytes", 0) + after
        first = next((m for m in modules if m["scope"] < 0), blocks[0])
        first["grad_bytes"] = first.get("grad_bytes", 0) + before

    def _retime(self, core_stats: dict) -> tuple:
        """Note [Re-timed profile] (ebbtide/cache/profile.py): (whether the
        plan was made again, with the step's times and rates; _ssd_rate_change's answer)."""
        times = self._scope_times()
        first = self._retimes_left == _profile.RETIMED_STEPS
        self._retimes_left -= 1
        if not times:
            return False, self._ssd_rate_change(core_stats)
        end = self._now()
        if self._cuda:
            end.synchronize()  # the backward's marks and recomputes came after the forward's last mark, synced
        back = self._backward_times(end)
        recomputed = {scope: sum(self._elapsed(a, b) for a, b in spans) for scope, spans in self._recomputes.items()}
        change = self._ssd_rate_change(core_stats)  # after the step's end point: a probe is not timed
        before, after, moved = _profile.retime(self.profile_modules, times, back, recomputed, self._timed_recomputes,
                                               first)
        remade = after > 0 and moved
        if remade:
            old = self.plan
            if change is not None:
                self._take_rates(change[0])
            self._make_plan(reason="retime", log=False)
            if (change is not None and change[1]) or self._slow.missed:  # Note [Budget at a slower link]
                self._budget_at_measured_rates()
            changed = old is None or [m["placement"] for m in old["modules"]] != [
                m["placement"] for m in self.plan["modules"]]
            words = "a planned step timed the blocks %.0f%% %s than the profile kept" % (
                100 * abs(before - after) / before, "faster" if after <= before else "slower")
            if change is not None and old is not None:
                words = f"{planner.rate_change_words(ssd_view(old), change[0])}; {words}"
            # As Note [Quiet re-plan]: only a plan that places blocks
            # differently is announced, a WARNING when the SSD got slower.
            say = (logger.warning if change is not None and change[1] else logger.info) if changed else logger.debug
            say("ebbtide: %s; re-planned%s", words, "" if changed else " (placements unchanged)")
            if changed:
                self.replans += 1
                self._log_plan()
        untimed = self.recompute_scopes - self._timed_recomputes
        settling = before > 0 and after < (1 - _profile.SETTLED) * before
        self._retime_next = self._retimes_left > 0 and (settling or bool(untimed))
        return remade, change

    def _budget_at_measured_rates(self) -> None:
        """Note [Budget at a slower link] in ebbtide/cache/budget.py: a plan
        remade at the rates a step measured does not stop training when it
        misses the budget; it says so once per budget."""
        msg, self.infeasible = self.infeasible, None
        said = self._slow.miss(msg, self.plan) if msg is not None else None
        if said:
            logger.warning("%s", said)

    def _probe(self, tier: int, nbytes: int) -> tuple:
        """(write, read) bytes/s of the tier's probe of `nbytes` (OSError, RuntimeError when it fails)."""
        w, rd = self.cache._core.probe(tier, nbytes)
        return nbytes / w if w > 0 else 0.0, nbytes / rd if rd > 0 else 0.0

    def _ssd_probe(self) -> Optional[dict]:
        """The SSD's rates by its probe, as _tier_rates gives a step's (Note
        [Budget at a slower link]); None when the probe fails."""
        try:
            w, rd = self._probe(_core.TIER_SSD, _PROBE_BYTES)
        except (OSError, RuntimeError):
            return None
        return dict(bytes_written=_PROBE_BYTES, write_bps=w, bytes_read=_PROBE_BYTES, read_bps=rd)

    def _shape_changed(self) -> bool:
        """A planned step whose saves differ from the profile's by more than a
        tenth (another sequence length or batch, a plan kept across calls of
        offload()): the next step profiles again."""
        if not self.profile_modules or self.plan is None:
            return False
        step = sum(p["bytes"] for p in self.cache._plan.values())
        planned = sum(d["saved_bytes"] + d["fixed_bytes"] for d in self.plan["modules"])
        if planned and step and abs(step - planned) > 0.1 * planned:
            logger.info("ebbtide: this step saved %s where the plan expected %s; profiling the next step again",
                        _fmt_bytes(step), _fmt_bytes(planned))
            self.request_profile()
            return True
        return False

    # Note [Plans across offload() calls]
    # ebbtide.offload() makes a cache per step (the README's one-step form),
    # and a cache's first step profiles: on a GPU that step keeps every
    # activation resident, so a loop of offload() calls never offloaded. The
    # profile and measurements are kept per model and settings when such a
    # cache closes, and the next one for the same model and settings plans
    # from them at once (re-timing its first steps where the last cache had
    # not finished, Note [Re-timed profile]); a step whose saves no longer
    # match profiles again.
    def snapshot(self) -> dict:
        """What a later cache of the same model and settings plans from."""
        return dict(profile_modules=copy.deepcopy(self.profile_modules), measured=copy.deepcopy(self.measured),
                    backward_factor=self.backward_factor, recomputable=dict(self.recomputable),
                    retime=self._retime_next, retimes_left=self._retimes_left,
                    timed_recomputes=set(self._timed_recomputes), slow=copy.copy(self._slow),
                    # which module each scope is: a cache learns it in a forward, after the plan applies
                    scope_modules={s: weakref.ref(m) for s, m in self.cache._scope_modules.items()})

    def restore(self, state: dict) -> None:
        """Plans from a snapshot() instead of profiling the next step."""
        self.profile_modules = copy.deepcopy(state["profile_modules"])
        self.measured = copy.deepcopy(state["measured"])
        self.backward_factor = state["backward_factor"]
        self.recomputable = dict(state["recomputable"])
        self._profile_next = self.profiling = False
        blocks = {id(b) for _, b in self.cache._blocks}
        for s, ref in state["scope_modules"].items():
            if id(ref()) in blocks:  # a block of this attach (not one replaced since)
                self.cache._scope_modules.setdefault(s, ref())
        self._slow = copy.copy(state["slow"])
        self._make_plan(reason="kept", log=False)
        if self.infeasible is not None and self._slow.missed:  # kept after a miss (Note [Budget at a slower link])
            self._budget_at_measured_rates()
        elif self.infeasible is not None:  # another budget: the profile says so, as a first step does
            self.infeasible, self._profile_next = None, True
        self._retime_next = state["retime"]
        self._retimes_left = state["retimes_left"]
        self._timed_recomputes = set(state["timed_recomputes"])

    def _calibrate_temporaries(self, modules: list) -> None:
        """On a GPU: the last module's backward temporaries, what the
        profiling step's allocator peak held above the model's prediction of
        that step (Note [Backward profile]). The step kept every save
        resident, or with a budget offloaded every block but the kept last
        ones (Note [Budget profile]); the prediction places them so."""
        if not self._cuda:
            return
        measured = self.peak_allocated_bytes
        if measured is None:
            return
        options = self._planner_options(Budgets())
        placements = ["keep"] * len(modules)
        if self.budgets:
            tier = "offload_cpu" if options["host_budget_bytes"] else "offload_ssd"
            kept = options["keep_last_modules"]
            placements = [tier if i < len(modules) - kept else "keep" for i in range(len(modules))]
        ran = planner.simulate([{k: v for k, v in m.items() if k not in ("scope", "tail")} for m in modules],
                               placements, **options)
        _profile.last_module_temporaries(modules, measured, ran["peak_allocated_bytes"])

    # --------------------------------------------------------------- planning
    def predict(self, budgets: Budgets) -> dict:
        """The plan the last profile gives for other budgets, not applied."""
        if not self.profile_modules:
            raise RuntimeError("ebbtide.TensorCache.predict: no profiling step has run yet")
        return self._planned(budgets)

    def trace_run(self, name: str, measured: dict, kind: str = "offload") -> dict:
        """The last plan as a run of ebbtide.plan.replay's trace format: the
        profile, the planner settings and the decisions the cache ran with,
        and `measured` (``step_seconds``, ``peak_bytes``: the allocator's
        peak above the step's start, and whatever else the caller has)."""
        if not self.profile_modules or self.plan is None:
            raise RuntimeError("ebbtide.TensorCache.trace_run: no plan yet (profile a step first)")
        plan = self.plan
        options = self._planner_options(self.budgets)
        return dict(
            name=str(name), kind=kind,
            modules=[{k: v for k, v in m.items() if k not in ("scope", "tail")} for m in self.profile_modules],
            options=options, now_options=dict(options),
            ran=dict(placements=[planner.ran_placement(d) for d in plan["modules"]],
                     offload_limits=[self.limits.get(m["scope"]) if not m.get("tail") else None
                                     for m in self.profile_modules],
                     # Released by bytes at the plan's points: the model's own rule (no release_after).
                     lead_bytes=[int(d.get("lead_bytes", 0)) for d in plan["modules"]]),
            measured=dict(measured))

    def _planner_options(self, budgets: Budgets) -> dict:
        """The planner's settings for this cache: measured rates, its rules
        (ebbtide.plan.planner.plan_offload's keywords)."""
        ssd = self.measured.get("ssd", {})
        cpu = self.measured.get("cpu", {})
        has_cpu = "cpu" in self.measured
        cache = self.cache
        keep_last = cache.keep_last_modules if cache._model_ref is not None else 0
        if keep_last and any(m.get("tail") for m in self.profile_modules):
            keep_last += 1  # the tail module of Note [Budget profile] is kept with the last blocks
        host_budget = self.host_budget_bytes
        if cache.target == "cpu":  # host memory is the only tier: bounded by capacity_bytes alone
            host_budget = cache.capacity_bytes or (1 << 50)
        cuda = cache._on_cuda()
        activation, peak = budgets.for_planner(cuda)  # Note [Two budgets]
        return dict(
            write_bps=ssd.get("write_bps", 0.0), read_bps=ssd.get("read_bps", 0.0),
            target="auto", max_write_mbps=self.max_write_bps / 1e6 if self.max_write_bps else None,
            host_budget_bytes=host_budget if has_cpu else 0,
            host_write_bps=cpu.get("write_bps", 0.0), host_read_bps=cpu.get("read_bps", 0.0),
            keep_last_modules=keep_last, backward_factor=self.backward_factor,
            prefetch_modules=max(self.prefetch_modules, _CUDA_PREFETCH_MODULES) if cuda else self.prefetch_modules,
            replan_fraction=self.replan_fraction, writes_within_forward=cuda,
            guarded_writes=not cuda, activation_budget_bytes=activation, peak_budget_bytes=peak,
            # Note [Copy bound in the plan]: the device waits behind the bound
            # when a plan queues more; the plan counts that wait.
            copy_bound_bytes=cache._core.device_inflight_bytes if cuda else 0,
            partial_offload=cuda,
            # The cache's reload rules (Note [Reload lead] in
            # cpp/src/plan/step_model.cpp): a lead per module, the window
            # unbounded unless the user sized it, kept bytes in the prefetch
            # distance, a shared storage at its last saver's place, loads on
            # demand on the priority stream.
            window_bytes=0 if cache._auto_window else cache._window_bytes,
            lead_per_module=True, kept_in_distance=True, shared_at_last_user=True, priority_loads=True)

    def _planned(self, budgets: Budgets) -> dict:
        """The planner's answer for the profile and measurements at hand, within `budgets`."""
        plan = planner.plan_offload(
            [{k: v for k, v in m.items() if k not in ("scope", "tail")} for m in self.profile_modules],
            **self._planner_options(budgets))
        for m, d in zip(self.profile_modules, plan["modules"]):
            d["scope"] = m["scope"]
            d["forward_seconds"] = m["forward_seconds"]
        return plan

    def _make_plan(self, reason: str, log: bool = True) -> None:
        cache = self.cache
        plan = self._planned(self.budgets)
        decisions = {}
        limits = {}
        recompute = set()
        for m, d in zip(self.profile_modules, plan["modules"]):
            if m.get("tail"):
                continue  # its scope's placement is the last block's
            tier = _TIER_OF.get(d["tier"])
            decisions[m["scope"]] = (tier is not None, -1 if tier is None else tier)
            if tier is not None and 0 < d["offload_bytes"] < d["saved_bytes"]:
                limits[m["scope"]] = d["offload_bytes"]  # Note [Partial offload]
            if d["placement"].startswith("recompute"):
                recompute.add(m["scope"])
        self.recompute_scopes = recompute
        cache._set_recompute(recompute)
        self._guard(plan)
        self.infeasible = infeasible_message(self.budgets, plan, cache._on_cuda())
        if self.infeasible is None:
            self._slow.met()  # Note [Budget at a slower link]: no more probes
        # Note [Release points]: after block b, the offloaded bytes the step
        # model's copies have done by b's forward end (release_bytes, in copy
        # order); a scope's reload lead is its module's (the tail's scope is the
        # last block's: the block's module decides).
        self.release_bytes = {}
        self.leads = {}
        for m, d in zip(self.profile_modules, plan["modules"]):
            if m.get("tail"):
                continue
            self.release_bytes[m["scope"]] = int(d["release_bytes"])
            if d["tier"] is not None:
                self.leads[m["scope"]] = int(d["lead_bytes"])
        plan["reason"] = reason
        plan["backward_factor"] = self.backward_factor
        plan["measured"] = {k: dict(v) for k, v in self.measured.items()}
        self.plan = plan
        self.decisions = decisions
        self.limits = limits
        self.plans += 1
        if log:
            self._log_plan()

    def _guard(self, plan: Optional[dict]) -> None:
        """The store's in-flight bound for `plan` (Note [Budget guard] in ebbtide/cache/budget.py)."""
        bound = inflight_bound(plan, self.cache._max_inflight, self.cache._on_cuda())
        self.cache._core.set_max_inflight(bound)
        self.max_inflight_bytes = bound

    def _log_plan(self) -> None:
        logger.info("%s", plan_line(self.plan, self.max_write_bps))

    def stats(self) -> dict:
        p = self.plan
        return dict(
            profiled=self.last_profiled,
            planner=None if p is None else dict(p, modules=[dict(m) for m in p["modules"]]),
            predicted_stall_seconds=None if p is None else p["predicted_stall_seconds"],
            predicted_peak_bytes=None if p is None else p["peak_resident_bytes"],
            replans=self.replans,
            peak_allocated_bytes=self.peak_allocated_bytes,
            predicted_peak_allocated_bytes=None if p is None else p["peak_allocated_bytes"],
            max_inflight_bytes=self.max_inflight_bytes,
            measured_bandwidth={k: dict(v) for k, v in self.measured.items()},
        )


def cache_unscoped(cache) -> bool:
    return cache._model_ref is None


def tier_name(tier: int) -> Optional[str]:
    return _TIER_NAMES.get(tier)
