"""Performance model: activation bytes, FLOPs, step time, SSD bandwidth and
lifetime, largest micro-batch. The formulas live in C++
(cpp/src/plan/model.cpp); docs/model.md derives each one and cites its source.

A model config is a plain dict with the keys of ``ebbtide::plan::ModelConfig``:
layers, hidden, heads, seq, batch, vocab, ffn_hidden, arch ("decoder",
"encoder", "encoder-decoder"), decoder_layers, flash_attn, tp, sp, recompute
("none", "selective", "full"), bytes_per_element (or dtype: "bf16", "fp16",
"fp32"), head_dim (0: hidden/heads), family ("gpt2", "llama", "t5") and the
llama family's kv_heads, gated_mlp, norm ("rmsnorm", "layernorm"), bias,
qkv_bias, dropout, rotary, tied_embeddings, experts, top_k, expert_ffn_hidden,
norm_topk, shared_expert_ffn_hidden (the t5 family: gated_mlp, dropout,
tied_embeddings). Missing keys take the C++ defaults. No torch needed.
"""
from __future__ import annotations

from typing import Any, Mapping

from ebbtide import _core
from ebbtide._records import as_dict, make

__all__ = [
    "activation_bytes",
    "flops",
    "parameter_count",
    "plan",
    "model_state",
    "longest_seq",
    "sharding",
    "optimizers",
    "networks",
    "gpus",
    "ssds",
    "models",
    "catalog_config",
    "normalize_config",
    "config_from_hf",
    "predicted_saved_bytes",
]


def _dtype(value: Any) -> tuple[str, int]:
    if not isinstance(value, str):
        raise ValueError(f"model setting 'dtype' must be a string, got {value!r}")
    return "bytes_per_element", _core.plan_dtype_bytes(value)


def _config(config: Mapping[str, Any] | None, kwargs: dict):
    """The validated ``_core.ModelConfig`` of a config dict and keyword overrides."""
    merged = dict(config or {})
    merged.update(kwargs)
    if "arch" in merged and isinstance(merged["arch"], str):
        merged["arch"] = merged["arch"].replace("_", "-")
    record = make(_core.ModelConfig, merged, "model", aliases={"dtype": _dtype})
    record.validate()
    return record


def normalize_config(config: Mapping[str, Any] | None = None, **kwargs) -> dict:
    """The config with defaults filled in; ValueError names a bad setting."""
    return as_dict(_config(config, kwargs).normalized())


def activation_bytes(config: Mapping[str, Any] | None = None, **kwargs) -> dict:
    """Activation bytes per GPU: ``per_layer`` (largest layer), ``self_layer``,
    ``cross_layer`` (encoder-decoder decoder layer), ``shared`` (encoder output,
    once per step), ``per_step``, ``last_layer``, ``logits``.

    ``activation_bytes(layers=24, hidden=2048, heads=16, seq=2048, batch=8,
    flash_attn=False)`` or ``activation_bytes(config_dict, batch=8)``.
    """
    return as_dict(_core.plan_activation_bytes(_config(config, kwargs)))


def flops(config: Mapping[str, Any] | None = None, **kwargs) -> dict:
    """Forward FLOPs per layer and per step (all GPUs together), recompute, step = 3x forward + recompute."""
    return as_dict(_core.plan_flops(_config(config, kwargs)))


def parameter_count(config: Mapping[str, Any] | None = None, **kwargs) -> float:
    return _core.plan_parameter_count(_config(config, kwargs))


