"""torchtune: a drop-in for ``torchtune.training.get_act_offloading_ctx_manager``.

    from ebbtide.integrations.torchtune import get_act_offloading_ctx_manager

    ctx = get_act_offloading_ctx_manager(model, True, target="cpu")
    for batch in loader:
        with ctx:
            logits = model(batch["tokens"])
        loss = loss_fn(logits, batch["labels"])
        loss.backward()

torchtune's recipes build the context once (``self.activations_handling_ctx =
training.get_act_offloading_ctx_manager(self._model,
enable_activation_offloading)``) and enter it around each forward only;
backward runs after the block, as with torch's saved-tensor hooks. ``install()``
puts this function in torchtune.training's place, so an unchanged recipe
offloads through ebbtide when its config sets
``enable_activation_offloading: True``.

Note [torchtune forward-only blocks]: each ``with`` block is one cache step.
The pack hook is what the block scopes; unpack runs in the later backward
through the handles autograd holds, which stay valid after the step ends
(the entries live until autograd drops them). torchtune keeps its output
projection resident with a no-op context; keep_last_modules=1 (the default)
keeps the last decoder layer, the final norm and the output projection
resident here.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Union

import torch

from ebbtide.integrations import require
from ebbtide.integrations._step import StepMetrics

__all__ = ["OffloadActivations", "get_act_offloading_ctx_manager", "install", "log_metrics_to"]

_WHAT = "ebbtide.integrations.torchtune"
# The contexts whose metrics the wrapped metric loggers report (log_metrics_to).
_LIVE: "weakref.WeakSet[OffloadActivations]" = weakref.WeakSet()


class OffloadActivations:
    """A reusable context manager: each ``with`` block is one step of a TensorCache attached to `model`.

    Args:
        model: the model whose forward runs inside the block.
        target: the TensorCache target, "auto", "cpu" or "ssd".
        path: directory (or list of directories) for "ssd" and "auto".
        **cache_kwargs: further TensorCache arguments.

    Raises:
        RuntimeError: a block is entered inside another block of the same context.
    """

    def __init__(self, model: torch.nn.Module, target: str = "auto", path=None, **cache_kwargs):
        from ebbtide.cache import TensorCache

        self.cache = TensorCache(target=target, path=path, **cache_kwargs).attach(model)
        self._ctx = None
        self.metrics = StepMetrics()  # the blocks since the last metric log (log_metrics_to)
        _LIVE.add(self)

    def __enter__(self):
        ctx = self.cache.step()
        ctx.__enter__()
        self._ctx = ctx
        return self

    def __exit__(self, *exc):
        ctx, self._ctx = self._ctx, None
        out = ctx.__exit__(*exc)
        if exc[0] is None:
            self.metrics.add(self.cache.stats())
        return out

    def close(self) -> None:
        """Closes the cache (its files, memory and threads); the context is unusable afterwards."""
        self.cache.close()


def get_act_offloading_ctx_manager(model: torch.nn.Module, enable_activation_offloading: bool, *,
                                   target: str = "auto", path=None,
                                   **cache_kwargs) -> Union[OffloadActivations, contextlib.nullcontext]:
    """ebbtide's activation offloading context for `model`, or a null context when disabled.

    Args:
        model: the model to offload the activations of.
        enable_activation_offloading: False returns ``contextlib.nullcontext()``.
        target: the TensorCache target, "auto", "cpu" or "ssd".
        path: directory (or list of directories) for "ssd" and "auto".
        **cache_kwargs: further TensorCache arguments.

    Returns:
        An OffloadActivations (reusable, one cache step per ``with`` block) or a null context.

    Example:
        >>> ctx = get_act_offloading_ctx_manager(model, True, target="ssd", path="/nvme/ebbtide")
        >>> with ctx:
        ...     logits = model(tokens)
        >>> loss_fn(logits, labels).backward()
    """
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    return OffloadActivations(model, target=target, path=path, **cache_kwargs)


def install(target: str = "auto", path=None, *, force: bool = False, **cache_kwargs):
    """Makes ``torchtune.training.get_act_offloading_ctx_manager`` this module's, with these settings.

    Recipes look the function up on ``torchtune.training`` when they set up,
    so call this before the recipe's ``setup()``.

    Args:
        force: offload whatever the recipe's ``enable_activation_offloading``
            says (the switch, ebbtide.integrations.switch); False follows it.

    Returns:
        torchtune's own function, to put back with
        ``torchtune.training.get_act_offloading_ctx_manager = previous``.

    Raises:
        ImportError: torchtune is not installed.
    """
    training = require("torchtune.training", "torchtune", "torchtune", _WHAT)
    previous = training.get_act_offloading_ctx_manager

    def ebbtide_ctx_manager(model, enable_activation_offloading, *args, **kwargs):
        return get_act_offloading_ctx_manager(model, force or enable_activation_offloading, target=target,
                                              path=path, **cache_kwargs)

    training.get_act_offloading_ctx_manager = ebbtide_ctx_manager
    return previous


def log_metrics_to(metric_logging) -> None:
    """Adds the ``ebbtide/*`` metrics of the live OffloadActivations (since
    their last log) to every ``log_dict`` of the metric loggers in the module
    `metric_logging` (``torchtune.training.metric_logging``: the disk, stdout,
    TensorBoard, W&B, Comet and MLflow loggers recipes log through).
    Idempotent."""
    for cls in vars(metric_logging).values():
        log_dict = getattr(cls, "log_dict", None) if isinstance(cls, type) else None
        if log_dict is None or getattr(log_dict, "_ebbtide_metrics", False) or \
                getattr(log_dict, "__isabstractmethod__", False):
            continue

        def wrapped(self, payload, *args, _log_dict=log_dict, **kwargs):
            extra = {}
            for ctx in list(_LIVE):
                extra.update(ctx.metrics.take())
            return _log_dict(self, {**payload, **extra} if extra else payload, *args, **kwargs)

        functools.update_wrapper(wrapped, log_dict)
        wrapped._ebbtide_metrics = True
        cls.log_dict = wrapped
