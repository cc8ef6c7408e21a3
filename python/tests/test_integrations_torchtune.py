"""torchtune: ebbtide's get_act_offloading_ctx_manager in a recipe-style loop
(forward inside the context, loss and backward outside) on a torchtune Llama2
decoder: 3 optimizer steps with gradient accumulation 2, parameters bitwise
equal to the same loop with torchtune's offloading disabled."""
import pytest
import torch

training = pytest.importorskip("torchtune.training")
from torchtune.models.llama2 import llama2  # noqa: E402

from integration_models import VOCAB, assert_changed, assert_same_params, token_rows  # noqa: E402

from ebbtide.integrations import torchtune as ebb_tt  # noqa: E402


# Offloaded bytes are asserted: stores finish before backward whatever the load.
pytestmark = pytest.mark.usefixtures("stores_before_backward")


def _model():
    torch.manual_seed(0)
    return llama2(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
                  intermediate_dim=64)


def _recipe_loop(get_ctx, enable):
    """What torchtune's full_finetune_single_device recipe does per step, on a tiny model."""
    model = _model()
    ctx = get_ctx(model, enable)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = token_rows(12)
    for step in range(3):
        for mb in range(2):
            tokens = rows[(2 * step + mb) * 2:(2 * step + mb + 1) * 2]
            with ctx:
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / 2
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, ctx


def _ebbtide(model, enable):
    return ebb_tt.get_act_offloading_ctx_manager(model, enable, target="cpu", min_bytes=0)


def test_torchtune_drop_in_bitwise():
    ref, _ = _recipe_loop(training.get_act_offloading_ctx_manager, False)
    got, ctx = _recipe_loop(_ebbtide, True)
    try:
        assert_same_params(got, ref)
        assert_changed(got, _model())
        assert ctx.cache.stats()["steps"] == 6  # one cache step per forward
        assert ctx.cache.stats()["total"]["bytes_offloaded"] > 0
    finally:
        ctx.close()


def test_torchtune_disabled_is_null_context():
    import contextlib

    assert isinstance(_ebbtide(_model(), False), contextlib.nullcontext)


def test_torchtune_install_replaces_the_recipe_function():
    previous = ebb_tt.install(target="cpu", min_bytes=0)
    try:
        ctx = training.get_act_offloading_ctx_manager(_model(), True)  # as a recipe's setup() calls it
        assert isinstance(ctx, ebb_tt.OffloadActivations)
        assert ctx.cache.min_bytes == 0 and ctx.cache.target == "cpu"  # install()'s settings
        ctx.close()
    finally:
        training.get_act_offloading_ctx_manager = previous
    assert training.get_act_offloading_ctx_manager is previous


def test_torchtune_drop_in_with_an_activation_budget(tmp_path, monkeypatch):
    from test_cache_budget import PLACEMENT_SETS, force

    ref, _ = _recipe_loop(training.get_act_offloading_ctx_manager, False)
    force(monkeypatch, PLACEMENT_SETS["recompute"])

    def budgeted(model, enable):
        return ebb_tt.get_act_offloading_ctx_manager(model, enable, target="ssd", path=str(tmp_path), min_bytes=0,
                                                     keep_last_modules=0, activation_budget_bytes=1 << 30)

    got, ctx = _recipe_loop(budgeted, True)
    try:
        assert_same_params(got, ref)
        assert ctx.cache.stats()["activation_budget_bytes"] == 1 << 30
        assert ctx.cache.stats()["recomputed_blocks"]
    finally:
        ctx.close()
