"""The performance model's saved bytes per step (family llama, Note [Layer
families] in cpp/src/plan/model.cpp) against what the tensor cache measures
(saved_bytes_total) for tiny random-init Llama, Qwen2, Mistral, Mixtral and
Qwen2-MoE causal LMs, fp32 and bf16, SDPA and eager attention: within 2%."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ebbtide  # noqa: E402
from ebbtide.plan.model import activation_bytes, config_from_hf, predicted_saved_bytes  # noqa: E402

SEQ, BATCH, VOCAB = 64, 2, 256
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256)


def _config(name):
    if name == "llama":
        return transformers.LlamaConfig(**SHAPE), transformers.LlamaForCausalLM
    if name == "llama_head_dim":  # attention 4 x 32 wide on a hidden of 64 (Qwen3 and Gemma do this)
        return transformers.LlamaConfig(**SHAPE, head_dim=32), transformers.LlamaForCausalLM
    if name == "qwen2":
        return transformers.Qwen2Config(**SHAPE), transformers.Qwen2ForCausalLM
    if name == "mistral":
        return transformers.MistralConfig(**SHAPE, sliding_window=None), transformers.MistralForCausalLM
    if name == "mixtral":
        return (transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
                transformers.MixtralForCausalLM)
    return (transformers.Qwen2MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                        shared_expert_intermediate_size=80),
            transformers.Qwen2MoeForCausalLM)


def _measure(name, dtype, attn, path):
    torch.manual_seed(0)
    cfg, cls = _config(name)
    cfg._attn_implementation = attn
    model = cls(cfg).to(dtype).train()
    path.mkdir(exist_ok=True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with ebbtide.offload(model, target="ssd", path=str(path)) as cache:
        model(input_ids=ids, labels=ids).loss.backward()
    return model, cache.stats()["saved_bytes_total"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "llama_head_dim", "qwen2", "mistral", "mixtral", "qwen2_moe"])
def test_predicted_bytes_match_cache(name, dtype, attn, tmp_path):
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model, measured = _measure(name, tdt, attn, tmp_path)
    predicted = predicted_saved_bytes(model.config, SEQ, BATCH, dtype)
    assert measured > 0
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_eager_and_moe_terms_are_what_separates_the_models(tmp_path):
    # The comparison can fail: the SDPA prediction is far from an eager run (the
    # s x s softmax), and a dense prediction is far from the MoE run.
    model, eager = _measure("llama", torch.float32, "eager", tmp_path / "a")
    cfg = config_from_hf(model.config, SEQ, BATCH)
    cfg.update(flash_attn=True, bytes_per_element=4)
    a = activation_bytes(cfg)
    assert abs(a["per_step"] + a["outside"] + a["logits"] - eager) > 0.1 * eager
    model, moe = _measure("mixtral", torch.float32, "sdpa", tmp_path / "b")
    cfg = config_from_hf(model.config, SEQ, BATCH)
    cfg.update(experts=0, top_k=0, bytes_per_element=4)
    a = activation_bytes(cfg)
    assert abs(a["per_step"] + a["outside"] + a["logits"] - moe) > 0.1 * moe


def _mixtral_run(ids, path):
    torch.manual_seed(0)
    cfg, cls = _config("mixtral")
    cfg._attn_implementation = "sdpa"
    model = cls(cfg).train()
    routed = []
    path.mkdir(exist_ok=True)
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: routed.append(o[2]))
    with ebbtide.offload(model, target="ssd", path=str(path)) as cache:
        model(input_ids=ids, labels=ids).loss.backward()
    return cache.stats()["saved_bytes_total"], torch.bincount(routed[0].flatten(), minlength=4)


def test_moe_total_does_not_depend_on_the_routing(tmp_path):
    # HF's grouped_mm experts sort the s*b*k token-expert pairs by expert: the
    # same bytes for any routing, so the prediction needs no per-expert counts.
    spread_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    spread, spread_counts = _mixtral_run(spread_ids, tmp_path / "a")
    same, same_counts = _mixtral_run(torch.ones(BATCH, SEQ, dtype=torch.long), tmp_path / "b")
    # identical tokens stay identical through causal attention: all go to the same two experts
    assert sorted(same_counts.tolist()) == [0, 0, BATCH * SEQ, BATCH * SEQ]
    assert (spread_counts > 0).all()
    assert same == spread
