"""Activation offloading inside the trainers people use.

Each submodule imports its framework only when it is imported itself, and
says which package (and which ebbtide extra) is missing when it is not there:

- ``ebbtide.integrations.hf``: Hugging Face ``Trainer`` and TRL trainers
  (``OffloadCallback``), and Accelerate loops (``ebbtide[hf]``).
- ``ebbtide.integrations.lightning``: PyTorch Lightning (``OffloadCallback``,
  ``ebbtide[lightning]``).
- ``ebbtide.integrations.torchtune``: a drop-in for
  ``torchtune.training.get_act_offloading_ctx_manager`` (``ebbtide[torchtune]``).
- ``ebbtide.integrations.pipeline``: micro-batch and phase hints from
  DeepSpeed's pipeline instruction schedules (``ebbtide[deepspeed]``) and
  ``torch.distributed.pipelining`` action lists.
- ``ebbtide.integrations.ray``: a cache per Ray Train worker, in its own
  directory (``worker_cache``, ``ebbtide[ray]``).
- ``ebbtide.integrations.megatron``: one cache for a rank's Megatron-core
  model chunks, scoped by their decoder layers (``offload_megatron``,
  ``ebbtide[megatron]``).
- ``ebbtide.integrations.switch``: the above without editing the script,
  when ``EBBTIDE_OFFLOAD`` is set (``ebbtide run``).

See docs/integrations.md.
"""
from __future__ import annotations

import importlib

__all__ = ["require"]


def require(module: str, package: str, extra: str, what: str):
    """Imports `module`, or raises ImportError naming the pip package and the ebbtide extra.

    Args:
        module: the module to import, e.g. ``"transformers"``.
        package: the pip package that provides it, e.g. ``"transformers"``.
        extra: the ebbtide extra that installs it, e.g. ``"hf"``.
        what: the integration asking, for the message.

    Returns:
        The imported module.

    Raises:
        ImportError: `module` cannot be imported.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{what} needs the package {package!r} (module {module!r} cannot be imported: "
                          f"{exc}); install it with: pip install 'ebbtide[{extra}]'") from exc
