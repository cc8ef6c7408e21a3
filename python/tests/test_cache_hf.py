"""Bitwise equality of loss and gradients with and without offloading, on small
random-init Hugging Face models (GPT-2, BERT, T5), fp32 and bf16, both targets."""
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


def ssd_available():
    return _core.build_info.get("cache_ssd", False)


def make_model(kind, dtype):
    torch.manual_seed(1234)
    tf = transformers
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                            bos_token_id=0, eos_token_id=0)
        m = tf.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    elif kind == "bert":
        cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64)
        m = tf.BertForMaskedLM._from_config(cfg, attn_implementation="eager")
    else:
        cfg = tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=128,
                          vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        m = tf.T5ForConditionalGeneration._from_config(cfg, attn_implementation="eager")
    m = m.to(dtype)
    m.train()  # dropout active: every run reseeds identically
    return m


def batch_for(kind):
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(2, VOCAB, (2, 24), generator=g)
    return dict(input_ids=ids, labels=ids.clone())


def run(model, batch, ctx=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = model(**batch).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def assert_bitwise(ref, got):
    (l0, g0), (l1, g1) = ref, got
    assert torch.equal(l0, l1), (l0, l1)
    assert g0.keys() == g1.keys()
    bad = [n for n in g0 if not torch.equal(g0[n], g1[n])]
    assert not bad, f"gradients differ: {bad[:5]}"


TARGETS = ["cpu", pytest.param("ssd", marks=pytest.mark.skipif(not ssd_available(),
                                                                 reason="storage engine not in this build"))]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gpt2", "bert", "t5"])
def test_bitwise_equal_to_no_offload(kind, dtype, target, tmp_path):
    model = make_model(kind, dtype)
    batch = batch_for(kind)
    ref = run(model, batch)
    cache = ebbtide.TensorCache(target=target, path=str(tmp_path) if target == "ssd" else None,
                                min_bytes=0, keep_last_modules=1)
    cache.attach(model)
    try:
        for _ in range(2):  # the second step runs with the plan learned in the first
            got = run(model, batch, cache.step())
            assert_bitwise(ref, got)
            s = cache.stats()
            assert s["tensors_offloaded"] + s["tensors_forwarded"] > 0
            assert s["peak_resident_bytes"] <= s["saved_bytes_total"]
            assert s["entries"] == 0  # the graph is gone: every entry released
    finally:
        cache.close()
    # The one-shot form.
    with ebbtide.offload(model, target=target, path=str(tmp_path) if target == "ssd" else None,
                         min_bytes=0) as c:
        got = run(model, batch)
    assert_bitwise(ref, got)
    assert c.stats()["tensors_saved"] > 0
    if target == "ssd":
        assert list(tmp_path.iterdir()) == []
