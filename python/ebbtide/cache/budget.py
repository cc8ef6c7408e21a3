"""A TensorCache's settings that the planner reads: the host tier, the SSD
write cap, and the two budgets (Note [Two budgets]); what a budget no plan
meets tells the user; the store's in-flight bound that guards a budget
(Note [Budget guard])."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ebbtide import _settings

__all__ = ["Budgets", "resolve_budgets", "resolve_settings", "fmt_bytes", "infeasible_message", "inflight_bound",
           "budget_missed_at_rates", "SlowLink", "ssd_view"]

_DEFAULT_HOST_FRACTION = 0.25  # of MemAvailable: auto's host tier when training on CUDA


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


@dataclass(frozen=True)
class Budgets:
    """Note [Two budgets]
    activation_budget_bytes bounds the step's peak of saved activations held
    in the training device's memory (stats()["peak_resident_bytes"]), as
    torch's activation_memory_budget does; memory_budget_bytes bounds the
    allocator's peak above the step's start (torch.cuda.max_memory_allocated
    less memory_allocated when the step begins: saved activations,
    gradients, temporaries; stats()["peak_allocated_bytes"]), which is what
    decides whether a GPU step fits. The planner predicts both (Note [Step
    model] in cpp/src/plan/step_model.cpp) and meets both when both are set.
    A CPU device has no allocator counter to hold the second to: there it
    bounds the resident saved bytes, as the first does (the smaller of the
    two when both are set)."""
    activation: int = 0
    memory: int = 0

    def __bool__(self) -> bool:
        return bool(self.activation or self.memory)

    def for_planner(self, cuda: bool) -> tuple:
        """(activation_budget_bytes, peak_budget_bytes) for the planner."""
        if cuda:
            return self.activation, self.memory
        either = [b for b in (self.activation, self.memory) if b]
        return (min(either) if either else 0), 0


def resolve_budgets(activation_budget_bytes, memory_budget_bytes, adaptive) -> Budgets:
    """The budgets from the arguments, then EBBTIDE_ACTIVATION_BUDGET and
    EBBTIDE_MEMORY_BUDGET (0: none); a budget needs the planner (adaptive)."""
    out = {}
    for key, var, arg in (("activation", "EBBTIDE_ACTIVATION_BUDGET", activation_budget_bytes),
                          ("memory", "EBBTIDE_MEMORY_BUDGET", memory_budget_bytes)):
        name = f"{key}_budget_bytes"
        value = int(_settings.resolve(var, arg, f"ebbtide.TensorCache: {name}") or 0)
        if value and adaptive is False:
            where = name if arg is not None else var
            raise ValueError(f"ebbtide.TensorCache: {where}={value} needs the planner, but adaptive=False "
                             "(leave adaptive unset or True)")
        out[key] = value
    return Budgets(**out)


def resolve_settings(target, cuda, adaptive, host_budget_bytes, max_write_mbps):
    """(max_write_bps, host_budget_bytes, adaptive) from arguments, then EBBTIDE_* variables."""
    explicit_cap = max_write_mbps is not None
    max_write_mbps = _settings.resolve("EBBTIDE_MAX_WRITE_MBPS", max_write_mbps,
                                       "ebbtide.TensorCache: max_write_mbps")
    if target == "cpu" and explicit_cap and max_write_mbps:
        raise ValueError("ebbtide.TensorCache: max_write_mbps caps SSD writes; target 'cpu' writes none "
                         "(use target 'auto' or 'ssd')")
    max_write_bps = float(max_write_mbps or 0) * 1e6 if target != "cpu" else 0.0
    host_budget_bytes = _settings.resolve("EBBTIDE_HOST_BUDGET", host_budget_bytes,
                                          "ebbtide.TensorCache: host_budget_bytes")
    if host_budget_bytes is None:
        # On CPU the activations already live in host memory: a host tier saves nothing.
        host_budget_bytes = int(_available_memory() * _DEFAULT_HOST_FRACTION) if cuda else 0
    host_budget = int(host_budget_bytes) if target == "auto" else 0
    adaptive = _settings.resolve("EBBTIDE_ADAPTIVE", adaptive, "ebbtide.TensorCache: adaptive")
    if adaptive is None:
        # On a GPU every target is planned (Note [Release points]): what
        # the link cannot copy during the forward stays resident.
        adaptive = target == "auto" or bool(cuda)
    return max_write_bps, host_budget, bool(adaptive)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def infeasible_message(budgets: Budgets, plan: dict, cuda: bool) -> Optional[str]:
    """The error of a plan that meets no budget given, naming the smallest
    reachable value of each it misses (None: the plan fits)."""
    if plan["feasible"]:
        return None
    shape = (f"{plan['modules_recomputed']} of {len(plan['modules'])} blocks recomputed, the rest offloaded "
             "where the links allow")
    missed = []
    if plan["min_budget_bytes"]:
        given = plan["activation_budget_bytes"]
        # On CPU the memory budget bounds the saved bytes too (Note [Two budgets]).
        memory = not cuda and budgets.memory == given and budgets.activation != given
        what, knob = (("memory budget", "memory_budget_bytes (EBBTIDE_MEMORY_BUDGET)") if memory else
                      ("activation budget", "activation_budget_bytes (EBBTIDE_ACTIVATION_BUDGET)"))
        missed.append((what, given, "peak of saved activations", plan["min_budget_bytes"], knob))
    if plan["min_peak_budget_bytes"]:
        missed.append(("memory budget", plan["peak_budget_bytes"], "allocator peak above the step's start",
                       plan["min_peak_budget_bytes"], "memory_budget_bytes (EBBTIDE_MEMORY_BUDGET)"))
    if not missed:
        return f"ebbtide: the budget cannot be met ({shape})"
    return "; ".join(
        f"ebbtide: {what} {fmt_bytes(given)} ({given} bytes) cannot be met: the smallest {peak} the planner "
        f"reaches for this model and batch is {fmt_bytes(low)} ({low} bytes; {shape}); raise {knob} to at "
        "least that, or lower the micro-batch or sequence length"
        for what, given, peak, low, knob in missed)


def budget_missed_at_rates(msg: str, plan: dict) -> str:
    """Note [Budget at a slower link]
    A budget no plan meets is refused at the first step (ValueError, with
    the smallest value the planner reaches): the model and batch need more.
    A plan remade later because a step measured slower SSD rates (Note
    [Quiet re-plan]) may miss the budget too: offloads that no longer end
    in time hold their bytes longer, into the backward's recomputes. That
    is the disk's moment more often than not (on the CI VM one step's
    writes ran at 10 MB/s against 1.5 GB/s before and after), and stopping
    the training for it would lose the run: the plan nearest the budget
    goes on, a WARNING says so (once until a plan meets the budget again),
    and faster rates re-plan. A plan that then moves nothing to the SSD
    measures no rate: the SSD's probe (8 MiB written and read back at a
    step's end) measures it instead, at the next step, then after 2, 4, ...
    steps, at most every 32, until a plan meets the budget again; the
    interval keeps growing over later misses (SlowLink). A kept plan
    (offload() across calls: each call a cache) carries this state, so a
    miss goes on across calls, said once. A re-timed step's plan (Note [Re-timed profile]) that
    misses the budget raises, as the first step's does, unless a slower
    link is why (rates taken at that step or a miss not yet over). On the host the store's bound
    on bytes in flight still holds the forward within the budget whenever
    the plan's kept bytes fit (Note [Budget guard])."""
    rates = f"SSD writes {plan['planned_write_bps'] / 1e6:.1f} MB/s, reads {plan['planned_read_bps'] / 1e6:.1f} MB/s"
    words = msg.removeprefix("ebbtide: ")
    return (f"ebbtide: at the SSD rates a step measured ({rates}), {words}. Training goes on with the plan nearest "
            "the budget and re-plans when the rates recover")


