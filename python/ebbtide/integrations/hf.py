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

Note [Metrics in the Trainer's logs]: ``Trainer.log`` appends a copy of the
logs to ``state.log_history`` and only then calls ``on_log``, and the
reporting callbacks (W&B, TensorBoard, MLflow, ...) come before the user's
in the callback list: keys added to ``logs`` in ``on_log`` would reach
neither. So ``on_train_begin`` finds the Trainer that calls it (up the call
stack: a callback is never handed its trainer) and wraps that instance's
``log``; the wrapper adds the ebbtide metrics to the first logs after a step
whose ``control.should_log`` was set (the periodic training logs, built in
``_maybe_log_save_evaluate``), before ``log_history`` and every reporting
callback see them. A subclass's own ``log`` (TRL's) runs inside the wrapper.
Without a Trainer up the stack (the callback driven by hand), ``on_log``
adds them to ``logs`` and to the last ``log_history`` entry instead.
"""
from __future__ import annotations

import sys

from ebbtide.integrations import require
from ebbtide.integrations._step import CallbackStep

_transformers = require("transformers", "transformers", "hf", "ebbtide.integrations.hf")

__all__ = ["OffloadCallback"]


class OffloadCallback(_transformers.TrainerCallback):
    """Offloads the activations of every training step of a ``transformers.Trainer`` (or TRL trainer).

    At each logging step the Trainer's logs (``state.log_history`` and every
    ``report_to`` integration) get ``ebbtide/bytes_offloaded``,
    ``ebbtide/stall_seconds``, ``ebbtide/peak_resident_bytes``,
    ``ebbtide/offloaded_fraction`` over the steps since the last log, and the
    plan's block counts when the cache is adaptive (docs/integrations.md,
    "Logged metrics").

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
        self._log_due = False
        self._trainer_log_wrapped = False

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
        self._step.metrics.take()  # a new run starts a new window
        self._log_due = False
        self._trainer_log_wrapped = self._wrap_trainer_log()

    def _wrap_trainer_log(self) -> bool:
        """Wraps ``log`` of the Trainer whose callback handler calls this one
        (Note [Metrics in the Trainer's logs]); False when none is found."""
        frame = sys._getframe(1)
        for _ in range(8):  # handler.call_event, handler.on_train_begin, Trainer._inner_training_loop
            if frame is None:
                return False
            trainer = frame.f_locals.get("self")
            if isinstance(trainer, _transformers.Trainer) and self in trainer.callback_handler.callbacks:
                break
            frame = frame.f_back
        else:
            return False
        if getattr(trainer.log, "_ebbtide_callback", None) is self:
            return True  # a second train() of the same trainer
        inner = trainer.log

        def log(logs, *args, **kwargs):
            if self._log_due:
                self._log_due = False
                logs.update(self._step.metrics.take())
            return inner(logs, *args, **kwargs)

        log._ebbtide_callback = self
        trainer.log = log
        return True

    def on_step_begin(self, args, state, control, **kwargs):
        self._step.begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._step.end()

    def on_step_end(self, args, state, control, **kwargs):
        self._step.end()  # a no-op unless on_pre_optimizer_step was skipped
        # DefaultFlowCallback, called before the user's callbacks, has decided by now.
        self._log_due = self._log_due or control.should_log

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._log_due and not self._trainer_log_wrapped and logs is not None:
            self._log_due = False
            metrics = self._step.metrics.take()
            logs.update(metrics)
            if state.log_history:
                state.log_history[-1].update(metrics)

    def on_train_end(self, args, state, control, **kwargs):
        self._step.close()
