"""Megatron-core in the planner's terms: the bytes each of Megatron's
``--offload-modules`` takes per layer, and the Megatron flags (full recompute
of the first layers, fine-grained activation offloading) that fit an
activation budget, judged by the same model and timing as every budget plan
(Note [Megatron family] in cpp/src/plan/model_activations.cpp, Note
[Megatron flags] in cpp/src/plan/megatron.cpp). No torch needed.
"""
from __future__ import annotations

from typing import Any, Mapping

from ebbtide import _core
from ebbtide._records import as_dict
from ebbtide.plan import model

__all__ = ["megatron_config", "layer_saves", "megatron_flags", "transformer_config_kwargs", "flag_rows"]


def megatron_config(config: Mapping[str, Any] | None = None, **kwargs) -> dict:
    """The config as family megatron (Megatron-core's GPTModel, local layer
    spec): GPT-style configs (family gpt2 or unset) become family megatron.

    Raises:
        ValueError: a family Megatron's layers are not modelled for (llama, t5) or not a decoder.
    """
    cfg = dict(config or {}, **kwargs)
    family = cfg.get("family") or "gpt2"
    if family not in ("gpt2", "megatron"):
        raise ValueError(f"Megatron-core's layers are modelled for GPT-style configs (LayerNorm, GELU MLP, "
                         f"learned positions: family megatron), not family {family!r}")
    if cfg.get("arch", "decoder") != "decoder":
        raise ValueError(f"Megatron-core's GPTModel is a decoder (got arch {cfg['arch']!r})")
    cfg["family"] = "megatron"
    return cfg


def layer_saves(config: Mapping[str, Any] | None = None, **kwargs) -> dict:
    """Bytes one layer saves inside each module Megatron's fine-grained
    offloading can move (attn_norm, qkv_linear, core_attn, attn_proj,
    mlp_norm), ``rest`` (what none of them takes) and ``total``."""
    return as_dict(_core.plan_megatron_layer_saves(model._config(megatron_config(config, **kwargs), {})))


def megatron_flags(config: Mapping[str, Any] | None = None, *, activation_budget_bytes: int,
                   gpu: str = "h100-sxm", ssd: str = "d7-p5620", ssds: int = 1, mfu: float = 0.5,
                   host_budget_bytes: int = 0, **kwargs) -> dict:
    """The Megatron settings that fit ``activation_budget_bytes`` at the least
    predicted step time: ``recompute_num_layers`` (full recompute, block
    method), ``offload_modules`` (fine-grained offloading, tried only with
    ``host_budget_bytes``), ``flags`` (the command line), ``plan`` (the
    planner's dict for these settings: per layer placement, predicted peak
    and step), ``resident_bytes`` (saved bytes in device memory after the
    forward) and ``offloaded_bytes`` (moved to host memory)."""
    record = model._config(megatron_config(config, **kwargs), {})
    return as_dict(_core.plan_megatron(record, gpu, ssd, ssds, mfu, int(activation_budget_bytes),
                                       int(host_budget_bytes)))


def transformer_config_kwargs(flags) -> dict:
    """Megatron-core ``TransformerConfig`` keywords of Megatron-LM command-line
    flags as ``megatron_flags`` prints them ("--recompute-num-layers 3", ...).

    Raises:
        ValueError: a flag megatron_flags never prints.
    """
    out: dict = {}
    for flag in flags:
        name, *values = flag.split()
        key = name.lstrip("-").replace("-", "_")
        if key in ("recompute_granularity", "recompute_method") and len(values) == 1:
            out[key] = values[0]
        elif key == "recompute_num_layers" and len(values) == 1:
            out[key] = int(values[0])
        elif key == "fine_grained_activation_offloading" and not values:
            out[key] = True
        elif key == "offload_modules" and values:
            out[key] = list(values)
        else:
            raise ValueError(f"Megatron flag {flag!r} is not one ebbtide plans")
    return out


def flag_rows(m: Mapping[str, Any], budget_plan: Mapping[str, Any], fmt_bytes, runs) -> list:
    """(label, text) rows of ``ebbtide plan --megatron``: ``megatron_flags``'
    answer `m` beside the budget plan's step time."""
    p = m["plan"]
    layers = [d["placement"] for d in p["modules"] if d["name"] != "head"]
    base = p["forward_seconds"] + p["backward_seconds"]
    peak = fmt_bytes(p["peak_resident_bytes"])
    if not p["feasible"]:
        peak += f"  NOT MET: the smallest Megatron's flags reach is {fmt_bytes(p['min_budget_bytes'])}"
    return [
        ("megatron flags", " ".join(m["flags"]) or "(none: the budget holds without recompute or offloading)"),
        ("  by layer", runs(layers)),
        ("  predicted peak", peak),
        ("  after forward", f"{fmt_bytes(m['resident_bytes'])} saved in device memory, "
                            f"{fmt_bytes(m['offloaded_bytes'])} in host memory"),
        ("  predicted step", f"{p['predicted_step_seconds'] * 1e3:.1f} ms "
                             f"(+{100 * (p['predicted_step_seconds'] / base - 1) if base else 0:.1f}%; ebbtide's "
                             f"placement {budget_plan['predicted_step_seconds'] * 1e3:.1f} ms)"),
    ]
