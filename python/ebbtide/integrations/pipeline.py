"""Micro-batch and phase hints for pipeline schedules (DeepSpeed's pipeline engine).

    import deepspeed
    from ebbtide.integrations.pipeline import offload_deepspeed_pipeline

    engine, *_ = deepspeed.initialize(model=pipeline_module, config=ds_config, ...)
    cache = offload_deepspeed_pipeline(engine, target="cpu")
    for _ in range(steps):
        engine.train_batch(data_iter)      # one cache step per call

Note [Pipeline hints]: a pipeline stage runs several forwards before their
backwards (1F1B: up to the number of stages). The cache tells micro-batches
apart by the forward that made them; a ``BackwardPass`` names only a pipe
buffer, reused by a later micro-batch. ``PipelineHints`` gives each forward a
fresh micro-batch id (``cache.microbatch``), remembers it per buffer, and on
the buffer's backward names that micro-batch again and says
``cache.phase("backward")``, which starts prefetching it before the first
gradient arrives. Without hints the block backward hooks still prefetch the
right micro-batch, only later.

torch.distributed.pipelining's single-stage schedules (``ScheduleGPipe``,
``Schedule1F1B``) work without hints (each stage forward is a forward of the
attached root module, which starts a micro-batch record); with
``hint_torch_pipeline_stage`` a backward starts prefetching its micro-batch
before its first gradient arrives. Multi-stage schedules (interleaved 1F1B,
zero bubble) share one cache among the rank's stages:
``hint_torch_pipeline_stages`` (Note [Stages sharing a cache] in ebbtide/cache/tensor_cache.py).
"""
from __future__ import annotations

import weakref
from typing import Hashable

from ebbtide.integrations import require

__all__ = ["PipelineHints", "hint_torch_pipeline_stage", "hint_torch_pipeline_stages", "hinted_instruction_map",
           "offload_deepspeed_pipeline", "restore_deepspeed_pipeline"]

_WHAT = "ebbtide.integrations.pipeline"


class PipelineHints:
    """Turns a stage's forward and backward instructions into TensorCache hints.

    Args:
        cache: the stage's TensorCache (attached to the stage module).

    Example:
        >>> hints = PipelineHints(cache)
        >>> hints.forward(buffer_id); stage(x)           # a ForwardPass
        >>> hints.backward(buffer_id); out.backward(g)   # its BackwardPass
    """

    def __init__(self, cache):
        self.cache = cache
        self._by_key: dict = {}

    def forward(self, key: Hashable) -> int:
        """A forward into buffer `key` begins; returns the micro-batch id it gets."""
        mb = self.cache._next_mb  # the next id the cache has not used (ids keep counting across steps)
        self.cache.microbatch(mb)
        self.cache.phase("forward")
        self._by_key[key] = mb
        return mb

    def backward(self, key: Hashable) -> int:
        """The backward of the micro-batch in buffer `key` begins; returns its id.

        Raises:
            RuntimeError: no forward into `key` was hinted.
        """
        mb = self._by_key.get(key)
        if mb is None:
            raise RuntimeError(f"{_WHAT}.PipelineHints.backward: no forward into buffer {key!r} was hinted "
                               f"(hinted buffers: {sorted(self._by_key, key=repr)})")
        self.cache.microbatch(mb)
        self.cache.phase("backward")
        return mb


def hinted_instruction_map(instruction_map: dict, hints: PipelineHints) -> dict:
    """A copy of a DeepSpeed PipelineEngine ``_INSTRUCTION_MAP`` whose ForwardPass
    and BackwardPass methods give `hints` first.

    Raises:
        ImportError: deepspeed is not installed.
        KeyError: the map has no ForwardPass or BackwardPass entry.
    """
    schedule = require("deepspeed.runtime.pipe.schedule", "deepspeed", "deepspeed", _WHAT)
    out = dict(instruction_map)
    fwd = out[schedule.ForwardPass]
    bwd = out[schedule.BackwardPass]

    def forward_pass(engine, buffer_id, **kwargs):
        hints.forward(buffer_id)
        return fwd(engine, buffer_id=buffer_id, **kwargs)

    def backward_pass(engine, buffer_id, **kwargs):
        hints.backward(buffer_id)
        return bwd(engine, buffer_id=buffer_id, **kwargs)

    out[schedule.ForwardPass] = forward_pass
    out[schedule.BackwardPass] = backward_pass
    return out


def offload_deepspeed_pipeline(engine, target: str = "auto", path=None, *, cache=None, **cache_kwargs):
    """Offloads the activations of a DeepSpeed ``PipelineEngine``'s stage, with schedule hints.

    Attaches a TensorCache to ``engine.module`` (the stage's PipelineModule),
    makes every ``engine.train_batch`` one cache step and gives the cache the
    micro-batch and phase of each ForwardPass and BackwardPass instruction.

    Args:
        engine: the PipelineEngine ``deepspeed.initialize`` returned.
        target: the TensorCache target, "auto", "cpu" or "ssd".
        path: directory (or list of directories) for "ssd" and "auto".
        cache: an existing TensorCache to use instead (attached unless it has a model).
        **cache_kwargs: further TensorCache arguments.

    Returns:
        The TensorCache (close it when training ends).

    Raises:
        ImportError: deepspeed is not installed.
        TypeError: `engine` has no pipeline instruction map (not a PipelineEngine).
    """
    if not hasattr(engine, "_INSTRUCTION_MAP") or not hasattr(engine, "train_batch"):
        raise TypeError(f"{_WHAT}.offload_deepspeed_pipeline: {type(engine).__name__} is not a DeepSpeed "
                        "PipelineEngine (no _INSTRUCTION_MAP / train_batch)")
    if cache is None:
        from ebbtide.cache import TensorCache

        cache = TensorCache(target=target, path=path, **cache_kwargs)
    if cache._model_ref is None:
        cache.attach(engine.module)
    if "_ebbtide_saved" in vars(engine):
        raise RuntimeError(f"{_WHAT}.offload_deepspeed_pipeline: the engine already offloads; "
                           "restore_deepspeed_pipeline(engine) first")
    hints = PipelineHints(cache)
    own = vars(engine)
    saved = {name: own[name] for name in ("_INSTRUCTION_MAP", "train_batch") if name in own}
    engine._INSTRUCTION_MAP = hinted_instruction_map(engine._INSTRUCTION_MAP, hints)
    train_batch = engine.train_batch

    def train_batch_offloaded(*args, **kwargs):
        with cache.step():
            return train_batch(*args, **kwargs)

    engine.train_batch = train_batch_offloaded
    engine._ebbtide_saved = saved
    return cache


