"""Bitwise equality of loss and gradients with and without offloading on small
random-init Llama-family models (Llama, Qwen2, Mistral with a sliding window,
Mixtral's and Qwen2-MoE's mixtures of experts): fp32 and bf16, SDPA and eager attention, with
and without HF gradient checkpointing, targets ssd, cpu and auto."""
import contextlib
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ebbtide  # noqa: E402
from ebbtide import _core  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
# Offloaded bytes are asserted: stores finish before backward whatever the load.
pytestmark = pytest.mark.usefixtures("stores_before_backward")


VOCAB = 128
SEQ = 24
MODELS = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: at these sizes a second one only adds a barrier per
    op, which costs 10-100x the op on a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def ssd_available():
    return _core.build_info.get("cache_ssd", False)


def make_model(kind, dtype, attn, experts=None):
    """experts: the MoE models' experts_implementation (None: HF's default,
    grouped_mm where torch has it, else the eager loop)."""
    torch.manual_seed(1234)
    impl = dict(attn_implementation=attn)
    if experts is not None:
        impl["experts_implementation"] = experts
    tf = transformers
    # Grouped-query attention (4 query heads, 2 key/value heads) as in the real models.
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=1)
    if kind == "llama":
        m = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**common), **impl)
    elif kind == "qwen2":
        m = tf.Qwen2ForCausalLM._from_config(tf.Qwen2Config(**common), **impl)
    elif kind == "mistral":
        # A window shorter than the sequence, so the mask differs from plain causal.
        cfg = tf.MistralConfig(sliding_window=8, **common)
        m = tf.MistralForCausalLM._from_config(cfg, **impl)
    elif kind == "mixtral":
        # Top-2 of 4 experts (HF's default grouped_mm sorts the tokens by
        # expert and gathers them); the router's
        # load-balancing loss joins the loss; jitter multiplies the router's
        # input in place by random noise.
        cfg = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                               output_router_logits=True, router_aux_loss_coef=0.02,
                               router_jitter_noise=0.01, **common)
        m = tf.MixtralForCausalLM._from_config(cfg, **impl)
    else:
        # Top-2 of 4 experts beside a shared expert behind a sigmoid gate.
        cfg = tf.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                shared_expert_intermediate_size=128, output_router_logits=True,
                                router_aux_loss_coef=0.02, **common)
        m = tf.Qwen2MoeForCausalLM._from_config(cfg, **impl)
    m = m.to(dtype)
    m.train()
    return m


def make_batch():
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=g)
    return dict(input_ids=ids, labels=ids.clone())


