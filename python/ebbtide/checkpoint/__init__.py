"""Checkpoints of PyTorch state (docs/checkpoints.md).

    from ebbtide import checkpoint
    info = checkpoint.save(state, "ckpt/step100")                    # durable on return
    h = checkpoint.save(state, "ckpt/step200", async_=True)          # returns after the snapshot
    ...; info = h.wait()                                              # raises the writer's error
    state = checkpoint.load("ckpt/step200", device="cpu")
    checkpoint.load("ckpt/step200", into=model)                       # read straight into the parameters

What lives here, as the core's cpp/src/ckpt does (bytes are moved by the C++
writer and reader, ebbtide._core.CkptWriter / CkptReader):
- native_save.py, native_load.py: ebbtide's own format (docs/checkpoint-format.md),
  save and load; tree.py: the state-dict tree codec both use; collectives.py:
  the collectives of a save under torch.distributed;
- lossy.py: ExCP-style delta compression (``save(..., base=, lossy=)``; the
  encoding itself is the core's, CkptWriter.excp_encode_many);
- checks.py, validate.py: every check a hostile checkpoint meets, one table
  for ``load`` and ``ebbtide ckpt inspect`` (Note [One validator]);
- safetensors.py: safetensors files and sharded HF checkpoints;
- dcp_format.py, dcp_writer.py, dcp_staging.py, dcp_reader.py: the
  torch.distributed.checkpoint storage plugin, public as ``ebbtide.dcp``;
- staging.py: copies of a state into the writer's staging buffer.
Modules here may import ebbtide._core, ebbtide._settings and each other; never
the activation cache (ebbtide.cache), the planner or the harness.
"""
from ebbtide.checkpoint.native_load import inspect, load
from ebbtide.checkpoint.native_save import (FORMAT_VERSION, INDEX_NAME, ChecksumError, SaveHandle, SaveInfo,
                                            StateError, Writer, join, save, wait_for_snapshots)
from ebbtide.checkpoint.safetensors import load_safetensors, save_safetensors

__all__ = ["save", "load", "inspect", "join", "wait_for_snapshots", "Writer", "SaveHandle", "SaveInfo",
           "FORMAT_VERSION", "INDEX_NAME", "StateError", "ChecksumError", "save_safetensors", "load_safetensors"]
