"""Tiny random-init models and data shared by the test_integrations_* files."""
import torch

VOCAB = 128
SEQ = 32


def tiny_llama(seed=0):
    """A 2-layer LlamaForCausalLM, hidden 32, random init (nothing downloaded)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")


def token_rows(n, seed=0):
    """n rows of SEQ random token ids (no padding)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, SEQ), generator=g)


def assert_same_params(a, b):
    """Every parameter of module `a` is bitwise equal to the one of the same name in `b`."""
    pb = dict(b.named_parameters())
    diff = [name for name, p in a.named_parameters() if not torch.equal(p.detach(), pb[name].detach())]
    assert not diff, f"parameters differ from the run without offloading: {diff}"


def assert_changed(a, b):
    """Training moved at least one parameter (so equality above is not vacuous)."""
    pb = dict(b.named_parameters())
    assert any(not torch.equal(p.detach(), pb[n].detach()) for n, p in a.named_parameters()), \
        "training changed no parameter"
