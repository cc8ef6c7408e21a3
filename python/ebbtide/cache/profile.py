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
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["backward_seconds", "gradient_bytes", "AllocatorWindow", "last_module_temporaries"]


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
