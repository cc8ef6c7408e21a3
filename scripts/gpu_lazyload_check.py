"""Confirms (or refutes) that the host wait seen on 2026-11-26 (docs/benchmarks.md, "Second device run") is CUDA
lazy kernel loading, with neither ebbtide nor NCCL involved. Run on a GPU
machine from the repository root:  python3 scripts/gpu_lazyload_check.py
(~20 s after torch's import; each case is cut by a 5 s gate watchdog).
Expected if lazy loading is the cause: A and C wait ~5 s (forced True),
B does not (forced False)."""
import ctypes
import os
import sys
import time

import torch

sys.path.insert(0, "python/tests")
from test_cache_cuda import StreamGate  # noqa: E402

torch.cuda.set_device(0)
lib = ctypes.CDLL("libcuda.so.1")
mode = ctypes.c_int(0)
rc = lib.cuModuleGetLoadingMode(ctypes.byref(mode)) if hasattr(lib, "cuModuleGetLoadingMode") else -1
print("CUDA_MODULE_LOADING =", os.environ.get("CUDA_MODULE_LOADING"), "; cuModuleGetLoadingMode rc", rc,
      "mode", mode.value, "(1 eager, 2 lazy)", flush=True)
x = torch.randn(2048, 2048).cuda()  # copies only: no kernel launched yet in this process
y = torch.randn(2048, 2048).cuda()
torch.cuda.synchronize()


def gated(name, fn):
    g = StreamGate(watchdog=5.0).close()
    t = time.perf_counter()
    fn()
    took = time.perf_counter() - t
    forced = g.forced
    g.open()
    torch.cuda.synchronize()
    print(f"{name}: host took {took:.3f} s to queue it; gate forced open by the watchdog: {forced}", flush=True)


gated("A first launch of add_(1.0) behind a closed gate", lambda: x.add_(1.0))
gated("B add_(1.0) again (kernel loaded)              ", lambda: y.add_(1.0))
gated("C first launch of mul_(2.0)                    ", lambda: y.mul_(2.0))