def restore_deepspeed_pipeline(engine) -> None:
    """Undoes ``offload_deepspeed_pipeline``: the engine's own instruction map
    and ``train_batch`` again, and no reference to the cache left on the
    engine (DeepSpeed engines live as long as their parameters' hooks, often
    to the end of the process). Does not close the cache. Idempotent."""
    saved = vars(engine).pop("_ebbtide_saved", None)
    if saved is None:
        return
    for name in ("_INSTRUCTION_MAP", "train_batch"):
        if name in saved:
            setattr(engine, name, saved[name])
        else:
            vars(engine).pop(name, None)


def hint_torch_pipeline_stage(stage, cache) -> PipelineHints:
    """Gives `cache` the hints of a ``torch.distributed.pipelining`` stage's schedule.

    Wraps the stage's ``forward_one_chunk`` and ``backward_one_chunk`` (the
    calls every schedule makes per micro-batch) so each gives hints first,
    keyed by the schedule's micro-batch index. Attach `cache` to the stage's
    module and wrap ``schedule.step(...)`` in ``cache.step()``.

    Args:
        stage: a ``torch.distributed.pipelining.PipelineStage`` (one per rank).
        cache: the TensorCache attached to the stage's module.

    Returns:
        The PipelineHints in use.

    Raises:
        TypeError: `stage` has no forward_one_chunk / backward_one_chunk.
    """
    _check_stage(stage, "hint_torch_pipeline_stage")
    hints = PipelineHints(cache)
    _hint_chunks(stage, hints, lambda chunk: chunk)
    return hints


def _check_stage(stage, what):
    if not (hasattr(stage, "forward_one_chunk") and hasattr(stage, "backward_one_chunk")):
        raise TypeError(f"{_WHAT}.{what}: {type(stage).__name__} is not a torch.distributed.pipelining stage "
                        "(no forward_one_chunk / backward_one_chunk)")


def _hint_chunks(stage, hints, key):
    """Wraps the stage's per-micro-batch calls so each gives `hints` first, keyed by ``key(chunk id)``.
    A zero-bubble schedule's weight backward (``backward_weight_one_chunk``) names its micro-batch again."""
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        hints.forward(key(fwd_chunk_id))
        return fwd(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
        hints.backward(key(bwd_chunk_id))
        return bwd(bwd_chunk_id, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    bwd_weight = getattr(stage, "backward_weight_one_chunk", None)
    if bwd_weight is not None:
        def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):
            hints.backward(key(bwd_chunk_id))
            return bwd_weight(bwd_chunk_id, *args, **kwargs)

        stage.backward_weight_one_chunk = backward_weight_one_chunk


def hint_torch_pipeline_stages(stages, cache) -> PipelineHints:
    """One TensorCache for all of a rank's ``torch.distributed.pipelining`` stages, with their schedule's hints.

    For the schedules that run several stages per rank
    (``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
    ``ScheduleZBVZeroBubble``, ``ScheduleLoopedBFS``, ...). Attaches `cache`
    to a ``ModuleList`` of the stages' modules (each stage is one scoped
    block, numbered in the order given), makes every stage forward start a
    micro-batch record of its own, and wraps each stage's
    ``forward_one_chunk``, ``backward_one_chunk`` and
    ``backward_weight_one_chunk`` so each gives hints first, keyed by
    (stage index, micro-batch). Wrap ``schedule.step(...)`` in ``cache.step()``.
    ``keep_last_modules=k`` keeps the activations of the last k stages given
    resident (Note [Stages sharing a cache] in ebbtide/cache/tensor_cache.py).

    Args:
        stages: the rank's pipeline stages, first to last.
        cache: a TensorCache attached to no model.

    Returns:
        The PipelineHints in use.

    Raises:
        TypeError: an element of `stages` is not a pipelining stage.
        RuntimeError: `cache` is already attached to a model.

    Example:
        >>> cache = ebbtide.TensorCache(target="cpu")
        >>> hint_torch_pipeline_stages(stages, cache)
        >>> schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)
        >>> with cache.step():
        ...     schedule.step(x, target=y)
    """
    stages = list(stages)
    for stage in stages:
        _check_stage(stage, "hint_torch_pipeline_stages")
    cache.attach_stages([stage.submod for stage in stages])
    hints = PipelineHints(cache)
    for stage in stages:
        _hint_chunks(stage, hints, lambda chunk, _i=stage.stage_index: (_i, chunk))
    return hints


