"""The switch: offloading in an unchanged training script.

    EBBTIDE_OFFLOAD=cpu python train.py                # or ssd / auto
    ebbtide run --target cpu [--budget 20GiB] -- torchrun --nproc-per-node 8 train.py

With ``EBBTIDE_OFFLOAD`` set, every Python process of the environment
(torchrun's and ``accelerate launch``'s workers too: they inherit the
environment) hooks the trainers it imports, as if the script had added
ebbtide's integration by hand:

- ``transformers.Trainer`` and every TRL trainer (subclasses of it) get an
  ``ebbtide.integrations.hf.OffloadCallback``,
- ``pytorch_lightning.Trainer`` gets an ``ebbtide.integrations.lightning.OffloadCallback``,
- torchtune recipes get ebbtide's ``get_act_offloading_ctx_manager`` (whatever
  their config's ``enable_activation_offloading`` says), and their metric
  loggers the ``ebbtide/*`` metrics.

A trainer already given ebbtide's callback is left as it is. Settings:
``EBBTIDE_OFFLOAD`` (the target), ``EBBTIDE_OFFLOAD_PATH`` (the SSD folder
for ``ssd`` and ``auto``) and every other ``EBBTIDE_*`` variable, e.g.
``EBBTIDE_ACTIVATION_BUDGET`` (docs/integrations.md, "Without editing the
script").

Note [Switch activation]: ebbtide's wheel installs ``ebbtide-switch.pth`` into
site-packages; Python's ``site`` runs its one line at every start, which
imports this module only when ``EBBTIDE_OFFLOAD`` is set (a dictionary
lookup otherwise). ``activate()`` puts a finder at the front of
``sys.meta_path`` that lets the trainers' modules load as usual and patches
them right after (a post-import hook): the frameworks are not imported by the
switch, so a process that uses none of them pays nothing, and one that
imported them already is patched at once. The patches add the callback to
the ``callbacks`` argument of the trainer's ``__init__`` (as a script would)
and install torchtune's drop-in; failures to patch are errors, never silent.
"""
from __future__ import annotations

import functools
import importlib.abc
import inspect
import os
import sys

__all__ = ["activate", "settings"]

_ENV = "EBBTIDE_OFFLOAD"
_ENV_PATH = "EBBTIDE_OFFLOAD_PATH"


def settings() -> dict | None:
    """The TensorCache settings the environment asks for (target, path), or
    None when ``EBBTIDE_OFFLOAD`` is unset or empty.

    Raises:
        ValueError: a variable has a bad value (naming it and the value).
    """
    from ebbtide import _core

    target = _core.env_setting(_ENV)
    if not target:
        return None
    path = _core.env_setting(_ENV_PATH)
    if path and target == "cpu":
        raise ValueError(f"{_ENV_PATH}={path!r} names an SSD folder, but {_ENV}=cpu offloads to host memory "
                         f"(use {_ENV}=ssd or auto, or unset {_ENV_PATH})")
    return dict(target=target, path=path or None)


def _with_callback(init, make_callback, callback_type):
    """Wraps a trainer's ``__init__`` so that its ``callbacks`` argument also
    holds ebbtide's callback, unless it holds one already."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs)
        given = bound.arguments.get("callbacks")
        given = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
        if not any(isinstance(c, callback_type()) for c in given):
            bound.arguments["callbacks"] = given + [make_callback()]
        init(*bound.args, **bound.kwargs)

    __init__._ebbtide_switch = True
    return __init__


def _patch_init(cls, make_callback, callback_type):
    if not getattr(cls.__init__, "_ebbtide_switch", False):
        cls.__init__ = _with_callback(cls.__init__, make_callback, callback_type)


def _patch_hf(module):
    def callback_type():
        from ebbtide.integrations.hf import OffloadCallback

        return OffloadCallback

    _patch_init(module.Trainer, lambda: callback_type()(**settings()), callback_type)


def _patch_lightning(module):
    def callback_type():
        from ebbtide.integrations.lightning import OffloadCallback

        return OffloadCallback

    _patch_init(module.Trainer, lambda: callback_type()(**settings()), callback_type)


def _patch_torchtune(module):
    from ebbtide.integrations import torchtune

    torchtune.install(force=True, **settings())


def _patch_torchtune_loggers(module):
    from ebbtide.integrations import torchtune

    torchtune.log_metrics_to(module)


# Module -> what to do once it has loaded.
_PATCHES = {
    "transformers.trainer": _patch_hf,
    "pytorch_lightning.trainer.trainer": _patch_lightning,
    "torchtune.training": _patch_torchtune,
    "torchtune.training.metric_logging": _patch_torchtune_loggers,
}


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch; everything else (source,
    resources) is the original loader's."""

    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the finders behind it and patches them
    once they have run (Note [Switch activation])."""

    def find_spec(self, name, path=None, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def activate() -> bool:
    """Hooks the trainers when ``EBBTIDE_OFFLOAD`` asks for it; True if it did.
    Idempotent. Modules already imported are patched at once.

    Raises:
        ValueError: an ``EBBTIDE_OFFLOAD*`` variable has a bad value.
    """
    if settings() is None:
        return False
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    return True


def _activate_at_startup() -> None:
    """What ebbtide-switch.pth runs: activate(), and a bad setting ends the
    process with a one-line message naming it (a .pth line's exception would
    only be printed, and training would run without the offloading asked for)."""
    try:
        activate()
    except ValueError as e:
        sys.stderr.write(f"ebbtide: {e}\n")
        os._exit(2)
