"""Peak memory of one training step, measured the same way for every method.

On CUDA: ``torch.cuda.max_memory_allocated`` above the allocation at the start
of the step. On the CPU (where PyTorch keeps no allocator statistics) the
process heap is read with glibc's ``mallinfo2`` (bytes in use in arenas plus
mmap'd blocks, which is where PyTorch's CPU tensors live), sampled by a
background thread every millisecond and explicitly at the points the caller
marks (``sample()``, e.g. at the end of forward, where activations peak).
The CPU figure is everything the step allocated on top of the baseline:
activations, temporaries and gradients.
"""
import ctypes
import ctypes.util
import threading


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = None


def _heap_bytes():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(_libc, "mallinfo2"):
            raise RuntimeError("glibc without mallinfo2 (needs glibc >= 2.33): "
                               "cannot measure CPU heap peaks")
        _libc.mallinfo2.restype = _MallInfo2
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def heap_measurable():
    try:
        _heap_bytes()
        return True
    except (OSError, RuntimeError):
        return False


class PeakMeter:
    """``with PeakMeter(device) as m: ...; m.sample(); ...`` then ``m.peak_bytes``."""

    def __init__(self, device, interval_s=0.001):
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._base = 0
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = _heap_bytes()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="ebbtide-peak-meter",
                                            daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self):
        if self.device.type != "cuda":
            self.peak_bytes = max(self.peak_bytes, _heap_bytes() - self._base)

    def __exit__(self, *exc):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._stop.set()
            self._thread.join()
            self.sample()
        return False