def sharding(*, dp: int = 1, zero: int | None = None, fsdp: bool = False, fsdp_hybrid: int | None = None,
             optimizer: str | None = None, optimizer_bytes: float | None = None, param_bytes: float = 2,
             grad_bytes: float = 2) -> Any:
    """The ``_core.ShardingOptions`` of data-parallel settings (Note [ZeRO model
    state] in cpp/src/plan/cluster.cpp).

    Args:
        dp: data-parallel GPUs.
        zero: ZeRO stage 0-3 (default 0, or 3 with ``fsdp`` / ``fsdp_hybrid``).
        fsdp: shard parameters, gradients and optimizer state over ``dp`` (ZeRO-3).
        fsdp_hybrid: shard within groups of this many GPUs, replicate across groups (HSDP).
        optimizer: a preset of :func:`optimizers` setting ``optimizer_bytes``.
        optimizer_bytes: K, the optimizer's bytes per parameter (default 12: mixed-precision Adam).
        param_bytes: bytes per parameter of the training copy (2: bf16, 4: fp32).
        grad_bytes: bytes per gradient element.

    Returns:
        A ``_core.ShardingOptions``.

    Raises:
        ValueError: a setting out of range or settings that contradict each other.
    """
    if (fsdp or fsdp_hybrid) and zero not in (None, 3):
        raise ValueError(f"fsdp shards parameters (ZeRO stage 3); got zero={zero}")
    if optimizer is not None and optimizer_bytes is not None:
        raise ValueError("give optimizer or optimizer_bytes, not both")
    if optimizer is not None:
        optimizer_bytes = _core.plan_find_optimizer(optimizer).optimizer_bytes
    stage = 3 if (fsdp or fsdp_hybrid) else (0 if zero is None else zero)
    settings = {"dp": dp, "zero_stage": stage, "shard_group": fsdp_hybrid or 0, "param_bytes": float(param_bytes),
                "grad_bytes": float(grad_bytes),
                "optimizer_bytes": 12.0 if optimizer_bytes is None else float(optimizer_bytes)}
    record = make(_core.ShardingOptions, settings, "plan")
    record.validate()
    return record


def model_state(params: float, *, layer_params: float = 0, root_params: float = 0, **sharding_settings) -> dict:
    """Per-GPU model state of ``params`` parameters (per tensor-parallel rank)
    under the :func:`sharding` settings: ``params_bytes``, ``grads_bytes``,
    ``optimizer_bytes``, FSDP's ``gathered_unit_bytes`` and ``prefetch_unit_bytes``
    (``layer_params`` each) and ``root_unit_bytes``, their sum ``model_state_bytes``.

    Example: ``model_state(7.5e9, dp=64, zero=2)["model_state_bytes"]`` is 16.6e9.
    """
    return as_dict(_core.plan_model_state(float(params), float(layer_params), float(root_params),
                                          sharding(**sharding_settings)))


def optimizers() -> list[dict]:
    """The optimizer presets: name, description, optimizer_bytes (K per parameter)."""
    return as_dict(_core.plan_optimizers())


_SHARDING_KEYS = ("dp", "zero", "fsdp", "fsdp_hybrid", "optimizer", "optimizer_bytes", "param_bytes", "grad_bytes")


def networks() -> list[dict]:
    """The network catalog: name, description, gpus_per_node, intra_gbps, inter_gbps, latency_us."""
    return as_dict(_core.plan_networks())


def plan(config: Mapping[str, Any] | None = None, *, gpu: str = "h100-sxm", ssd: str = "d7-p5620",
         ssds: int = 1, mfu: float = 0.5, write_amplification: float = 1.0, network: str | None = None,
         **kwargs) -> dict:
    """Everything ``ebbtide plan`` reports, as a dict (see docs/model.md for each key).

    The :func:`sharding` keywords (dp, zero, fsdp, fsdp_hybrid, optimizer,
    optimizer_bytes, param_bytes, grad_bytes) set how model state is held per
    GPU; the others are model settings. ``model_state_bytes`` and the largest
    micro-batches follow from them. With ``network`` (a name of :func:`networks`)
    the data-parallel collectives are added: ``comm_gather_seconds``,
    ``comm_reduce_seconds``, ``comm_seconds``, ``comm_exposed_seconds``,
    ``step_seconds_with_comm``, ``scaling_efficiency`` and ``network``.
    """
    shard = sharding(**{k: kwargs.pop(k) for k in _SHARDING_KEYS if k in kwargs})
    record = _config(config, kwargs)
    report = as_dict(_core.plan_report(record, gpu, ssd, ssds, mfu, write_amplification, shard))
    if network is not None:
        report.update(as_dict(_core.plan_communication(record, gpu, ssd, ssds, mfu, shard, network)),
                      network=network.lower())
    return report


