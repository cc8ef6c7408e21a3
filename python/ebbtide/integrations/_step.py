"""A TensorCache step opened and closed by two different framework callbacks."""
from __future__ import annotations

import sys
from typing import Optional

import torch

METRIC_PREFIX = "ebbtide/"


class StepMetrics:
    """Sums the per-step statistics of a TensorCache between two logging steps.

    ``add`` takes the dict of ``cache.stats()`` read after a step ended (the
    cache keeps it: no device sync, no core call); ``take`` returns the
    scalars a logger shows ("Logged metrics" in docs/integrations.md)
    and starts a new window.
    """

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self._offloaded = 0
        self._saved = 0
        self._stall = 0.0
        self._peak = 0
        self._planner = None

    def add(self, stats: dict) -> None:
        self.steps += 1
        self._offloaded += stats["bytes_offloaded"]
        self._saved += stats["saved_bytes_total"]
        self._stall += stats["stall_seconds"]
        self._peak = max(self._peak, stats["peak_resident_bytes"])
        self._planner = stats.get("planner")

    def take(self) -> dict:
        """The window's metrics, named ``ebbtide/...``; {} when no step ended since the last take."""
        if not self.steps:
            return {}
        # A store finished late counts in the next step (cache.stats()); the
        # clamp keeps a window that ends on such a step a fraction.
        fraction = min(1.0, self._offloaded / self._saved) if self._saved else 0.0
        out = {"bytes_offloaded": self._offloaded, "stall_seconds": self._stall,
               "peak_resident_bytes": self._peak, "offloaded_fraction": fraction}
        if self._planner is not None:  # adaptive: the plan in force at the window's last step
            modules = self._planner["modules"]
            kept = sum(m["placement"] == "keep" for m in modules)
            out.update(plan_kept_blocks=kept, plan_offloaded_blocks=len(modules) - kept,
                       plan_predicted_stall_seconds=self._planner["predicted_stall_seconds"])
        self._reset()
        return {METRIC_PREFIX + k: v for k, v in out.items()}


class CallbackStep:
    """Owns (or borrows) a TensorCache and one open ``step()`` at a time.

    Framework callbacks see the start and the end of a training step as two
    calls, never as one ``with`` block; this enters ``cache.step()`` in the
    first and leaves it in the second. Not thread-safe: begin and end must
    run on the training thread (saved-tensor hooks are thread-local).
    """

    def __init__(self, what: str, cache, target: str, path, cache_kwargs: dict):
        if cache is not None and (target != "auto" or path is not None or cache_kwargs):
            raise ValueError(f"{what}: pass either cache= or the TensorCache settings (target, path, ...), "
                             "not both")
        self.what = what
        self.cache = cache
        self._owned = cache is None
        self._settings = dict(target=target, path=path, **cache_kwargs)
        self._ctx = None
        self.metrics = StepMetrics()

    def open(self, model: Optional[torch.nn.Module]) -> None:
        """Creates the cache (unless one was given) and attaches it to `model` if it has no model yet."""
        if self.cache is None or self.cache.closed and self._owned:
            from ebbtide.cache import TensorCache

            self.cache = TensorCache(**self._settings)
        if model is not None and self.cache._model_ref is None:
            self.cache.attach(model)

    def begin(self) -> None:
        """Enters ``cache.step()``; a step left open (an earlier step raised) is aborted first."""
        if self.cache is None:
            raise RuntimeError(f"{self.what}: a training step began before training did (no cache yet)")
        if self._ctx is not None:
            self.end(RuntimeError(f"{self.what}: the previous step never ended"))
        ctx = self.cache.step()
        ctx.__enter__()
        self._ctx = ctx

    def end(self, exc: Optional[BaseException] = None) -> None:
        """Leaves the open step, if any; with `exc`, as if the step had raised it (its entries are released).
        A step that ends without `exc` adds its statistics to ``metrics``."""
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        if exc is None:
            ctx.__exit__(None, None, None)
            self.metrics.add(self.cache.stats())
        else:
            ctx.__exit__(type(exc), exc, exc.__traceback__)

    def close(self) -> None:
        """Ends an open step (as failed when an exception is being handled) and closes an owned cache."""
        self.end(sys.exc_info()[1])
        if self._owned and self.cache is not None:
            self.cache.close()
