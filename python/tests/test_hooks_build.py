"""The hooks module (ebbtide._torch) is built against one torch and says so
(Note [Hooks for one torch] in python/src/torch/hooks.cpp)."""
import subprocess
import sys

import torch

import ebbtide
from ebbtide import _torch


def test_the_hooks_record_the_torch_they_were_built_against():
    assert _torch.TORCH_VERSION == torch.__version__


def test_under_another_torch_the_hooks_refuse_naming_both_versions_and_the_rebuild():
    code = (
        "import torch\n"
        "built = torch.__version__\n"
        "torch.__version__ = '0.0.1+other'\n"  # as if another torch were installed after the build
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
    built, _, message = out.stdout.strip().partition(" | ")
    assert f"built against torch {built}" in message, message
    assert "torch 0.0.1+other is installed" in message, message
    assert "pip install --no-build-isolation --force-reinstall --no-deps" in message, message
    assert ebbtide.TensorCache  # the parent process is unaffected