def max_micro_batch_budget(config: Mapping[str, Any] | None = None, *, gpu: str = "h100-sxm",
                           ssd: str = "d7-p5620", ssds: int = 1, mfu: float = 0.5, host_budget_bytes: int = 0,
                           **kwargs) -> int:
    """The largest micro-batch per GPU whose activation-budget plan (keep,
    offload or recompute per layer, Note [Budget plan]) fits what the GPU's
    memory leaves after the model state under :func:`sharding`'s keywords,
    with what it offloads within the SSDs' capacity; 0 when one sample does
    not fit. The config must not recompute already."""
    kwargs.pop("write_amplification", None)
    kwargs.pop("network", None)
    shard = sharding(**{k: kwargs.pop(k) for k in _SHARDING_KEYS if k in kwargs})
    return int(_core.plan_max_micro_batch_budget(_config(config, kwargs), gpu, ssd, ssds, mfu, shard,
                                                 int(host_budget_bytes)))


def longest_seq(config: Mapping[str, Any] | None = None, *, step: int = 256, limit: int = 1 << 21,
                **kwargs) -> dict:
    """The longest sequence, a multiple of ``step`` up to ``limit``, at which the
    config's micro-batch fits one GPU under :func:`plan`'s settings.

    Args:
        config: a model config (its seq is ignored).
        step: the granularity of the answer.
        limit: the longest sequence tried.
        **kwargs: :func:`plan`'s keywords.

    Returns:
        ``{"longest_seq": with offloading, "longest_seq_without_offload": without}``; 0 where not even
        ``step`` fits.
    """
    batch = int(dict(config or {}, **kwargs).get("batch") or 1)

    def longest(key):
        lo, hi = 0, limit // step  # fits at lo * step (0: trivially), search the largest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if plan(config, **dict(kwargs, seq=mid * step))[key] >= batch:
                lo = mid
            else:
                hi = mid - 1
        return lo * step

    return {"longest_seq": longest("max_micro_batch"),
            "longest_seq_without_offload": longest("max_micro_batch_without_offload")}


def budget_plan(config: Mapping[str, Any] | None = None, *, activation_budget_bytes: int, gpu: str = "h100-sxm",
                ssd: str = "d7-p5620", ssds: int = 1, mfu: float = 0.5, host_budget_bytes: int = 0,
                **kwargs) -> dict:
    """The planner's keep / offload / recompute mix for a model of the catalog
    within ``activation_budget_bytes`` per GPU (Note [Budget from the model]
    in cpp/src/plan/budget.cpp); the dict of ``ebbtide.plan.planner.plan_offload``."""
    plan = _core.plan_report_budget(_config(config, kwargs), gpu, ssd, ssds, mfu, int(activation_budget_bytes),
                                    int(host_budget_bytes))
    return as_dict(plan)


def gpus() -> list[dict]:
    """The GPU catalog: name, description, peak_bf16_tflops, peak_tf32_tflops, memory_gb, pcie_gbps."""
    return as_dict(_core.plan_gpus())


def ssds() -> list[dict]:
    """The SSD catalog: name, description, capacity_tb, dwpd, warranty_years, pbw,
    seq_write_gbps, seq_read_gbps."""
    return as_dict(_core.plan_ssds())


# The config keys a catalog entry shows (seq, batch, dtype and parallelism are the caller's).
_CATALOG_KEYS = ("family", "arch", "layers", "decoder_layers", "hidden", "heads", "head_dim", "kv_heads",
                 "ffn_hidden", "vocab", "gated_mlp", "dropout", "qkv_bias", "tied_embeddings", "experts", "top_k")


def models() -> list[dict]:
    """The model catalog (published shapes): name, description, family, arch, layers,
    decoder_layers, hidden, heads, head_dim, kv_heads, ffn_hidden, vocab, gated_mlp, dropout,
    qkv_bias, tied_embeddings, experts, top_k."""
    return [{"name": m.name, "description": m.description,
             **{k: getattr(m.config, k) for k in _CATALOG_KEYS}} for m in _core.plan_models()]


def catalog_config(name: str) -> dict:
    """The config-dict keys of catalog model ``name`` (case-insensitive); ValueError lists the names."""
    for m in models():
        if m["name"] == name.lower():
            return {k: v for k, v in m.items() if k not in ("name", "description")}
    raise ValueError(f"unknown model {name!r} (valid: {', '.join(m['name'] for m in models())})")


