"""A TensorCache step opened and closed by two different framework callbacks."""
from __future__ import annotations

import sys
from typing import Optional

import torch


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
        """Leaves the open step, if any; with `exc`, as if the step had raised it (its entries are released)."""
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        if exc is None:
            ctx.__exit__(None, None, None)
        else:
            ctx.__exit__(type(exc), exc, exc.__traceback__)

    def close(self) -> None:
        """Ends an open step (as failed when an exception is being handled) and closes an owned cache."""
        self.end(sys.exc_info()[1])
        if self._owned and self.cache is not None:
            self.cache.close()