def run(model, batch, ctx=None, before_backward=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = model(**batch).loss
        if before_backward is not None:
            before_backward()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def assert_bitwise(ref, got, what):
    (l0, g0), (l1, g1) = ref, got
    assert torch.equal(l0, l1), f"{what}: loss {l1.item()!r} != {l0.item()!r} without offloading"
    assert g0.keys() == g1.keys(), f"{what}: different parameters have gradients"
    bad = [n for n in g0 if not torch.equal(g0[n], g1[n])]
    assert not bad, f"{what}: gradients differ: {bad[:5]}"


def ssd_param(*values):
    skip = pytest.mark.skipif(not ssd_available(), reason="storage engine not in this build")
    return pytest.param(*values, marks=skip)


# Every pair of (dtype, attention, checkpointing on/off, target) values occurs
# in some row, for every model; the first row is the plain case (fp32, SDPA,
# no checkpointing). Checkpointing is HF's default (non-reentrant) but in one
# row reentrant. "auto" on CPU stores to SSD files (no host tier there).
CASES = [
    ssd_param("fp32", "sdpa", "nockpt", "ssd"),
    ssd_param("bf16", "eager", "ckpt-reentrant", "ssd"),
    pytest.param("fp32", "eager", "ckpt", "cpu"),
    pytest.param("bf16", "sdpa", "nockpt", "cpu"),
    ssd_param("fp32", "sdpa", "ckpt", "auto"),
    ssd_param("bf16", "eager", "nockpt", "auto"),
]


def enable_checkpointing(model, ckpt):
    if ckpt == "nockpt":
        return
    kwargs = {"use_reentrant": ckpt == "ckpt-reentrant"}
    # gradient_checkpointing_enable before transformers 5
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("dtype,attn,ckpt,target", CASES)
@pytest.mark.parametrize("kind", MODELS)
def test_bitwise_equal_to_no_offload(kind, dtype, attn, ckpt, target, tmp_path):
    model = make_model(kind, DTYPES[dtype], attn)
    enable_checkpointing(model, ckpt)
    check_bitwise(model, target, tmp_path, f"{kind} {dtype} {attn} {ckpt} target={target}")


@pytest.mark.parametrize("kind,experts,dtype,attn,ckpt,target", [
    ssd_param("mixtral", "eager", "fp32", "sdpa", "nockpt", "ssd"),
    pytest.param("mixtral", "batched_mm", "bf16", "eager", "ckpt", "cpu"),
    pytest.param("qwen2_moe", "eager", "bf16", "eager", "ckpt", "cpu"),
    ssd_param("qwen2_moe", "batched_mm", "fp32", "sdpa", "nockpt", "ssd"),
])
def test_moe_experts_implementations(kind, experts, dtype, attn, ckpt, target, tmp_path):
    """The experts' other forms: HF's eager loop (a boolean mask per expert,
    index_add_ into a zero buffer) and batched_mm (every token's top-k weights
    gathered into one batched matmul)."""
    model = make_model(kind, DTYPES[dtype], attn, experts=experts)
    assert model.config._experts_implementation == experts
    enable_checkpointing(model, ckpt)
    what = f"{kind} experts={experts} {dtype} {attn} {ckpt} target={target}"
    check_bitwise(model, target, tmp_path, what)


def check_bitwise(model, target, tmp_path, what):
    """Loss and gradients of `model` under a TensorCache (two steps) and under
    ebbtide.offload equal those of the same step without offloading."""
    batch = make_batch()
    ref = run(model, batch)
    # The model itself is deterministic: otherwise no offloading could match it.
    assert_bitwise(ref, run(model, batch), f"{what}: a second step without offloading")
    path = str(tmp_path) if target != "cpu" else None
    cache = ebbtide.TensorCache(target=target, path=path, min_bytes=0, keep_last_modules=1)
    cache.attach(model)
    try:
        # Step 1 waits for every store before backward, so that backward
        # reloads what was offloaded instead of answering from tensors whose
        # stores had not finished; step 2 runs at its own pace with the plan
        # learned in step 1 (auto: the profiled plan).
        for i in range(2):
            got = run(model, batch, cache.step(), before_backward=cache.drain if i == 0 else None)
            assert_bitwise(ref, got, f"{what}, step {i + 1}")
            s = cache.stats()
            assert s["tensors_saved"] > 0
            assert s["peak_resident_bytes"] <= s["saved_bytes_total"]
            assert s["entries"] == 0, f"{what}: {s['entries']} entries left after backward"
            if i == 0:
                # Every offloaded byte came back once: by a reload or from a
                # tensor still held elsewhere (the input ids).
                assert s["bytes_offloaded"] > 0 and s["tensors_forwarded"] == 0, s
                assert s["bytes_reloaded"] > 0, f"{what}: nothing reloaded: {s}"
                assert s["bytes_reloaded"] + s["bytes_reused"] == s["bytes_offloaded"], s
    finally:
        cache.close()
    # The one-shot form.
    with ebbtide.offload(model, target=target, path=path, min_bytes=0) as c:
        got = run(model, batch, before_backward=c.drain)
    assert_bitwise(ref, got, f"{what}, ebbtide.offload")
    s = c.stats()
    assert s["bytes_offloaded"] > 0 and s["entries"] == 0, s
    if path is not None:
        assert list(tmp_path.iterdir()) == []
