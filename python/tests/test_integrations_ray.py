"""Ray Train's TorchTrainer with 2 CPU workers (a data-parallel job over
gloo): each worker trains a tiny Llama for 3 optimizer steps with gradient
accumulation 2 without offloading and then with worker_cache(target="ssd") in
its own directory, and its parameters are bitwise those without offloading."""
import os
import sys

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

import integration_models  # noqa: E402
from integration_models import SEQ, local_ray, tiny_llama, token_rows  # noqa: E402

STEPS, ACCUMULATE, ROWS = 3, 2, 2


def _model():
    return tiny_llama()


def _train(rank, path=None):
    """3 optimizer steps of 2 micro-batches each of the worker's DDP model (rows differ per rank); under
    worker_cache in `path` when given."""
    import ray.train.torch

    from ebbtide.integrations.ray import worker_cache

    model = ray.train.torch.prepare_model(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cache = worker_cache(model, target="ssd", path=path, min_bytes=0, keep_last_modules=0) if path else None
    batches = token_rows(STEPS * ACCUMULATE * ROWS, seed=1 + rank).view(STEPS, ACCUMULATE, ROWS, SEQ)
    for micro_batches in batches:
        for ids in micro_batches:
            with cache.step() if cache is not None else torch.enable_grad():
                loss = model(input_ids=ids, labels=ids).loss / ACCUMULATE
                if cache is not None:
                    cache.drain()  # every store done before backward: offloaded bytes do not depend on timing
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    if cache is None:
        return params, None, None
    stats, paths = cache.stats(), cache.paths
    cache.close()
    return params, stats, paths


def _train_loop(config):
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    ref, _, _ = _train(rank)
    got, stats, paths = _train(rank, config["path"])
    torch.save(dict(ref=ref, got=got, steps=stats["steps"], bytes_offloaded=stats["total"]["bytes_offloaded"],
                    paths=paths), os.path.join(config["out"], f"rank{rank}.pt"))


def test_torch_trainer_two_workers_offload_in_their_own_directories(monkeypatch, tmp_path):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    root, out = tmp_path / "offload", tmp_path / "out"
    out.mkdir()
    with local_ray(monkeypatch, tmp_path / "results", by_value=[sys.modules[__name__], integration_models]):
        TorchTrainer(_train_loop, train_loop_config=dict(path=str(root), out=str(out)),
                     scaling_config=ScalingConfig(num_workers=2, use_gpu=False)).fit()
    results = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for rank, r in enumerate(results):
        diff = [n for n in r["ref"] if not torch.equal(r["ref"][n], r["got"][n])]
        assert not diff, f"worker {rank}: parameters differ from the run without offloading: {diff}"
        assert r["steps"] == STEPS * ACCUMULATE and r["bytes_offloaded"] > 0, (rank, r["steps"], r["bytes_offloaded"])
        assert r["paths"] == [str(root / f"rank{rank}")]
    assert not any(torch.equal(results[0]["ref"][n], _model().state_dict()[n]) for n in results[0]["ref"])
    assert sorted(os.listdir(root)) == ["rank0", "rank1"]
    assert [os.listdir(root / d) for d in ("rank0", "rank1")] == [[], []], "files left behind"


def test_worker_cache_outside_a_worker_raises():
    from ebbtide.integrations.ray import worker_cache

    with pytest.raises(RuntimeError, match="outside of a Ray Train training function"):
        worker_cache(_model(), target="ssd", path="/nonexistent/ebbtide")
