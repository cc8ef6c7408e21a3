"""Megatron-core on CPU, for the tests only: its CUDA assumptions patched to
the CPU, a tiny GPTModel (local layer spec) in any pipeline layout, and its
training step through Megatron's own schedules.

The patches are written against megatron-core 0.16.1 (requirements-dev.txt
pins it); ``patch()`` refuses another version. The library
(ebbtide.integrations.megatron) never patches Megatron. What they change:
- tensor_parallel/random.py: the "CUDA" RNG states of Megatron's tracker are
  CPU generator states (dropout on CPU tensors draws from the CPU generator);
- utils.py (GlobalMemoryBuffer), pipeline_parallel/schedules.py (token
  counts), p2p_communication.py (shape exchange, synchronize),
  distributed/param_and_grad_buffer.py: device "cuda" and
  torch.cuda.current_device() are the CPU;
- fine-grained activation offloading: CUDA streams, events, NVTX ranges and
  pinned buffers become no-ops or plain CPU tensors, Tensor.record_stream is
  a no-op on CPU tensors, and Transformer Engine's cpu_offload flag a plain
  object (the offloading itself, a copy, runs as written).
"""
from __future__ import annotations

import contextlib
import os
import types

import torch

MEGATRON_VERSION = "0.16.1"


class _CpuCuda:
    """torch.cuda as Megatron's modules see it on CPU."""

    class Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            pass

        def synchronize(self):
            pass

    class Event:
        def __init__(self, *a, **k):
            pass

        def record(self, stream=None):
            pass

        def wait(self, stream=None):
            pass

        def synchronize(self):
            pass

    nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(*a, **k):
        pass

    @staticmethod
    def get_rng_state(*a, **k):
        return torch.get_rng_state()

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @classmethod
    def current_stream(cls, *a):
        return cls.Stream()

    @staticmethod
    def empty_cache():
        pass


def _cpu_device(device):
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


class _CpuTorch(types.ModuleType):
    """The torch module as Megatron's modules see it on CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*a, device=None, **k):
        return torch.zeros(*a, device=_cpu_device(device), **k)

    @staticmethod
    def empty(*a, device=None, pin_memory=False, **k):
        return torch.empty(*a, device=_cpu_device(device), **k)


_patched = False


def patch():
    """Applies the patches (idempotent); RuntimeError for another megatron-core."""
    global _patched
    if _patched:
        return
    import megatron.core

    if megatron.core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(f"python/tests/megatron_cpu.py patches megatron-core {MEGATRON_VERSION}, found "
                           f"{megatron.core.__version__} (requirements-dev.txt pins the version)")
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.utils as mutils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.pipeline_parallel import fine_grained_activation_offload, p2p_communication, schedules
    from megatron.core.tensor_parallel import random as mrandom

    cpu_torch = _CpuTorch()
    for module in (mrandom, mutils, schedules, p2p_communication, param_and_grad_buffer,
                   fine_grained_activation_offload):
        module.torch = cpu_torch
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    if te_ext.cpu_offload is None:
        te_ext.cpu_offload = types.SimpleNamespace(CPUOffloadEnabled=False)
    record_stream = torch.Tensor.record_stream

    def record_stream_on_cpu(self, stream):
        if self.device.type != "cpu":
            return record_stream(self, stream)

    torch.Tensor.record_stream = record_stream_on_cpu
    _patched = True


def init_distributed():
    """gloo from torchrun's environment, or a world of one."""
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        torch.distributed.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                             world_size=int(os.environ.get("WORLD_SIZE", 1)))


def seed(value: int):
    """The CPU generator and Megatron's tracker states, from `value`."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(value)
    mrandom.model_parallel_cuda_manual_seed(value)


def config(layers=2, hidden=64, heads=4, seq=32, dropout=0.0, pp=1, vp=None, **kw):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                             use_cpu_initialization=True, pipeline_dtype=torch.float32, params_dtype=torch.float32,
                             hidden_dropout=dropout, attention_dropout=dropout, bias_dropout_fusion=False,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                             finalize_model_grads_func=finalize_model_grads, **kw)


def build(cfg, vocab=128, seq=32, ddp=True):
    """This rank's model chunks (one per virtual stage), each in Megatron's DDP."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    chunks = []
    for vp_stage in range(cfg.virtual_pipeline_model_parallel_size or 1):
        vp = vp_stage if cfg.virtual_pipeline_model_parallel_size else None
        m = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq, vp_stage=vp,
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp))
        if ddp:
            m = DistributedDataParallel(cfg, DistributedDataParallelConfig(), m)
        chunks.append(m)
    if ddp:
        cfg.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    return chunks


def batches(n, vocab=128, seq=32, batch=2, first=0):
    """`n` micro-batches: token ids, contiguous positions, per-sample causal masks, labels."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + first + i)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append(dict(tokens=ids, position_ids=torch.arange(seq).repeat(batch, 1),
                        attention_mask=~torch.tril(torch.ones(batch, 1, seq, seq, dtype=torch.bool)),
                        labels=torch.roll(ids, -1, dims=1)))
    return out


def _forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def train_step(chunks, data, seq=32, batch=2):
    """One forward_backward call of Megatron's schedule for this layout over `data`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for c in chunks:
        if hasattr(c, "zero_grad_buffer"):
            c.zero_grad_buffer()
        c.zero_grad()
    iterators = [iter(data) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(data), seq_length=seq,
        micro_batch_size=batch)


def gradients(chunks) -> list:
    """Every parameter's gradient as DDP left it (main_grad), in order."""
    out = []
    for c in chunks:
        for p in c.parameters():
            g = getattr(p, "main_grad", None)
            out.append((g if g is not None else p.grad).detach().clone())
    return out
