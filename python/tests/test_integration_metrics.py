"""ebbtide's per-step numbers in the frameworks' logs: a Hugging Face Trainer's
log_history (and a callback placed where report_to integrations sit) and a
Lightning CSVLogger's metrics.csv, each after 3 optimizer steps of a tiny Llama."""
import csv
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from integration_models import tiny_llama, token_rows  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
# Offloaded bytes are asserted: stores finish before backward whatever the load.
pytestmark = pytest.mark.usefixtures("stores_before_backward")

METRICS = ("ebbtide/bytes_offloaded", "ebbtide/stall_seconds", "ebbtide/peak_resident_bytes",
           "ebbtide/offloaded_fraction")
PLAN = ("ebbtide/plan_kept_blocks", "ebbtide/plan_offloaded_blocks", "ebbtide/plan_predicted_stall_seconds")


def _check(row, adaptive=False):
    assert float(row["ebbtide/bytes_offloaded"]) > 0
    assert float(row["ebbtide/stall_seconds"]) >= 0
    assert float(row["ebbtide/peak_resident_bytes"]) >= 0
    assert 0 < float(row["ebbtide/offloaded_fraction"]) <= 1
    if adaptive:
        assert int(float(row["ebbtide/plan_kept_blocks"])) + int(float(row["ebbtide/plan_offloaded_blocks"])) > 0


class _Reporter(transformers.TrainerCallback):
    """Sees on_log where W&B, TensorBoard and MLflow do: before the user's callbacks."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_hf_trainer_logs_metrics(tmp_path, adaptive):
    from ebbtide.integrations.hf import OffloadCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-2, report_to=[], save_strategy="no", logging_strategy="steps", logging_steps=1,
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    rows = token_rows(12)
    reporter, cb = _Reporter(), OffloadCallback(target="cpu", min_bytes=0, adaptive=adaptive)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, callbacks=[reporter, cb],
                                   train_dataset=[{"input_ids": r, "labels": r.clone()} for r in rows])
    trainer.train()

    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2, 3]
    for h in steps:
        _check(h)
        assert isinstance(h["ebbtide/bytes_offloaded"], int)
    assert not any(k.startswith("ebbtide/") for k in trainer.state.log_history[-1])  # the train() summary
    if adaptive:  # planned after the first (profiling) step
        _check(steps[-1], adaptive=True)
    else:
        assert not any(k in h for h in steps for k in PLAN)
    seen = [r for r in reporter.logs if "loss" in r]
    assert [{k: r[k] for k in METRICS} for r in seen] == [{k: h[k] for k in METRICS} for h in steps]


def test_hf_metrics_window_sums_steps(tmp_path):
    """logging_steps=2: one log for steps 1-2 sums both steps' bytes, and the window then restarts."""
    from ebbtide.integrations.hf import OffloadCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2, report_to=[],
        save_strategy="no", logging_strategy="steps", logging_steps=2, use_cpu=True, seed=0, data_seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    rows = token_rows(8)
    cb = OffloadCallback(target="cpu", min_bytes=0)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, callbacks=[cb],
                                   train_dataset=[{"input_ids": r, "labels": r.clone()} for r in rows])
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [2, 4]
    assert sum(h["ebbtide/bytes_offloaded"] for h in steps) == cb.cache.stats()["total"]["bytes_offloaded"]


def test_lightning_csv_logger_metrics(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.loggers import CSVLogger

    from ebbtide.integrations.lightning import OffloadCallback

    class LitLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    cb = OffloadCallback(target="cpu", min_bytes=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, log_every_n_steps=1,
                         logger=CSVLogger(str(tmp_path)), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
        trainer.fit(LitLlama(), torch.utils.data.DataLoader(token_rows(12), batch_size=2))

    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["ebbtide/bytes_offloaded"]]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for r in rows:
        _check(r)
    total = cb.cache.stats()["total"]["bytes_offloaded"]
    assert sum(int(r["ebbtide/bytes_offloaded"]) for r in rows) == total  # 2 batches a step, nothing lost
