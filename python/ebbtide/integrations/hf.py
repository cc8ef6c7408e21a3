"""Hugging Face Trainer, TRL trainers and Accelerate loops.

    from ebbtide.integrations.hf import OffloadCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[OffloadCallback(target="cpu")])
    trainer.train()

Note [Trainer step boundaries]: a TrainerCallback cannot wrap a call, but
``Trainer._inner_training_loop`` calls ``on_step_begin`` before the first
micro-batch of an optimizer step and ``on_pre_optimizer_step`` after the last
micro-batch's backward, on the training thread, with nothing but
``training_step`` (forward, loss, ``accelerator.backward``) in between. The
callback enters ``cache.step()`` in the first and leaves it in the second, so
one step of the cache spans a whole gradient-accumulation step, the way TRL
wraps ``training_step`` in its offloading context (a subclass would have to be
mixed into every trainer class; the callback works for ``Trainer`` and every
TRL trainer alike). Mixed precision (autocast) and gradient checkpointing run
inside ``training_step`` and nest inside the cache's hooks; checkpointed
blocks save only their inputs, so less is offloaded, never anything wrong.
Evaluation, logging and saving run after the optimizer step, outside.
"""
from __future__ import annotations

from ebbtide.integrations import require
from ebbtide.integrations._step import CallbackStep

_transformers = require("transformers", "transformers", "hf", "ebbtide.integrations.hf")

__all__ = ["OffloadCallback"]


class OffloadCallback(_transformers.TrainerCallback):
    """Offloads the activations of every training step of a ``transformers.Trainer`` (or TRL trainer).

    Args:
        target: the TensorCache target, "auto", "cpu" or "ssd".
        path: directory (or list of directories) for "ssd" and "auto".
        cache: an existing TensorCache to use instead (not closed at the end
            of training; attached to the trainer's model unless it already
            has a model).
        **cache_kwargs: further TensorCache arguments (min_bytes,
            keep_last_modules, ...).

    Raises:
        ValueError: both `cache` and TensorCache settings are given.
        ImportError: transformers is not installed (at import).

    Example:
        >>> cb = OffloadCallback(target="ssd", path="/nvme/ebbtide")
        >>> Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
        >>> cb.cache.stats()["total"]["bytes_offloaded"]
    """

    def __init__(self, target: str = "auto", path=None, *, cache=None, **cache_kwargs):
        self._step = CallbackStep("ebbtide.integrations.hf.OffloadCallback", cache, target, path, cache_kwargs)

    @property
    def cache(self):
        """The TensorCache (None before training begins when none was given)."""
        return self._step.cache

    def close(self) -> None:
        """Ends a step left open by an exception out of ``train()`` (releasing its
        entries) and closes the cache unless it was given. Idempotent."""
        self._step.close()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._step.end(RuntimeError("a new training run began"))  # a step an exception left open
        self._step.open(model)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step.begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._step.end()

    def on_step_end(self, args, state, control, **kwargs):
        self._step.end()  # a no-op unless on_pre_optimizer_step was skipped

    def on_train_end(self, args, state, control, **kwargs):
        self._step.close()
