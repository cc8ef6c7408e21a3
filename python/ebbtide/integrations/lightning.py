"""PyTorch Lightning: a Callback that offloads every training batch.

    from ebbtide.integrations.lightning import OffloadCallback

    trainer = pl.Trainer(callbacks=[OffloadCallback(target="cpu")], accumulate_grad_batches=2)

Note [Lightning step boundaries]: Lightning runs forward (``training_step``),
``backward`` and, on the last batch of an accumulation, the optimizer step
all between ``on_train_batch_start`` and ``on_train_batch_end`` of that
batch, on the training thread, under automatic and manual optimization
alike. The callback holds one ``cache.step()`` over that span (one cache step
per batch: every batch's graph is freed by its own backward), and
``on_exception`` ends a step the exception left open, releasing its entries.

Note [Metrics in Lightning's loggers]: after the optimizer step of every
``log_every_n_steps``-th global step (the cadence of Lightning's own step
metrics), ``on_train_batch_end`` hands the ebbtide metrics of the batches
since the last log to each of ``trainer.loggers`` at ``trainer.global_step``,
the step the loss is logged at. They go to the loggers directly rather than
through ``pl_module.log``, which would store them as float32 tensors (byte
counts above 16 MiB rounded) and write them only when its own cadence agrees.
"""
from __future__ import annotations

from typing import Optional

from ebbtide.integrations import require
from ebbtide.integrations._step import CallbackStep

_pl = require("pytorch_lightning", "pytorch-lightning", "lightning", "ebbtide.integrations.lightning")

__all__ = ["OffloadCallback"]


class OffloadCallback(_pl.Callback):
    """Offloads the activations of every training batch of a ``pytorch_lightning.Trainer``.

    Every ``log_every_n_steps`` optimizer steps the trainer's loggers get
    ``ebbtide/bytes_offloaded``, ``ebbtide/stall_seconds``,
    ``ebbtide/peak_resident_bytes``, ``ebbtide/offloaded_fraction`` over the
    batches since the last log, and the plan's block counts when the cache is
    adaptive (docs/integrations.md, "Logged metrics").

    Args:
        target: the TensorCache target, "auto", "cpu" or "ssd".
        path: directory (or list of directories) for "ssd" and "auto".
        module: attribute path of the submodule to attach to (e.g. "model"),
            for a LightningModule whose training_step calls a submodule
            rather than ``self(...)``; None: the LightningModule itself.
        cache: an existing TensorCache to use instead (never closed here).
        **cache_kwargs: further TensorCache arguments.

    Raises:
        ValueError: both `cache` and TensorCache settings are given.
        AttributeError: `module` does not name a submodule (at fit start).
        ImportError: pytorch-lightning is not installed (at import).

    Example:
        >>> cb = OffloadCallback(target="cpu")
        >>> pl.Trainer(max_steps=100, callbacks=[cb]).fit(lit_module, loader)
        >>> cb.cache.stats()["total"]["bytes_offloaded"]
    """

    def __init__(self, target: str = "auto", path=None, *, module: Optional[str] = None, cache=None,
                 **cache_kwargs):
        self._module = module
        self._step = CallbackStep("ebbtide.integrations.lightning.OffloadCallback", cache, target, path,
                                  cache_kwargs)
        self._logged_step = None

    @property
    def cache(self):
        """The TensorCache (None before fit begins when none was given)."""
        return self._step.cache

    def on_fit_start(self, trainer, pl_module):
        target = pl_module
        for name in (self._module.split(".") if self._module else ()):
            if not hasattr(target, name):
                raise AttributeError(f"ebbtide.integrations.lightning.OffloadCallback: module={self._module!r}: "
                                     f"{type(target).__name__} has no attribute {name!r}")
            target = getattr(target, name)
        self._step.open(target)
        self._step.metrics.take()  # a new fit starts a new window
        self._logged_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step.begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._step.end()
        step = trainer.global_step  # Note [Metrics in Lightning's loggers]
        if step == self._logged_step or not trainer.log_every_n_steps or step % trainer.log_every_n_steps:
            return  # accumulating, or not a logging step
        self._logged_step = step
        metrics = self._step.metrics.take()
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def on_exception(self, trainer, pl_module, exception):
        self._step.end(exception)

    def on_fit_end(self, trainer, pl_module):
        self._step.close()
