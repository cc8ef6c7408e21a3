"""A tiny HF Trainer run (python/tests/test_switch.py): trains as a user's
script does, with no ebbtide in it unless --by-hand adds the callback.
Writes the parameters' SHA-256 and the Trainer's log_history to OUT."""
import hashlib
import json
import sys

import torch
import transformers

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # python/tests: integration_models
from integration_models import tiny_llama, token_rows  # noqa: E402

out, by_hand = sys.argv[1], "--by-hand" in sys.argv
callbacks = []
if by_hand:
    from ebbtide.integrations.hf import OffloadCallback

    callbacks.append(OffloadCallback(target="cpu"))
model = tiny_llama()
args = transformers.TrainingArguments(
    output_dir=out + ".d", per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
    learning_rate=1e-2, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0, data_seed=0,
    disable_tqdm=True, dataloader_num_workers=0)
data = [{"input_ids": r, "labels": r.clone()} for r in token_rows(12)]
trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
trainer.train()
params = {n: hashlib.sha256(p.detach().to(torch.float32).numpy().tobytes()).hexdigest()
          for n, p in model.named_parameters()}
json.dump({"params": params, "log_history": trainer.state.log_history,
           "callbacks": [type(c).__module__ + "." + type(c).__name__ for c in trainer.callback_handler.callbacks]},
          open(out, "w"))
