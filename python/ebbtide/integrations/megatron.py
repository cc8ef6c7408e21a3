"""Megatron-core: one TensorCache for a rank's model chunks.

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from ebbtide.integrations.megatron import offload_megatron

    cache = offload_megatron(model, target="cpu")      # model: the rank's chunks, as get_model returns them
    forward_backward = get_forward_backward_func()
    for _ in range(steps):
        with cache.step():                             # one cache step per forward_backward call
            forward_backward(forward_step_func=..., data_iterator=..., model=model,
                             num_microbatches=..., seq_length=..., micro_batch_size=...)
        optimizer.step()
    cache.close()

Note [Megatron blocks]
The cache scopes by the decoder layers of every chunk a rank holds (virtual
pipeline stages included), numbered on across the chunks (attach_stages with
blocks: Note [Stages sharing a cache]); each chunk forward the schedule runs
starts a micro-batch record of its own, so no pipelining, 1F1B and the
interleaved schedule need no hints. Four things about Megatron's layers:
- TransformerBlock calls its layers with keyword arguments only. torch's
  checkpoint saves (and picks the devices whose RNG it preserves from) the
  positional arguments alone, so a pre-hook passes ``hidden_states``
  positionally: the cache can then recompute a layer and offload its input
  (recompute_offload).
- Attention dropout runs under Megatron's RNG tracker (``get_cuda_rng_tracker().fork()``),
  whose states checkpoint's preserve_rng_state does not cover. The cache's
  recompute stashes them in forward and restores them for the recompute
  (Note [Framework blocks] in ebbtide/cache/hooks.py), as Megatron's own
  CheckpointFunction does, so the recomputed masks are the forward's.
- Megatron's full recompute runs the layers without grad inside its
  reentrant CheckpointFunction, and its bias-dropout-add enables grad inside
  them (``bias_dropout_add_exec_handler``): those saves belong to a graph the
  checkpoint drops as it returns. While a layer runs without grad in a step,
  identity saved-tensor hooks sit inside the cache's, so the cache never
  takes (or offloads) them; the layer still opens its scope, and the
  checkpoint's saved inputs count there. Such layers are Megatron's to
  recompute, never the cache's; selective recompute leaves the layer to the
  cache's plan (Megatron's checkpoint nests inside the cache's).
- Fine-grained activation offloading (``fine_grained_activation_offloading``,
  ``--offload-modules``) pushes Megatron's own saved-tensor hooks around the
  modules it offloads; inner hooks take precedence, so what those modules
  save never reaches the cache, and the cache takes the rest: no tensor is
  handled twice. Megatron's hooks would take the saves of a recompute the
  cache ran, so with them the cache recomputes no layer (a budget is met by
  keeping and offloading what Megatron leaves). Megatron's layer-level
  ``cpu_offloading`` (Transformer Engine's hooks around whole layers) leaves
  nothing to the cache: refused.
"""
from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from ebbtide.integrations import require

__all__ = ["offload_megatron", "megatron_chunks", "megatron_offload_modules"]

_WHAT = "ebbtide.integrations.megatron"
logger = logging.getLogger("ebbtide")


def megatron_chunks(model) -> list:
    """The Megatron-core model chunks inside `model` (one module or the
    rank's list of chunks), each unwrapped from DistributedDataParallel,
    Float16Module and the like down to the module with ``decoder.layers``.

    Raises:
        TypeError: an element is not a Megatron-core language model.
    """
    chunks = list(model) if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [model]
    out = []
    for chunk in chunks:
        m = chunk
        for _ in range(8):
            decoder = getattr(m, "decoder", None)
            if decoder is not None and hasattr(decoder, "layers"):
                break
            m = getattr(m, "module", None)
            if m is None:
                break
        if m is None or getattr(getattr(m, "decoder", None), "layers", None) is None:
            raise TypeError(f"{_WHAT}: {type(chunk).__name__} is not a Megatron-core model chunk (no decoder.layers "
                            "in it or in the modules its .module wrappers hold)")
        out.append(m)
    if not out:
        raise ValueError(f"{_WHAT}: no model chunks given")
    return out


def megatron_offload_modules(chunks) -> list:
    """The modules Megatron's fine-grained activation offloading takes in
    `chunks` (``config.offload_modules`` when
    ``config.fine_grained_activation_offloading`` is on), else []."""
    names: list = []
    for c in megatron_chunks(chunks):
        config = getattr(c, "config", None)
        if config is not None and getattr(config, "fine_grained_activation_offloading", False):
            names += [n for n in (getattr(config, "offload_modules", None) or []) if n not in names]
    return names


