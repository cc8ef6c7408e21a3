"""Writes the seed corpus of cpp/fuzz/fuzz_ckpt_shard.cpp: a few small shards
made by the real writer (raw, compressed, several chunks per blob, empty
tensors, the shard file of a striped checkpoint) and edge cases (empty file,
a bare superblock, a shard cut after its superblock).

    PYTHONPATH=python:build/<dir>/python python cpp/fuzz/make_ckpt_seeds.py [OUT_DIR]
"""
import os
import shutil
import struct
import sys
import tempfile

import torch

from ebbtide import _core
from ebbtide import checkpoint


def main(out):
    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    states = {
        "raw": ({"a": torch.arange(64, dtype=torch.float32), "b": torch.randint(-9, 9, (5000,), generator=g,
                                                                                 dtype=torch.int8)}, {}),
        "lossless": ({"w": torch.randn(1024, generator=g), "h": torch.randn(300, generator=g).half()},
                     {"compress": "lossless"}),
        "chunked": ({"w": torch.randn(3 * 1024 + 5, generator=g)}, {"writer": checkpoint.Writer(chunk_bytes=4096)}),
        "empty": ({"e": torch.empty(0), "v": torch.arange(10)[4:4], "step": 5}, {}),
        "striped": ({"w": torch.randn(2048, generator=g)}, {"writer": checkpoint.Writer(chunk_bytes=4096),
                                                            "stripe_dirs": None}),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, (state, kw) in states.items():
            if "stripe_dirs" in kw:
                os.makedirs(os.path.join(tmp, "stripes"))
                kw["stripe_dirs"] = [os.path.join(tmp, "stripes")]
            path = os.path.join(tmp, name)
            checkpoint.save(state, path, **kw)
            shutil.copyfile(os.path.join(path, "rank0.ebt"), os.path.join(out, f"{name}.ebt"))
    with open(os.path.join(out, "empty-file"), "wb"):
        pass
    with open(os.path.join(out, "raw.ebt"), "rb") as f:
        head = f.read(4096)
    with open(os.path.join(out, "superblock-only"), "wb") as f:
        f.write(head)
    bare = bytearray(64)
    bare[:16] = b"EBBTIDE-CKPT\0\0\0\0"
    struct.pack_into("<IIQQQ", bare, 16, 2, 0, 4096, 32, 8192)
    struct.pack_into("<I", bare, 56, _core.crc32c(bytes(bare[:56])))
    with open(os.path.join(out, "bare-superblock"), "wb") as f:
        f.write(bare + b"\0" * (8192 - 64))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus", "ckpt_shard"))
