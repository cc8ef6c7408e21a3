"""Every "Use it with your trainer" snippet of README.md runs, on tiny models,
and offloads (EBBTIDE_MIN_BYTES=0: the tiny activations count). Snippets are
the fenced python blocks after a `<!-- snippet: NAME -->` line."""
import contextlib
import os
import re
import warnings

import pytest
import torch

from integration_models import (VOCAB, deepspeed_pipeline_engine, lit_llama, local_ray, one_rank_deepspeed, tiny_llama,
                                token_rows)

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
_SNIPPET = re.compile(r"<!-- snippet: (\S+) -->\n```python\n(.*?)```", re.S)


def _snippets():
    with open(README) as f:
        return {m.group(1): m.group(2) for m in _SNIPPET.finditer(f.read())}


def test_readme_has_every_snippet():
    assert set(_snippets()) == {"hf", "accelerate", "lightning", "torchtune", "deepspeed", "ray"}


def _caches_in(ns):
    import ebbtide

    found = []
    for v in ns.values():
        c = getattr(v, "cache", v)
        if isinstance(c, ebbtide.TensorCache):
            found.append(c)
    return found


def _hf_ns(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, max_steps=1, report_to=[],
                                          save_strategy="no", logging_strategy="no", use_cpu=True,
                                          disable_tqdm=True)
    rows = token_rows(12)
    return dict(model=tiny_llama(), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])


def _accelerate_ns(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = token_rows(12)
    loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in rows], batch_size=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    return dict(accelerator=accelerator, model=model, optimizer=opt, loader=loader)


def _lightning_ns(tmp_path):
    pytest.importorskip("pytorch_lightning")
    return dict(lit_module=lit_llama(), loader=torch.utils.data.DataLoader(token_rows(12), batch_size=2))


def _torchtune_ns(tmp_path):
    pytest.importorskip("torchtune.training")
    from torchtune.models.llama2 import llama2

    torch.manual_seed(0)
    rows = token_rows(2)
    model = llama2(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64)
    return dict(model=model, tokens=rows[:, :-1], labels=rows[:, 1:],
                loss_fn=lambda logits, labels: torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                                                labels.flatten()))


def _deepspeed_ns(tmp_path):
    pytest.importorskip("deepspeed.pipe")
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64)
    gpt2 = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = gpt2.transformer.wte, gpt2.transformer.wpe

        def forward(self, ids):
            return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))

    class Block(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            y = self.block(x)
            return y[0] if isinstance(y, tuple) else y

    layers = [Embed(), *(Block(b) for b in gpt2.transformer.h), gpt2.transformer.ln_f,
              torch.nn.Linear(32, VOCAB, bias=False)]

    def loss_fn(logits, ids):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    rows = token_rows(4)
    return dict(engine=deepspeed_pipeline_engine(layers, loss_fn), data_iter=iter([(r, r) for r in rows.split(2)]))


def _ray_ns(tmp_path):
    pytest.importorskip("ray.train.torch")

    def make_model():  # local: pickled by value to the workers
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                                         torch.nn.Linear(128, 32)) for _ in range(2)))

    return dict(torch=torch, make_model=make_model, batches=list(torch.randn(2, 4, 32)),
                nvme_dir=str(tmp_path / "nvme"))


_NAMESPACES = {"hf": _hf_ns, "accelerate": _accelerate_ns, "lightning": _lightning_ns, "torchtune": _torchtune_ns,
               "deepspeed": _deepspeed_ns, "ray": _ray_ns}


def _context(name, monkeypatch, tmp_path):
    if name == "deepspeed":
        return one_rank_deepspeed(monkeypatch)
    if name == "ray":
        return local_ray(monkeypatch, tmp_path / "ray_results")
    return contextlib.nullcontext()


@pytest.mark.parametrize("name", sorted(_NAMESPACES))
def test_readme_snippet_runs_and_offloads(name, tmp_path, monkeypatch, stores_before_backward):
    code = _snippets()[name]
    monkeypatch.setenv("EBBTIDE_MIN_BYTES", "0")
    monkeypatch.chdir(tmp_path)  # Lightning writes its logs and checkpoints here
    with _context(name, monkeypatch, tmp_path):
        ns = _NAMESPACES[name](tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(code, f"README.md snippet {name}", "exec"), ns)
    if name == "ray":  # the caches lived in the workers: rank 0 reported its bytes
        assert ns["result"].metrics["bytes_offloaded"] > 0
        assert sorted(os.listdir(ns["nvme_dir"])) == ["rank0", "rank1"]
        return
    caches = _caches_in(ns)
    assert len(caches) == 1, f"snippet {name}: expected one TensorCache, found {len(caches)}"
    assert caches[0].stats()["total"]["bytes_offloaded"] > 0
    caches[0].close()
    if name == "deepspeed":
        from ebbtide.integrations.pipeline import restore_deepspeed_pipeline

        restore_deepspeed_pipeline(ns["engine"])  # the engine outlives the test (DeepSpeed's hooks)