# ---------------------------------------------------------------------------
# Hugging Face configs


def _get(cfg, *names, default=None):
    for name in names:
        if isinstance(cfg, Mapping):
            if cfg.get(name) is not None:
                return cfg[name]
        else:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
    return default


# model_type values read as the llama family (Note [Layer families] in model_activations.cpp).
_LLAMA_TYPES = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe")
# Activations that save only their input: the gated MLP's count holds for them.
_GATED_ACTS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")


def _family(cfg) -> str:
    model_type = _get(cfg, "model_type", default="")
    if model_type in ("gpt2", "bert", "t5") + _LLAMA_TYPES:
        return model_type
    if model_type:
        raise ValueError(
            f"unsupported model_type {model_type!r} (valid: gpt2, bert, t5, {', '.join(_LLAMA_TYPES)})")
    if _get(cfg, "n_layer") is not None and _get(cfg, "n_embd") is not None:
        return "gpt2"
    if _get(cfg, "d_model") is not None and _get(cfg, "num_layers") is not None:
        return "t5"
    if _get(cfg, "num_hidden_layers") is not None and _get(cfg, "hidden_size") is not None:
        return "bert"
    raise ValueError(
        f"unsupported Hugging Face config (model_type {model_type!r}): expected GPT-2 "
        "(n_layer/n_embd/n_head), BERT (num_hidden_layers/hidden_size/num_attention_heads), "
        f"T5 (num_layers/d_model/num_heads) or key 'model_type' one of {', '.join(_LLAMA_TYPES)}")


def _flash(cfg) -> bool:
    impl = _get(cfg, "_attn_implementation", "attn_implementation")
    # Eager attention saves the s x s scores; SDPA and flash kernels do not.
    return impl not in (None, "eager")


def _need(cfg, key):
    value = _get(cfg, key)
    if value is None:
        raise ValueError(f"missing key {key!r}")
    return value


def _int_key(cfg, key, default=None):
    value = _get(cfg, key, default=default) if default is not None else _need(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"key {key!r} must be a non-negative integer, got {value!r}")
    return value


def _llama_from_hf(cfg, model_type: str) -> dict:
    hidden = _int_key(cfg, "hidden_size")
    heads = _int_key(cfg, "num_attention_heads")
    # head_dim (Qwen3, Gemma and others set it): the attention is heads x
    # head_dim wide, whatever hidden / heads is; absent or None: hidden / heads.
    head_dim = _int_key(cfg, "head_dim", default=0) if _get(cfg, "head_dim") is not None else 0
    if heads == 0 or (head_dim == 0 and hidden % heads):
        raise ValueError(f"key 'num_attention_heads' ({heads}) must divide 'hidden_size' ({hidden}) "
                         "unless 'head_dim' is given")
    act = _get(cfg, "hidden_act", default="silu")
    if act not in _GATED_ACTS:
        raise ValueError(f"key 'hidden_act' value {act!r} not modelled (valid: {', '.join(_GATED_ACTS)})")
    out: dict[str, Any] = {
        "family": "llama", "arch": "decoder",
        "layers": _int_key(cfg, "num_hidden_layers"), "hidden": hidden, "heads": heads, "head_dim": head_dim,
        "kv_heads": _int_key(cfg, "num_key_value_heads", default=heads),
        "ffn_hidden": _int_key(cfg, "intermediate_size"),
        "dropout": float(_get(cfg, "attention_dropout", default=0.0)) > 0,
        "tied_embeddings": bool(_get(cfg, "tie_word_embeddings", default=False)),
        "bias": bool(_get(cfg, "attention_bias", default=False) or _get(cfg, "mlp_bias", default=False)),
        "qkv_bias": model_type in ("qwen2", "qwen2_moe"),
    }
    if model_type == "mixtral":
        if float(_get(cfg, "router_jitter_noise", default=0.0)) > 0:
            raise ValueError("key 'router_jitter_noise' > 0 not modelled (it saves a noise tensor per layer)")
        out.update(experts=_int_key(cfg, "num_local_experts"), top_k=_int_key(cfg, "num_experts_per_tok"))
    elif model_type == "qwen2_moe":
        if _int_key(cfg, "decoder_sparse_step", default=1) != 1 or _get(cfg, "mlp_only_layers", default=[]):
            raise ValueError("keys 'decoder_sparse_step' != 1 / 'mlp_only_layers' (dense layers among "
                             "MoE layers) not modelled")
        out.update(experts=_int_key(cfg, "num_experts"), top_k=_int_key(cfg, "num_experts_per_tok"),
                   expert_ffn_hidden=_int_key(cfg, "moe_intermediate_size"),
                   shared_expert_ffn_hidden=_int_key(cfg, "shared_expert_intermediate_size", default=0),
                   norm_topk=bool(_get(cfg, "norm_topk_prob", default=False)))
    return out


