"""torchtune's OffloadActivations (the benchmark's torchtune row) loads the way
the lent GPU machine loads it: torchtune's wheel unpacked without its
dependencies (scripts/device_deps.sh, scripts/gpu_check.sh), torchao absent.
torchtune's package __init__ then fails (it imports torchao, HF datasets,
torchdata, ...), and ebbtide.harness.methods.load_torchtune_offload loads
torchtune/training/_activation_offloading.py by file, with a stand-in for
the one torchao name it uses. Here that machine is simulated in a fresh
Python: torchtune's package copied to a folder on PYTHONPATH (the unpacked
wheel) and an import blocker for torchao and the dependencies the machine
lacks. The CUDA test runs the loaded class for real (skipped without CUDA)."""
import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from ebbtide.harness.methods import load_torchtune_offload

# What the device lacks: torchao and torchtune's data-side dependencies
# (the bench needs transformers, so huggingface_hub, safetensors and
# tokenizers are there).
BLOCKED = ("torchao", "datasets", "torchdata", "omegaconf", "kagglehub", "sentencepiece", "tiktoken", "blobfile")

_PRELUDE = """
import importlib.abc, sys

class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)", name=name)
        return None

sys.meta_path.insert(0, _Absent())
"""

_LOAD = """
import inspect
from ebbtide.harness.methods import load_torchtune_offload
cls, how = load_torchtune_offload()
print("HOW", how)
print("FILE", cls.__init__.__code__.co_filename)  # the module is in no sys.modules entry
print("PARAMS", sorted(inspect.signature(cls.__init__).parameters))
print("LEFT", sorted(m for m in sys.modules if m.split(".")[0] in ("torchao", "torchtune")))
"""

_TRAIN = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                                  torch.nn.Linear(2048, 512)) for _ in range(3)]).cuda()
x = torch.randn(8, 1024, 512, device="cuda")

def step(ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(x).float().pow(2).mean()
    else:
        with ctx:
            loss = model(x).float().pow(2).mean()
    loss.backward()
    torch.cuda.synchronize()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

ref = step()
ctx = cls(use_pin_memory=True)  # as bench/offload_bench.py makes it: streams on, stash of 5
for i in range(2):
    got = step(ctx)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), f"step {i}: gradients differ"
print("TRAINED ok")
"""


def _device_like_python(tmp_path, code):
    """Runs `code` (after the import blocker) in a fresh Python whose torchtune
    is a copy of the installed package in a folder ahead of site-packages, as
    the device's unpacked wheel is. Returns (stdout, the copy's folder)."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune is not installed here (requirements-dev.txt has it)")
    wheels = tmp_path / "wheels"
    shutil.copytree(list(spec.submodule_search_locations)[0], wheels / "torchtune",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(wheels)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    src = textwrap.dedent(_PRELUDE.format(blocked=BLOCKED)) + textwrap.dedent(code)
    p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, f"exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout, wheels


def _lines(out, tag):
    return [line[len(tag) + 1:] for line in out.splitlines() if line.startswith(tag + " ")]


def test_torchtune_class_loads_without_torchao(tmp_path):
    out, wheels = _device_like_python(tmp_path, _LOAD)
    (how,), (file,), (params,), (left,) = (_lines(out, t) for t in ("HOW", "FILE", "PARAMS", "LEFT"))
    assert how.startswith("torchtune/training/_activation_offloading.py by file (no torchao;"), how
    assert "torchao not installed" in how  # the package import failed for torchao's absence, as on the device
    assert file == str(wheels / "torchtune" / "training" / "_activation_offloading.py")
    assert {"use_pin_memory", "use_streams", "max_fwd_stash_size", "min_offload_size"} <= set(ast.literal_eval(params))
    assert ast.literal_eval(left) == []  # the stand-ins are gone from sys.modules again


def test_torchtune_class_loads_in_this_environment():
    """From the package where it imports (torchao and the rest installed, as
    on the development machine), else by file (the GPU machine)."""
    if importlib.util.find_spec("torchtune") is None:
        pytest.skip("torchtune is not installed here (requirements-dev.txt has it)")
    try:
        import torchtune.training  # noqa: F401
        package = True
    except ImportError:
        package = False
    cls, how = load_torchtune_offload()
    assert cls.__name__ == "OffloadActivations"
    assert how == "torchtune.training" if package else how.startswith("torchtune/training/_activation_offloading.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_torchtune_class_loaded_without_torchao_trains_bitwise(tmp_path):
    out, _ = _device_like_python(tmp_path, _LOAD + _TRAIN)
    assert "no torchao" in _lines(out, "HOW")[0] and "TRAINED ok" in out, out
