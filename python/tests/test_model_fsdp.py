"""The model's per-GPU model state against FSDP2 (torch.distributed.fsdp.fully_shard)
on two gloo ranks on CPU: each rank sums the local shards of its parameters,
gradients and Adam moments (numel x element size) after one step; the model's
prediction for that config must match exactly. This file is also the rank
script: ``python test_model_fsdp.py <init-url> <out-prefix>``."""
import json
import os
import subprocess
import sys

import pytest

from ebbtide.plan import model

WORLD = 2
WIDTH, FFN, BLOCKS = 64, 128, 3  # every dim-0 divides by WORLD: FSDP2's shards are even, no padding


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors):
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _rank(rank, init, out):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, FFN), nn.ReLU(), nn.Linear(FFN, WIDTH))
                          for _ in range(BLOCKS)])
    params = sum(p.numel() for p in net.parameters())
    layer_params = sum(p.numel() for p in net[0].parameters())
    for block in net:
        fully_shard(block)
    fully_shard(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(8, WIDTH)).square().mean().backward()
    opt.step()
    moments = [v for state in opt.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
    measured = {
        "params": params, "layer_params": layer_params,
        "params_bytes": _nbytes(net.parameters()),
        "grads_bytes": _nbytes(p.grad for p in net.parameters()),
        "optimizer_bytes": _nbytes(moments),
        "moment_tensors": len(moments),
    }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(measured, f)
    dist.destroy_process_group()


def test_fsdp2_model_state_matches_the_model(tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="needs torch with FSDP2")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch built without gloo")
    out = tmp_path / "state"
    r = subprocess.run([sys.executable, os.path.abspath(__file__), f"file://{tmp_path}/init", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(WORLD):
        m = json.loads((tmp_path / f"state.{rank}").read_text())
        assert m["moment_tensors"] == 2 * 4 * BLOCKS  # two moments for each weight and bias
        # fp32 training: 4-byte parameters and gradients, Adam's two fp32 moments (K = 8).
        predicted = model.model_state(m["params"], layer_params=m["layer_params"], dp=WORLD, fsdp=True,
                                      param_bytes=4, grad_bytes=4, optimizer="adam-fp32")
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert predicted[key] == m[key], (rank, key, predicted[key], m[key])
        assert predicted["gathered_unit_bytes"] == 4 * m["layer_params"]


def test_plan_uses_the_same_state_as_model_state():
    config = dict(model.catalog_config("llama3-8b"), seq=4096)
    r = model.plan(config, dp=8, fsdp=True)
    state = model.model_state(r["params"], layer_params=r["layer_params"], root_params=r["root_params"], dp=8,
                              fsdp=True)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_unit_bytes", "prefetch_unit_bytes",
                "root_unit_bytes", "model_state_bytes"):
        assert r[key] == state[key], key


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(sys.argv[1], sys.argv[2]), nprocs=WORLD)
