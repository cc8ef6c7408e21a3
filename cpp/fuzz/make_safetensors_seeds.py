#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_safetensors (corpus/safetensors/): small
valid files from the safetensors package, with metadata, 0-d, empty and bool
tensors."""
import os

import torch
from safetensors.torch import save_file

d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "safetensors")
os.makedirs(d, exist_ok=True)
save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)},
          f"{d}/two_tensors.safetensors", metadata={"format": "pt"})
save_file({"scalar": torch.tensor(3, dtype=torch.int64), "empty": torch.zeros(0, 5, dtype=torch.float16),
           "mask": torch.tensor([True, False])}, f"{d}/edge_shapes.safetensors")
save_file({f"layers.{i}.weight": torch.full((4, 4), float(i), dtype=torch.float16) for i in range(3)},
          f"{d}/layers.safetensors")