# T5 feed_forward_proj values the t5 family models (Note [T5 family] in model_activations.cpp).
_T5_FFN = {"relu": False, "gated-gelu": True}


def _t5_from_hf(cfg) -> dict:
    d_model = _int_key(cfg, "d_model")
    heads = _int_key(cfg, "num_heads")
    layers = _int_key(cfg, "num_layers")
    ffn = _get(cfg, "feed_forward_proj", default="relu")
    if ffn not in _T5_FFN:
        raise ValueError(f"key 'feed_forward_proj' value {ffn!r} not modelled (valid: {', '.join(_T5_FFN)})")
    buckets = _get(cfg, "relative_attention_num_buckets", default=32)
    if buckets != 32:
        raise ValueError(f"key 'relative_attention_num_buckets' ({buckets}) not modelled (valid: 32)")
    return {
        "family": "t5", "arch": "encoder-decoder",
        "layers": layers, "decoder_layers": _int_key(cfg, "num_decoder_layers", default=layers),
        "hidden": d_model, "heads": heads,
        "head_dim": _int_key(cfg, "d_kv", default=d_model // heads if heads else 0),
        "ffn_hidden": _int_key(cfg, "d_ff"), "gated_mlp": _T5_FFN[ffn],
        "dropout": float(_get(cfg, "dropout_rate", default=0.1)) > 0,
        "tied_embeddings": bool(_get(cfg, "tie_word_embeddings", default=True)),
    }


def config_from_hf(config, seq: int, batch: int) -> dict:
    """Maps a Hugging Face config (object or dict) to a model-config dict: GPT-2,
    BERT (family gpt2), T5 (family t5) or Llama, Qwen2, Mistral, Mixtral, Qwen2-MoE
    (family llama).

    Raises ValueError naming a missing, bad or unsupported key.

    GPT-2: n_layer, n_embd, n_head, n_inner (default 4h); BERT: num_hidden_layers,
    hidden_size, num_attention_heads, intermediate_size; T5: num_layers,
    num_decoder_layers, d_model, num_heads, d_kv (head_dim: the attention is
    num_heads * d_kv wide, 16 x d_model for T5-11B), d_ff, feed_forward_proj
    (relu, gated-gelu), dropout_rate, tie_word_embeddings (default true).
    flash_attn is True for an attn_implementation other than "eager" (SDPA,
    flash kernels); unset counts as eager.

    Llama family: num_hidden_layers, hidden_size, num_attention_heads,
    num_key_value_heads, intermediate_size, hidden_act (silu, gelu), attention_dropout,
    attention_bias / mlp_bias, tie_word_embeddings, vocab_size; Mixtral
    num_local_experts, num_experts_per_tok; Qwen2-MoE num_experts,
    num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size,
    norm_topk_prob.
    """
    family = _family(config)
    out: dict[str, Any] = {"seq": int(seq), "batch": int(batch), "flash_attn": _flash(config)}
    if family in _LLAMA_TYPES:
        out.update(_llama_from_hf(config, family))
    elif family == "gpt2":
        hidden = int(_get(config, "n_embd"))
        out.update(layers=int(_get(config, "n_layer")), hidden=hidden, heads=int(_get(config, "n_head")),
                   ffn_hidden=int(_get(config, "n_inner", default=4 * hidden)), arch="decoder")
    elif family == "bert":
        out.update(layers=int(_get(config, "num_hidden_layers")), hidden=int(_get(config, "hidden_size")),
                   heads=int(_get(config, "num_attention_heads")),
                   ffn_hidden=int(_get(config, "intermediate_size")), arch="encoder")
    else:
        out.update(_t5_from_hf(config))
    vocab = _get(config, "vocab_size")
    if vocab is not None:
        out["vocab"] = _int_key(config, "vocab_size")
    return out


# ---------------------------------------------------------------------------
# What PyTorch eager autograd saves for the HF demo models (see docs/model.md,
# "Eager PyTorch vs the paper"). Counted per distinct storage, parameters
# excluded, as the tensor cache sees them.

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "float": 4, "bf16": 2, "bfloat16": 2, "fp16": 2,
                "float16": 2, "half": 2}


