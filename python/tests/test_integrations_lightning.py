"""PyTorch Lightning with ebbtide's OffloadCallback: 3 optimizer steps with
accumulate_grad_batches=2 end with parameters bitwise equal to no offloading."""
import logging
import warnings

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")

from integration_models import assert_changed, assert_same_params, tiny_llama, token_rows  # noqa: E402

from ebbtide.integrations.lightning import OffloadCallback  # noqa: E402

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


# Offloaded bytes are asserted: stores finish before backward whatever the load.
pytestmark = pytest.mark.usefixtures("stores_before_backward")


class LitLlama(pl.LightningModule):
    def __init__(self, call_submodule=False):
        super().__init__()
        self.model = tiny_llama()
        self.call_submodule = call_submodule

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss if self.call_submodule else self(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(callbacks, call_submodule=False):
    lit = LitLlama(call_submodule)
    loader = torch.utils.data.DataLoader(token_rows(12), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
        trainer.fit(lit, loader)
    assert trainer.global_step == 3
    return lit.model


@pytest.mark.parametrize("call_submodule", [False, True], ids=["self", "submodule"])
def test_lightning_callback_bitwise(call_submodule):
    ref = _fit([], call_submodule)
    cb = OffloadCallback(target="cpu", min_bytes=0, module="model" if call_submodule else None)
    got = _fit([cb], call_submodule)
    assert_same_params(got, ref)
    assert_changed(got, tiny_llama())
    stats = cb.cache.stats()
    assert stats["steps"] == 6  # one cache step per batch: 3 optimizer steps x 2 batches
    assert stats["total"]["bytes_offloaded"] > 0


def test_lightning_callback_bad_module():
    with pytest.raises(AttributeError, match="has no attribute 'decoder'"):
        _fit([OffloadCallback(target="cpu", module="decoder")])


def test_lightning_exception_releases_the_step():
    class Failing(LitLlama):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise KeyError("boom")
            return super().training_step(batch, batch_idx)

    cb = OffloadCallback(target="cpu", min_bytes=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with warnings.catch_warnings(), pytest.raises(KeyError, match="boom"):
        warnings.simplefilter("ignore")
        trainer.fit(Failing(), torch.utils.data.DataLoader(token_rows(8), batch_size=2))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # on_exception ended the step
    assert cb.cache.stats()["steps"] == 2  # the first batch's and the failed one's
    cb.cache.close()


def test_lightning_callback_with_an_activation_budget(tmp_path, monkeypatch):
    from test_cache_budget import PLACEMENT_SETS, force

    ref = _fit([])
    force(monkeypatch, PLACEMENT_SETS["mix"])
    cb = OffloadCallback(target="ssd", path=str(tmp_path), min_bytes=0, keep_last_modules=0,
                         activation_budget_bytes=1 << 30)
    got = _fit([cb])
    assert_same_params(got, ref)
    stats = cb.cache.stats()
    assert stats["activation_budget_bytes"] == 1 << 30
    assert stats["recomputed_blocks"]
