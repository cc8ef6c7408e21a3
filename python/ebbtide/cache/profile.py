"""What a profiling step measures beyond each block's forward time, for the
planner's step model (Note [Step model] in cpp/src/plan/step_model.cpp):
each module's backward time, the gradient bytes its backward makes, and
on a GPU the temporaries the allocator's peak holds above the model's.

Note [Backward profile]
The cache's block hooks mark each block's backward as it begins (the
gradient of the block's output arrives: the hook that starts its
prefetch). Backward visits the blocks in reverse, so block i's backward
runs from its mark to block i-1's, the last block's (with whatever follows
it in its scope: the head, the loss) from the forward's end to block
n-2's mark, and the first block's to the step's end. A module's gradient
bytes are its parameters' that have no gradient when the step begins (a
parameter holding one, as with gradient accumulation, allocates nothing);
the parameters outside the blocks count with the last module (the head,
the final norm, an embedding tied to the head) unless their name says
they embed (the first block then makes them as the backward ends). On a
GPU, the allocator's peak above the step's start (when the step raised
torch.cuda.max_memory_allocated) less the model's peak with every save
kept, which is what the profiling step ran, is the last module's backward
temporaries: the logits' gradients and the loss's.

Note [Re-timed profile]
The profiling step is a process's first step more often than not:
its kernels meet cold caches, autotuning and a growing allocator (on
the H200, 1.24 s against 0.11 s later), and on a GPU with a budget it
offloads. The first planned step may be disturbed too: its plan's
buffers are new (pinned host memory, the allocator's first blocks
of their sizes, a recompute's first kernels). The planned steps time
each module again, each one after a re-timed step that lowered the
kept total by more than 2% (or whose plan recomputes a block whose
recompute no step timed yet), at most 3 (profile.RETIMED_STEPS); on a
warm machine that is one. After the first, a step's forward and backward
times are merged only when they sum more than 2% below the kept ones
(retime's `first`). A module's time is the smallest measured
(whatever disturbs a step only adds to it: a device wait in a
backward span, the VM's other tenants), and a recomputable block's
recompute time moves with its forward, unless the plan recomputes
the block: then its recompute is timed as it runs in backward (a
forward that saves nothing for the cache: scaling the profiled time
over-predicted it), that time replaces the profile's and later
timings keep the smaller, and the block's backward is its backward
span less that recompute. When that changes any time (a recompute
timed as it runs may be longer than the profile said) the plan is
made again (reason "retime"), so that its prediction (stats(), the
trace) is of the times it keeps, with the step's SSD rates when those
too are far from the plan's: one plan, not two in a row. Kept times
with a plan made from others would make the trace replay a different
step than the cache predicted (seen in CI: 0.047 s replayed against
0.026 s predicted). As Note [Quiet re-plan], it is announced (and
counted in `replans`) when it places blocks differently.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["backward_seconds", "gradient_bytes", "AllocatorWindow", "last_module_temporaries", "retime",
           "RETIMED_STEPS", "SETTLED"]

# Note [Re-timed profile] above: at most this many
# planned steps time the blocks again, each one after a step whose times
# lowered the kept total by more than SETTLED (or whose plan recomputes a
# block no step has timed the recompute of).
RETIMED_STEPS = 3
SETTLED = 0.02


def backward_seconds(bmarks: list, forward_end, step_end, elapsed, tail: bool) -> dict:
    """{scope: seconds} of each block's backward (Note [Backward profile]).

    Args:
        bmarks: [(scope, point)] in the order backward reached the blocks.
        forward_end, step_end: points (host clocks or CUDA events).
        elapsed: f(a, b) -> seconds between two points.
        tail: the last block's scope also holds a kept tail (head and loss)
            that the planner plans apart: its backward is reported under
            the key "tail".
    """
    out: dict = {}
    if not bmarks:
        return out
    points = [(s, p) for s, p in bmarks]
    first_scope = points[0][0]
    if tail:
        out["tail"] = max(0.0, elapsed(forward_end, points[0][1]))
    else:
        points[0] = (first_scope, forward_end)
    for (scope, a), (_, b) in zip(points, points[1:]):
        out[scope] = out.get(scope, 0.0) + max(0.0, elapsed(a, b))
    last_scope, last = points[-1]
    out[last_scope] = out.get(last_scope, 0.0) + max(0.0, elapsed(last, step_end))
    return out


def retime(modules: list, times: dict, back: dict, recomputed: dict, timed: set, first: bool = True) -> tuple:
    """Merges one planned step's times into the profile's modules, in place
    (Note [Re-timed profile]); returns (total before, total after, whether
    any kept time changed), the totals of forward, backward and recompute
    seconds over the modules.

    Args:
        times: {scope: seconds} of each scope's forward in this step.
        back: {scope: seconds} of each block's backward span in this step.
        recomputed: {scope: seconds} of the recomputes this step ran.
        timed: scopes whose kept recompute time was timed as it ran (by an
            earlier re-timed step); updated.
        first: the first planned step's re-time, merged whatever its times.
            A later one's forward and backward times are merged only when
            their sum is more than SETTLED below the kept sum (a step still
            warming): the smallest of each module's noisy times over
            several steps sums below any one step's (on the CI VM, a
            keep-all plan was predicted at 0.945x its measured step).
            Recomputes no step timed yet are taken either way.
    """
    def total():
        return sum(m["forward_seconds"] + m.get("backward_seconds", 0.0) + m.get("recompute_seconds", 0.0)
                   for m in modules)

    def kept():
        return [(m["forward_seconds"], m.get("backward_seconds"), m.get("recompute_seconds")) for m in modules]

    def own_back(m):
        return max(back[m["scope"]] - recomputed.get(m["scope"], 0.0), 0.0)

    both = [m for m in modules if not m.get("tail") and m["scope"] in times and m["scope"] in back
            and "backward_seconds" in m]
    if not first and sum(times[m["scope"]] + own_back(m) for m in both) >= (1 - SETTLED) * sum(
            m["forward_seconds"] + m["backward_seconds"] for m in both):
        times, back = {}, {}
        recomputed = {s: v for s, v in recomputed.items() if s not in timed}
    before, times_before = total(), kept()
    for m in modules:
        if m.get("tail"):
            continue  # its forward is the block's scope less the block: not timed apart
        scope = m["scope"]
        if scope in recomputed:
            # A recompute timed as it runs replaces the profile's guess (it
            # may be longer); a later timing of it keeps the smaller.
            rec = recomputed[scope]
            m["recompute_seconds"] = min(m.get("recompute_seconds", rec), rec) if scope in timed else rec
            timed.add(scope)
        if scope in times:
            fwd = min(m["forward_seconds"], times[scope])
            if scope not in timed and m.get("recompute_seconds") and m["forward_seconds"] > 0:
                # The block's own time came from the same disturbed step:
                # it moves with its scope's (a recompute planned at the
                # profile's time read 1.18x the measured step).
                m["recompute_seconds"] *= fwd / m["forward_seconds"]
            m["forward_seconds"] = fwd
        if scope in back and "backward_seconds" in m:
            m["backward_seconds"] = min(m["backward_seconds"], own_back(m))
    return before, total(), kept() != times_before


def gradient_bytes(blocks: list, model: torch.nn.Module) -> tuple:
    """(before, [per block], after): the bytes of gradients each part's
    backward makes this step: parameters needing one and holding none."""
    def need(p):
        return p.requires_grad and p.grad is None

    seen = set()
    per = []
    for _, block in blocks:
        n = 0
        for p in block.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel() * p.element_size() if need(p) else 0
        per.append(n)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, torch.nn.Module) else set()
    before = after = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size() if need(p) else 0
        if id(p) not in head_ids and any(k in name for k in ("embed", "wte", "wpe")):
            before += n
        else:
            after += n
    return before, per, after


class AllocatorWindow:
    """The CUDA allocator's peak above a step's start, when the step raised
    the process's max_memory_allocated (read without a sync; None else)."""

    def __init__(self, device: Optional[torch.device]):
        self.device = device if device is not None and device.type == "cuda" else None
        if self.device is not None:
            self.start = torch.cuda.memory_allocated(self.device)
            self.max0 = torch.cuda.max_memory_allocated(self.device)

    def peak(self) -> Optional[int]:
        if self.device is None:
            return None
        now = torch.cuda.max_memory_allocated(self.device)
        return now - self.start if now > self.max0 else None


def last_module_temporaries(modules: list, measured_peak: Optional[int], predicted_peak: int) -> None:
    """Sets the last module's backward temporaries to what the measured peak
    holds above the model's (Note [Backward profile])."""
    if measured_peak is None or not modules:
        return
    modules[-1]["backward_temp_bytes"] = max(0, int(measured_peak) - int(predicted_peak))