def offload_megatron(model, target: str = "auto", path=None, *, cache=None, **cache_kwargs):
    """Offloads the activations of a Megatron-core model's chunks on this rank.

    Attaches a TensorCache to the chunks' decoder layers (Note [Megatron
    blocks]): keep, offload and, with ``activation_budget_bytes``,
    recompute per layer. Run each ``forward_backward_func`` call inside
    ``cache.step()``; Megatron's DistributedDataParallel and
    ``finalize_model_grads`` work unchanged.

    Args:
        model: the rank's model chunks (the list ``get_model`` returns, or one chunk).
        target: the TensorCache target, "auto", "cpu" or "ssd".
        path: directory (or list of directories) for "ssd" and "auto".
        cache: an existing TensorCache attached to no model, to use instead.
        **cache_kwargs: further TensorCache arguments (``activation_budget_bytes``, ...).

    Returns:
        The TensorCache (close it when training ends).

    Raises:
        ImportError: megatron-core is not installed.
        TypeError: `model` holds something other than Megatron-core model chunks.
        RuntimeError: ``config.cpu_offloading`` (``--cpu-offloading``) is on, or `cache` is attached already.

    Example:
        >>> cache = offload_megatron(model, target="cpu", activation_budget_bytes=20 << 30)
        >>> with cache.step():
        ...     forward_backward(forward_step_func=step, data_iterator=data, model=model,
        ...                      num_microbatches=8, seq_length=4096, micro_batch_size=1)
    """
    tracker_module = require("megatron.core.tensor_parallel.random", "megatron-core", "megatron", _WHAT)
    chunks = megatron_chunks(model)
    for c in chunks:
        if getattr(getattr(c, "config", None), "cpu_offloading", False):
            raise RuntimeError(
                f"{_WHAT}.offload_megatron: config.cpu_offloading (--cpu-offloading) is on: Megatron's layer-level "
                "offloading wraps every layer in Transformer Engine's saved-tensor hooks, which take all the "
                "layer's saves and leave ebbtide nothing; turn it off (fine_grained_activation_offloading with "
                "--offload-modules can stay on beside ebbtide)")
    if cache is None:
        from ebbtide.cache import TensorCache

        cache = TensorCache(target=target, path=path, **cache_kwargs)
    if cache._model_ref is not None:
        raise RuntimeError(f"{_WHAT}.offload_megatron: the cache is attached to a model already; detach() it first")
    blocks = []
    for i, c in enumerate(chunks):
        blocks.append([(_layer_name(i, j, layer), layer) for j, layer in enumerate(c.decoder.layers)])
    cache.attach_stages(chunks, blocks=blocks)
    # Note [Framework blocks] in ebbtide/cache/hooks.py.
    cache._checkpoint_context_fn = _rng_tracker_context(tracker_module)
    cache._scope_without_grad = True
    megatron_offloads = megatron_offload_modules(chunks)
    cache._recompute_blocks = not megatron_offloads
    if megatron_offloads:
        logger.info("ebbtide: Megatron's fine-grained activation offloading takes what %s save; the cache takes "
                    "the rest and recomputes no layer (Note [Megatron blocks])", ", ".join(megatron_offloads))
    ref = weakref.ref(cache)
    for per_chunk in blocks:
        for _, layer in per_chunk:
            pre, post = _layer_hooks(ref)
            # First among the layer's pre-hooks: the cache's block hook then
            # sees hidden_states positionally and the pass-through hooks in place.
            cache._hooks.append(layer.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
            cache._hooks.append(layer.register_forward_hook(post, always_call=True))
    return cache


def _layer_name(chunk: int, index: int, layer) -> str:
    number = getattr(layer, "layer_number", None)  # 1-based across the pipeline
    return f"layers.{number - 1}" if isinstance(number, int) else f"chunk{chunk}.layers.{index}"


def _same(t):
    return t


def _layer_hooks(cache_ref):
    """A layer's pre- and post-hook (Note [Megatron blocks]): hidden_states
    positionally, and identity saved-tensor hooks while it runs without grad in a step."""
    passing: list = []  # one entry per forward in flight: the pass-through hooks, or None

    def pre(module, args, kwargs):
        if not args and "hidden_states" in kwargs:
            kwargs = dict(kwargs)
            args = (kwargs.pop("hidden_states"),)
        cache = cache_ref()
        hooks = None
        if (cache is not None and cache._in_step and not torch.is_grad_enabled()
                and torch._C._current_graph_task_id() == -1):
            hooks = torch.autograd.graph.saved_tensors_hooks(_same, _same)
            hooks.__enter__()
        passing.append(hooks)
        return args, kwargs

    def post(module, args, output):
        hooks = passing.pop() if passing else None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    return pre, post


def _rng_tracker_context(tracker_module):
    """torch checkpoint's context_fn for the cache's recompute: Megatron's RNG
    tracker states as the forward began, back for the recompute."""
    def context_fn():
        stash: dict = {}

        @contextlib.contextmanager
        def forward():
            stash.update(_copy_states(tracker_module.get_cuda_rng_tracker().get_states()))
            yield

        @contextlib.contextmanager
        def recompute():
            tracker = tracker_module.get_cuda_rng_tracker()
            current = tracker.get_states()
            tracker.set_states(_copy_states(stash))
            try:
                yield
            finally:
                tracker.set_states(current)

        return forward(), recompute()

    return context_fn


def _copy_states(states: dict) -> dict:
    out = {}
    for name, state in states.items():
        if isinstance(state, torch.Tensor):
            out[name] = state.clone()
        elif isinstance(state, torch.Generator):
            out[name] = state.clone_state()  # graph-safe trackers keep generators
        else:
            out[name] = state
    return out
