"""A tiny Lightning run (python/tests/test_switch.py), with no ebbtide in it
unless --by-hand adds the callback. Writes the parameters' SHA-256 and the
CSV logger's metrics to OUT."""
import csv
import hashlib
import json
import sys
import warnings

import pytorch_lightning as pl
import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # python/tests: integration_models
from integration_models import lit_llama, token_rows  # noqa: E402

out, by_hand = sys.argv[1], "--by-hand" in sys.argv
callbacks = []
if by_hand:
    from ebbtide.integrations.lightning import OffloadCallback

    callbacks.append(OffloadCallback(target="cpu"))
lit = lit_llama(lr=1e-2)
logger = pl.loggers.CSVLogger(out + ".d", name="run", version=0)
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, logger=logger,
                     log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=callbacks)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
    trainer.fit(lit, torch.utils.data.DataLoader(token_rows(12), batch_size=2))
logger.finalize("success")
rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
params = {n: hashlib.sha256(p.detach().numpy().tobytes()).hexdigest() for n, p in lit.model.named_parameters()}
json.dump({"params": params, "metrics": rows,
           "callbacks": [type(c).__module__ + "." + type(c).__name__ for c in trainer.callbacks]}, open(out, "w"))
