"""Tiny random-init models and data shared by the test_integrations_* files."""
import contextlib
import tempfile

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


def lit_llama(lr=1e-3):
    """A LightningModule that trains tiny_llama() on batches of token ids (next-token loss)."""
    import pytorch_lightning as pl

    class LitLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

        def training_step(self, batch, batch_idx):
            return self(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    return LitLlama()


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


class one_rank_deepspeed:
    """A gloo process group of this process alone, set up for DeepSpeed
    (its environment variables, and no JIT-compiled shared-memory allreduce:
    a minute of g++ for an optimization DeepSpeed does without). Restores
    everything on exit."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def __enter__(self):
        import importlib

        import deepspeed
        import torch.distributed as dist

        self.mp.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
        for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
            self.mp.setenv(k, v)
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        deepspeed.init_distributed(dist_backend="gloo")
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()


def deepspeed_pipeline_engine(layers, loss_fn):
    """A DeepSpeed PipelineEngine of one stage over `layers`: batches of 2 rows,
    gradient accumulation 2, AdamW lr 1e-2 (inside one_rank_deepspeed)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    net = PipelineModule(layers=layers, num_stages=1, loss_fn=loss_fn, partition_method="uniform")
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return engine


@contextlib.contextmanager
def local_ray(monkeypatch, results_dir, by_value=()):
    """Ray on 2 CPUs for one test: no dashboard, no token authentication, its
    session files in a short temporary directory (they hold Unix sockets,
    whose paths have at most 107 bytes), Ray Train's results in
    `results_dir`, the modules `by_value` pickled by value (workers cannot
    import test modules). Shut down on exit."""
    import ray
    import ray.train.constants

    monkeypatch.setattr(ray.train.constants, "DEFAULT_STORAGE_PATH", str(results_dir))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a local cluster: no token written to ~/.ray
    for m in by_value:
        ray.cloudpickle.register_pickle_by_value(m)
    try:
        with tempfile.TemporaryDirectory(prefix="ebbray") as session:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     _temp_dir=session, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
            try:
                yield
            finally:
                ray.shutdown()
    finally:
        for m in by_value:
            ray.cloudpickle.unregister_pickle_by_value(m)
