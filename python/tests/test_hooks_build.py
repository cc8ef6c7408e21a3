"""The hooks module (ebbtide._torch) is built against one torch and says so
(Note [Hooks for one torch] in python/src/torch/hooks.cpp)."""
import subprocess
import sys

import torch

import ebbtide
from ebbtide import _torch


def test_the_hooks_record_the_torch_they_were_built_against():
    assert _torch.TORCH_VERSION == torch.__version__


def cache_under_torch_version(version):
    """What TensorCache(target='cpu') says in a process whose torch reports VERSION."""
    code = (
        "import torch\n"
        "built = torch.__version__\n"
        f"torch.__version__ = {version!r}\n"  # as if another torch were installed after the build
        "import ebbtide\n"
        "try:\n"
        "    ebbtide.TensorCache(target='cpu')\n"
        "except RuntimeError as e:\n"
        "    print(built, '|', e)\n"
        "else:\n"
        "    print('no error')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_under_another_torch_the_hooks_refuse_naming_both_versions_and_the_rebuild():
    built, _, message = cache_under_torch_version("0.0.1+other").partition(" | ")
    assert f"built against torch {built}" in message, message
    assert "torch 0.0.1+other is installed" in message, message
    assert "pip install --no-build-isolation --force-reinstall --no-deps" in message, message
    assert ebbtide.TensorCache  # the parent process is unaffected


def test_another_build_of_the_same_release_is_accepted():
    # The CPU and CUDA builds of one release ("2.13.0+cpu", "2.13.0+cu130")
    # share libtorch's C++ interface; the wheel requires torch==<public version>.
    public = torch.__version__.split("+")[0]
    assert cache_under_torch_version(public + "+cu130") == "no error"
    assert cache_under_torch_version(public) == "no error"