class SlowLink:
    """Note [Budget at a slower link]: whether the plan misses its budget at
    the SSD rates the steps measured, the warning said once, and when the
    SSD's probe is due while the plan moves nothing there."""

    MAX_EVERY = 32

    def __init__(self):
        self.missed = False
        self._said = False
        self._every = self._due_in = 1

    def miss(self, msg: str, plan: dict) -> Optional[str]:
        """The plan remade at measured rates misses the budget: the warning
        to log (None once said, until a plan meets the budget again)."""
        if not self.missed:
            # The interval grows across misses too: a link the probe finds
            # fast and the steps slow (the probe reads back what it has just
            # written) swaps plans ever more rarely.
            self.missed, self._due_in = True, self._every
        if self._said:
            return None
        self._said = True
        return budget_missed_at_rates(msg, plan)

    def met(self) -> None:
        self.missed = self._said = False

    def probe_due(self) -> bool:
        """Counts a step; True at the steps the probe runs (1, 2, 4, ... steps apart)."""
        if not self.missed:
            return False
        self._due_in -= 1
        if self._due_in > 0:
            return False
        self._every = min(2 * self._every, self.MAX_EVERY)
        self._due_in = self._every
        return True


def ssd_view(plan: dict) -> dict:
    """`plan` as the SSD rate checks see it: one that moves nothing to the
    SSD (its rates then the probe's, SlowLink) as if it did."""
    return plan if plan["bytes_ssd"] else dict(plan, bytes_ssd=1)


def inflight_bound(plan: Optional[dict], user_bound: int, cuda: bool) -> int:
    """Note [Budget guard]
    A budget plan's peak is predicted at the measured link rates (Note
    [Budget plan]). Its forward holds at most the bytes it keeps (kept and
    recomputed modules' saved bytes, and the fixed ones: K) plus the
    offloaded bytes whose writes have not ended. If writes run slower than
    measured, the latter grow; so on the worker path (host tensors) the
    core's save waits while more than budget - K bytes are waiting to be
    stored (Note [Store backpressure]): the forward never holds more than
    the budget, and a slow link costs stall instead of memory (the next
    step's measured rate then re-plans). It holds for a plan that misses the
    budget at a slower link's rates too (Note [Budget at a slower link]),
    whenever the bytes it keeps fit. A user's max_inflight_bytes still
    applies when smaller; without a budget plan it applies alone. On a GPU
    the release points order the frees after the copies (Note [Release
    points]) and the host never waits."""
    bound = user_bound
    if plan is not None and plan["activation_budget_bytes"] and not cuda:
        kept = sum(m["fixed_bytes"] + (m["saved_bytes"] if m["tier"] is None else 0) for m in plan["modules"])
        slack = plan["activation_budget_bytes"] - kept
        if slack > 0:
            bound = min(bound, slack) if bound else slack
    return int(bound)
