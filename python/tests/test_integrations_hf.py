"""Hugging Face Trainer and TRL SFTTrainer with ebbtide's OffloadCallback, and an
Accelerate loop: 3 optimizer steps with gradient accumulation 2 end with
parameters bitwise equal to the same run without offloading."""
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from integration_models import assert_changed, assert_same_params, tiny_llama, token_rows  # noqa: E402

from ebbtide.integrations.hf import OffloadCallback  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
# Offloaded bytes are asserted: stores finish before backward whatever the load.
pytestmark = pytest.mark.usefixtures("stores_before_backward")


CACHE = dict(target="cpu", min_bytes=0)


def _dataset():
    rows = token_rows(12)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _args(tmp_path, **kw):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-2, report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0, **kw)


def _train(tmp_path, callbacks, **kw):
    model = tiny_llama()
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, **kw), train_dataset=_dataset(),
                                   callbacks=callbacks)
    trainer.train()
    return model


def test_trainer_callback_bitwise(tmp_path):
    ref = _train(tmp_path / "ref", [])
    cb = OffloadCallback(**CACHE)
    got = _train(tmp_path / "got", [cb])
    assert_same_params(got, ref)
    assert_changed(got, tiny_llama())
    assert cb.cache.stats()["steps"] == 3  # one cache step per optimizer step
    assert cb.cache.stats()["total"]["bytes_offloaded"] > 0
    assert cb.cache.closed  # owned: closed at the end of training


def test_trainer_callback_bf16_checkpointing_given_cache(tmp_path):
    import ebbtide

    extra = dict(bf16=True, activation_checkpointing=True)
    ref = _train(tmp_path / "ref", [], **extra)
    with ebbtide.TensorCache(**CACHE) as cache:
        got = _train(tmp_path / "got", [OffloadCallback(cache=cache)], **extra)
        assert got.is_activation_checkpointing
        assert not cache.closed  # borrowed: the caller closes it
        assert cache.stats()["total"]["bytes_offloaded"] > 0
    assert_same_params(got, ref)
    assert_changed(got, tiny_llama())


def test_callback_close_after_failed_train(tmp_path):
    class Boom(transformers.TrainerCallback):
        def on_substep_end(self, *a, **k):  # after the first micro-batch's backward, inside the step
            raise KeyError("boom")

    cb = OffloadCallback(**CACHE)
    model = tiny_llama()
    trainer = transformers.Trainer(model=model, args=_args(tmp_path), train_dataset=_dataset(),
                                   callbacks=[cb, Boom()])
    with pytest.raises(KeyError, match="boom"):
        trainer.train()
    top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
    assert top_hooks(False) is not None  # the exception skipped the callbacks: the step's hooks stay
    cb.close()
    assert top_hooks(False) is None
    assert cb.cache.closed


def test_callback_rejects_cache_and_settings():
    import ebbtide

    with ebbtide.TensorCache(target="cpu") as cache:
        with pytest.raises(ValueError, match="either cache="):
            OffloadCallback(target="cpu", cache=cache)


def _tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1",
                                                eos_token="t2", unk_token="t0")


def _sft(tmp_path, callbacks):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    ds = datasets.Dataset.from_dict({"input_ids": [r.tolist() for r in token_rows(12)]})
    cfg = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        max_steps=3, learning_rate=1e-2, report_to=[], save_strategy="no", logging_strategy="no",
                        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
                        max_length=32, packing=False)
    model = tiny_llama()
    trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=_tokenizer(),
                   callbacks=callbacks).train()
    return model


def test_trl_sft_trainer_callback_bitwise(tmp_path):
    ref = _sft(tmp_path / "ref", [])
    cb = OffloadCallback(**CACHE)
    got = _sft(tmp_path / "got", [cb])
    assert_same_params(got, ref)
    assert_changed(got, tiny_llama())
    assert cb.cache.stats()["total"]["bytes_offloaded"] > 0


def _accelerate_loop(cache):
    accelerate = pytest.importorskip("accelerate")

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = token_rows(12)
    loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in rows], batch_size=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if cache is not None:
        cache.attach(model)
    for i, batch in enumerate(loader):
        if i == 6:
            break
        with accelerator.accumulate(model):
            if cache is None:
                accelerator.backward(model(**batch).loss)
            else:
                with cache.step():
                    accelerator.backward(model(**batch).loss)
            opt.step()
            opt.zero_grad()
    return accelerator.unwrap_model(model)


def test_accelerate_loop_bitwise():
    import ebbtide

    ref = _accelerate_loop(None)
    with ebbtide.TensorCache(**CACHE) as cache:
        got = _accelerate_loop(cache)
        assert cache.stats()["total"]["bytes_offloaded"] > 0
    assert_same_params(got, ref)
    assert_changed(got, tiny_llama())


def test_trainer_callback_with_an_activation_budget(tmp_path, monkeypatch):
    """The budget keyword reaches the cache; blocks the plan recomputes (forced
    here: Note [Budget plan]) keep the run bitwise."""
    from test_cache_budget import PLACEMENT_SETS, force

    ref = _train(tmp_path / "ref", [])
    force(monkeypatch, PLACEMENT_SETS["recompute_offload"])
    (tmp_path / "ssd").mkdir()
    cb = OffloadCallback(target="ssd", path=str(tmp_path / "ssd"), min_bytes=0, keep_last_modules=0,
                         activation_budget_bytes=1 << 30)
    got = _train(tmp_path / "got", [cb])
    assert_same_params(got, ref)
    stats = cb.cache.stats()
    assert stats["activation_budget_bytes"] == 1 << 30
    assert stats["recomputed_blocks"]
