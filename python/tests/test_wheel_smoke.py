"""What an installed ebbtide must do wherever it is installed from: here
against the developer build, and in test_wheel.py against the repaired wheel
in a fresh virtual environment (docs/packaging.md)."""
import json
import os
import subprocess
import sys

import torch

import ebbtide
from ebbtide import _core, _torch
from ebbtide import checkpoint as ckpt


def test_the_build_has_its_fast_paths_and_the_hooks_for_this_torch():
    assert _core.build_info["liburing"] and _core.build_info["zstd"], _core.build_info
    assert _torch.TORCH_VERSION == torch.__version__


def _step(model, x, cache=None):
    model.zero_grad(set_to_none=True)
    with cache.step() if cache is not None else torch.enable_grad():
        loss = model(x).square().mean()
        if cache is not None:
            cache.drain()  # every store done before backward: the reloads come from the files
        loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def test_an_offloaded_step_is_bitwise_equal_to_no_offload(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                  for _ in range(4)], torch.nn.Linear(64, 1))
    x = torch.randn(32, 64)
    ref = _step(model, x)
    cache = ebbtide.TensorCache(target="ssd", path=str(tmp_path), min_bytes=0, keep_last_modules=0)
    try:
        cache.attach(model)
        got = _step(model, x, cache)
        offloaded = cache.stats()["bytes_offloaded"]
    finally:
        cache.close()
    assert offloaded > 0
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(ref, got))


def test_a_compressed_checkpoint_round_trips(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(256, 512, generator=g), "ids": torch.arange(4096), "half": torch.ones(999).half()}
    info = ckpt.save(state, tmp_path / "c", compress="lossless")
    out = ckpt.load(tmp_path / "c")
    assert set(out) == set(state)
    for k, v in state.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    assert info["stored_bytes"] < info["raw_bytes"]  # zstd did compress


def test_bench_io_runs_on_io_uring(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ebbtide", "bench", "io", "--dir", str(tmp_path), "--size", "16MiB",
                           "--chunk", "1MiB", "--qd", "4", "--backend", "uring", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["backend"] == "uring" and r["verified"] is True, r
    assert r["write_gbps"] > 0 and r["read_gbps"] > 0


def test_the_command_and_the_switch_are_installed():
    out = subprocess.run([sys.executable, "-m", "ebbtide", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"ebbtide {ebbtide.__version__}", out
    # ebbtide-switch.pth in site-packages: EBBTIDE_OFFLOAD hooks every Python of the environment at start.
    code = "import sys; print('ebbtide.integrations.switch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EBBTIDE_OFFLOAD")}
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env=dict(env, EBBTIDE_OFFLOAD="cpu"))
    assert (off.stdout.strip(), on.stdout.strip()) == ("False", "True"), (off, on)
