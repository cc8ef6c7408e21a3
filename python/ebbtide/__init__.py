"""ebbtide: activation offloading to NVMe and host memory for PyTorch training.

Heavy submodules (torch glue) load lazily, so ``import ebbtide`` stays cheap
and works without torch for the storage engine and the planner.

The package mirrors the C++ core (cpp/src: util, mem, io, cache, plan, ckpt):
- cache/: the activation cache's torch glue (TensorCache, offload, adaptive placement);
- checkpoint/: checkpoints (native format, safetensors, the DCP plugin; ``ebbtide.dcp``
  is the plugin's public name);
- plan/: the performance model and the planner (C++ in ebbtide._core);
- io.py: the storage engine;
- integrations/: trainers (HF, Lightning, torchtune, pipelines, Ray);
- commands/: the ``ebbtide`` command's subcommands (cli.py dispatches);
- harness/: the demo and benchmark harness (models, methods, the demo, ROK and budget
  sweeps, the memory meter), apart from the library: nothing above imports it.
The compiled modules ebbtide._core (the core) and ebbtide._torch (the saved-tensor
hooks, built against the installed torch) sit beside these sources.
"""
from pkgutil import extend_path

# Developer builds keep the native module in <build>/python/ebbtide; this lets
# `PYTHONPATH=python:<build>/python` find it beside these sources.
__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"

_LAZY = {
    # name -> module that defines it
    "offload": "ebbtide.cache",
    "TensorCache": "ebbtide.cache",
    "release_pooled_stores": "ebbtide.cache",
    "model": "ebbtide.plan.model",
    "checkpoint": "ebbtide.checkpoint",
    "Engine": "ebbtide.io",
    "IoError": "ebbtide.io",
    "ChecksumError": "ebbtide.io",
    "StateError": "ebbtide.io",
}


def __getattr__(name):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'ebbtide' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(target)
    value = mod if target.rsplit(".", 1)[-1] == name else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
