"""Ray Train: a TensorCache per worker, each in its own directory.

    from ebbtide.integrations.ray import worker_cache

    def train_loop(config):                       # run by TorchTrainer on every worker
        model = ray.train.torch.prepare_model(make_model())
        cache = worker_cache(model, target="ssd", path="/nvme/ebbtide")
        for batch in batches:
            with cache.step():
                loss_fn(model(batch)).backward()
            ...
        cache.close()

Ray Train runs the same training function in every worker process, placed
by a placement group, as torchrun runs a script per rank; nothing in the
cache changes. What a worker needs is its own directory when several
workers share a disk: ``worker_cache`` takes it from the worker's world
rank (``ray.train.get_context()``).
"""
from __future__ import annotations

import os

import torch

from ebbtide.integrations import require

_train = require("ray.train", "ray[train]", "ray", "ebbtide.integrations.ray")

__all__ = ["worker_cache", "worker_directory"]


def worker_directory(path) -> str:
    """``path/rank<world rank>`` of this Ray Train worker, created if missing.

    Raises:
        RuntimeError: not called inside a Ray Train worker's training function.
    """
    rank = _train.get_context().get_world_rank()
    directory = os.path.join(os.fspath(path), f"rank{rank}")
    os.makedirs(directory, exist_ok=True)
    return directory


def worker_cache(model: torch.nn.Module, target: str = "auto", path=None, **cache_kwargs):
    """A TensorCache for this Ray Train worker, attached to `model`, in its own directory.

    Call it inside the training function TorchTrainer runs, after
    ``ray.train.torch.prepare_model`` (a DDP wrapper is unwrapped: its
    forward calls the module's, whose blocks the cache scopes by).

    Args:
        model: the worker's model (or its DDP wrapper).
        target: the TensorCache target, "auto", "cpu" or "ssd".
        path: the directory every worker's own directory goes under
            (``path/rank<world rank>``, see worker_directory); None: the
            system's temporary directory, shared (the slab files have no
            name, so workers never collide there).
        **cache_kwargs: further TensorCache arguments.

    Returns:
        The TensorCache (close it when training ends).

    Raises:
        RuntimeError: not called inside a Ray Train worker's training function.

    Example:
        >>> cache = worker_cache(model, target="ssd", path="/nvme/ebbtide")   # /nvme/ebbtide/rank<R>
        >>> with cache.step():
        ...     loss_fn(model(batch)).backward()
    """
    from ebbtide.cache import TensorCache

    if path is not None and target != "cpu":
        path = worker_directory(path)
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return TensorCache(target=target, path=path, **cache_kwargs).attach(module)