def _dtype_bytes(dtype) -> int:
    name = str(dtype).lower().replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (valid: fp32, bf16, fp16 or a torch dtype)")
    return _DTYPE_BYTES[name]


# Tensors an activation function saves, in units of its input size:
# (saved internally, whether its output is one of them).
_ACT_SAVES = {
    "gelu_new": (4, False),        # x, tanh(.), 0.5x, 1 + tanh(.) (Python formula)
    "gelu_fast": (4, False),
    "gelu_pytorch_tanh": (1, False),
    "gelu": (1, False),
    "relu": (1, True),             # saves its result
    "silu": (1, False),
    "swish": (1, False),
}


def _act(cfg, *names, default):
    name = _get(cfg, *names, default=default)
    if name not in _ACT_SAVES:
        raise ValueError(f"activation {name!r} not modelled (valid: {', '.join(sorted(_ACT_SAVES))})")
    return _ACT_SAVES[name]


def predicted_saved_bytes(hf_config, seq: int, batch: int, dtype="fp32", *, device: str = "cpu",
                          with_loss: bool = True) -> int:
    """Bytes autograd saves in one training forward of a HF GPT-2 (LM head), BERT
    (masked LM), T5 (conditional generation) or Llama-family causal LM (Llama,
    Qwen2, Mistral, Mixtral, Qwen2-MoE; eager or SDPA attention) in PyTorch:
    distinct storages, parameters excluded, labels a tensor of their own.

    device: "cpu" or "cuda". On CPU dropout saves its mask in the input dtype
    and layer_norm its statistics in the input dtype; on CUDA the mask is bool
    and the statistics fp32. with_loss: the model was called with labels.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not valid (valid: cpu, cuda)")
    if int(seq) <= 0 or int(batch) <= 0:
        raise ValueError(f"seq and batch must be positive, got seq={seq}, batch={batch}")
    family = _family(hf_config)
    if family in _LLAMA_TYPES:
        # Note [Layer families] (model_activations.cpp): the C++ model counts these layers.
        cfg = config_from_hf(hf_config, seq, batch)
        cfg["bytes_per_element"] = _dtype_bytes(dtype)
        a = activation_bytes(cfg)
        return int(a["per_step"] + a["outside"] + (a["logits"] if with_loss else 0))
    if _flash(hf_config):
        raise ValueError("predicted_saved_bytes models attn_implementation='eager' only for GPT-2, BERT, T5")
    p = _dtype_bytes(dtype)
    mask = 1 if device == "cuda" else p
    stats = 4 if device == "cuda" else p
    s, b = int(seq), int(batch)
    cfg = config_from_hf(hf_config, s, b)
    h, a, f, vocab = cfg["hidden"], cfg["heads"], cfg["ffn_hidden"], cfg.get("vocab", 0)
    sbh, sbf, ss = s * b * h, s * b * f, a * s * s * b
    ints = 8  # int64 ids

    def drop_mask(prob, numel):
        return mask * numel if prob and prob > 0 else 0

    def scores(attn_drop):
        # softmax output, then (with dropout) its mask and the dropped copy bmm saves
        return p * ss + (mask * ss + p * ss if attn_drop and attn_drop > 0 else 0)

    loss = 0
    if family == "gpt2":
        attn_drop = _get(hf_config, "attn_pdrop", default=0.1)
        resid_drop = _get(hf_config, "resid_pdrop", default=0.1)
        embd_drop = _get(hf_config, "embd_pdrop", default=0.1)
        act_saved, act_out_saved = _act(hf_config, "activation_function", default="gelu_new")
        ln = p * sbh + 2 * stats * s * b
        layer = (ln + p * sbh + 3 * p * sbh + scores(attn_drop) + p * sbh + drop_mask(resid_drop, sbh)
                 + ln + p * sbh + act_saved * p * sbf + (0 if act_out_saved else p * sbf)
                 + drop_mask(resid_drop, sbh))
        stack = cfg["layers"] * layer
        extra = ints * s * b + ints * s + drop_mask(embd_drop, sbh) + ln + p * sbh
        if with_loss:
            # causal-LM loss upcasts logits: fp32 log_softmax, shifted targets, total weight
            loss = 4 * s * b * vocab + ints * s * b + 4
        return int(stack + extra + loss)

    if family == "bert":
        attn_drop = _get(hf_config, "attention_probs_dropout_prob", default=0.1)
        hid_drop = _get(hf_config, "hidden_dropout_prob", default=0.1)
        act_saved, act_out_saved = _act(hf_config, "hidden_act", default="gelu")
        ln = p * sbh + 2 * stats * s * b
        layer = (p * sbh + 3 * p * sbh + scores(attn_drop) + p * sbh + drop_mask(hid_drop, sbh) + ln
                 + p * sbh + act_saved * p * sbf + (0 if act_out_saved else p * sbf)
                 + drop_mask(hid_drop, sbh) + ln)
        stack = cfg["layers"] * layer
        max_pos = int(_get(hf_config, "max_position_embeddings", default=512))
        # ids, token-type ids (s), the position-id buffer; embedding LayerNorm and dropout
        extra = ints * s * b + ints * s + ints * max_pos + ln + drop_mask(hid_drop, sbh)
        # MLM head: dense input, activation input, LayerNorm, decoder input
        extra += p * sbh + act_saved * p * sbh + ln + p * sbh
        if with_loss:
            loss = p * s * b * vocab + ints * s * b + p
        return int(stack + extra + loss)

    # T5
    drop = _get(hf_config, "dropout_rate", default=0.1)
    gated = bool(_get(hf_config, "is_gated_act", default=False))
    act_name = _get(hf_config, "dense_act_fn", default=None)
    if act_name is None:
        ff_proj = _get(hf_config, "feed_forward_proj", default="relu")
        act_name = "gelu_new" if ff_proj == "gated-gelu" else ff_proj.split("-")[-1]  # as T5Config maps it
        gated = gated or ff_proj.startswith("gated-")
    act_saved, act_out_saved = _act({"a": act_name}, "a", default="relu")
    sbw = s * b * a * cfg["head_dim"]  # q, k, v and the o-projection input: num_heads * d_kv wide
    c32 = 4 * sbh if p != 4 else 0  # T5LayerNorm's fp32 copy of a half-precision input
    ln = 2 * p * sbh + c32 + 4 * s * b
    attn = p * sbh + 3 * p * sbw + scores(drop) + p * sbw + drop_mask(drop, sbh)
    ff = p * sbh + act_saved * p * sbf
    if gated:
        ff += p * sbf + p * sbf  # the product's inputs: the activation output and the linear branch
    if drop and drop > 0:
        ff += mask * sbf + p * sbf
    elif gated or not act_out_saved:
        ff += p * sbf  # the wo input: the product, or an activation output nothing saved yet
    ff += drop_mask(drop, sbh)
    enc_layer = ln + attn + ln + ff
    cross = ln + p * sbh + 3 * p * sbw + scores(drop) + p * sbw + drop_mask(drop, sbh)
    dec_layer = enc_layer + cross
    stack = cfg["layers"] * enc_layer + cfg["decoder_layers"] * dec_layer
    per_stack = ints * s * b + drop_mask(drop, sbh) + ints * s * s + ln + drop_mask(drop, sbh)
    extra = 2 * per_stack + p * sbh + p * sbh  # encoder output (cross K/V input), LM-head input
    if with_loss:
        loss = p * s * b * vocab + ints * s * b + p
    return int(stack + extra + loss)
