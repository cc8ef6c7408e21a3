"""Run by test_integrations_pipeline.py under torchrun with 2 ranks: a real
DeepSpeed PipelineEngine with 2 stages (gloo), 3 train_batch calls of 4
micro-batches, first without offloading and then with
offload_deepspeed_pipeline; each rank saves both runs' parameters and its
cache's statistics to DIR/rank<R>.pt.

    torchrun --standalone --nproc_per_node 2 deepspeed_two_stages.py DIR
"""
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


def run(offload):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from integration_models import token_rows
    from test_integrations_pipeline import _lm_loss, _stages

    from ebbtide.integrations.pipeline import offload_deepspeed_pipeline, restore_deepspeed_pipeline

    first, last = _stages()
    net = PipelineModule(layers=[first, last], num_stages=2, loss_fn=_lm_loss, partition_method="uniform")
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    cache = offload_deepspeed_pipeline(engine, target="cpu", min_bytes=0, keep_last_modules=0) if offload else None
    rows = token_rows(24)
    it = iter([(rows[i * 2:(i + 1) * 2], rows[i * 2:(i + 1) * 2]) for i in range(12)])
    for _ in range(3):
        engine.train_batch(it)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    stats = None
    if cache is not None:
        stats = cache.stats()
        restore_deepspeed_pipeline(engine)
        cache.close()
    return params, stats


def main():
    import deepspeed
    import torch.distributed as dist

    # DeepSpeed JIT-compiles a shared-memory allreduce for CPU ranks (a minute
    # of g++); it is an optimization it does without when unavailable.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    ref, _ = run(False)
    got, stats = run(True)
    torch.save(dict(ref=ref, got=got, steps=stats["steps"], bytes_offloaded=stats["total"]["bytes_offloaded"]),
               os.path.join(sys.argv[1], f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
