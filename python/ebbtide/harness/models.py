"""The harness's models: random-init HF transformers (nothing is downloaded)
of the families people train (Llama, Qwen2, Mistral, Mixtral; GPT-2, BERT,
T5), built at a size chosen per device kind, for ``ebbtide demo``, ``ebbtide
rok`` and the benchmarks in bench/.
"""
import contextlib

# Llama-family decoders first (the default: the architecture people train
# today), then the older GPT-2, BERT and T5.
MODELS = ("llama", "qwen2", "mistral", "mixtral", "gpt2", "bert", "t5")
DEFAULT_MODEL = "llama"
ATTENTION = ("eager", "sdpa")

# (layers, hidden, heads, seq, batch) per device kind. CPU: the default demo
# (4 timed steps of 5 methods) is meant to run in under a minute on 2 cores
# (docs/benchmarks.md, "ebbtide demo"); larger on a GPU.
SIZES = {
    "cpu": dict(layers=4, hidden=256, heads=8, seq=256, batch=4),
    "cuda": dict(layers=12, hidden=1024, heads=16, seq=1024, batch=8),
}
VOCAB = 8192


def enable_hf_recompute(model, use_reentrant=False):
    """Turns on HF activation checkpointing (recompute) on `model` and returns
    the function that turns it off: activation_checkpointing_enable from
    transformers 5, gradient_checkpointing_enable (deprecated there, to be
    removed in 6) before."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return model.activation_checkpointing_disable
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.gradient_checkpointing_disable


def build_model(name, layers, hidden, heads, seq, dtype, device, attn="eager"):
    """A random-init HF model and a function making its training batch.

    Args:
        name: one of MODELS.
        layers, hidden, heads, seq: the transformer's shape (seq = positions).
        dtype, device: where and in which precision the weights live.
        attn: "eager" (HF's own matmul-softmax attention, which saves the
            score matrices) or "sdpa" (torch's fused scaled_dot_product_attention).

    Returns:
        (model, make_batch); make_batch(batch, generator) -> the model's kwargs.

    Raises:
        ValueError: an unknown model or attention.
    """
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    if attn not in ATTENTION:
        raise ValueError(f"--attn {attn!r} is not one of {', '.join(ATTENTION)}")

    # use_cache=False: a training step needs no KV cache (HF would fill one, and
    # its state changes between calls, recompiling compiled blocks).
    common = dict(vocab_size=VOCAB, attn_implementation=attn, use_cache=False)
    # Built on the device: a large model's random init runs there, not on the host.
    with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
        model = _make_hf_model(tf, name, layers, hidden, heads, seq, common)
    model.to(device=device, dtype=dtype)
    model.train()

    def make_batch(batch, generator):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=generator).to(device)
        if name == "t5":
            labels = torch.randint(1, VOCAB, (batch, max(seq // 4, 8)), generator=generator)
            return dict(input_ids=ids, labels=labels.to(device))
        return dict(input_ids=ids, labels=ids)

    return model, make_batch


def _llama_family_config(tf, name, layers, hidden, heads, seq, common):
    """The config of a Llama-family decoder: RMSNorm, rotary positions, a
    SwiGLU MLP about 8/3 as wide as the model (rounded up to 64, as Llama
    rounds), grouped-query attention with a quarter as many key/value heads
    when the heads divide by 4 (Llama 3's 32:8). qwen2 adds q/k/v biases (its
    config's default), mistral a sliding window of half the sequence, mixtral
    top-2 routing over 4 experts, each with that MLP, and the router's
    load-balancing loss."""
    shape = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                 num_key_value_heads=heads // 4 if heads % 4 == 0 else heads,
                 intermediate_size=-(-8 * hidden // (3 * 64)) * 64, max_position_embeddings=seq,
                 pad_token_id=0, bos_token_id=0, eos_token_id=0, **common)
    if name == "llama":
        return tf.LlamaConfig(**shape), tf.LlamaForCausalLM
    if name == "qwen2":
        return tf.Qwen2Config(**shape), tf.Qwen2ForCausalLM
    if name == "mistral":
        return tf.MistralConfig(sliding_window=max(seq // 2, 1), **shape), tf.MistralForCausalLM
    cfg = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           **shape)
    return cfg, tf.MixtralForCausalLM


def _make_hf_model(tf, name, layers, hidden, heads, seq, common):
    if name in ("llama", "qwen2", "mistral", "mixtral"):
        cfg, cls = _llama_family_config(tf, name, layers, hidden, heads, seq, common)
        model = cls(cfg)
    elif name == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq,
                            bos_token_id=0, eos_token_id=0, **common)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=hidden,
                            num_attention_heads=heads, intermediate_size=4 * hidden,
                            max_position_embeddings=seq, **common)
        model = tf.BertForMaskedLM(cfg)
    elif name == "t5":
        cfg = tf.T5Config(num_layers=layers, num_decoder_layers=layers, d_model=hidden,
                          num_heads=heads, d_kv=hidden // heads, d_ff=4 * hidden,
                          decoder_start_token_id=0, pad_token_id=0, **common)
        model = tf.T5ForConditionalGeneration(cfg)
    else:
        raise ValueError(f"--model {name!r} is not one of {', '.join(MODELS)}")
    return model


def resolve_size(device, **overrides):
    """SIZES for the device kind with the given (non-None) overrides, checked."""
    size = dict(SIZES["cuda" if device.type == "cuda" else "cpu"])
    for k, v in overrides.items():
        if v is not None:
            if v <= 0:
                raise ValueError(f"--{k} must be positive, got {v}")
            size[k] = v
    if size["hidden"] % size["heads"]:
        raise ValueError(f"--hidden {size['hidden']} is not divisible by --heads {size['heads']}")
    return size
