"""Peak memory of one training step, measured the same way for every method.

On CUDA: ``torch.cuda.max_memory_allocated`` above the allocation at the start
of the step. On the CPU (where PyTorch keeps no allocator statistics) the
process heap is read with glibc's ``mallinfo2`` (bytes in use in arenas plus
mmap'd blocks, which is where PyTorch's CPU tensors live), sampled by a
background thread every millisecond and explicitly at the points the caller
marks (``sample()``, e.g. at the end of forward, where activations peak),
plus what the given tensor caches hold in host memory that the heap reading
misses (Note [Host tier on the heap]). The CPU figure is everything the step
holds on top of the baseline: activations (also those copied to a cache's
host tier), temporaries and gradients. Like the CUDA figure it leaves out
what allocators keep for reuse and buffers made before the step.
"""
import ctypes
import ctypes.util
import threading
import weakref


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


# Note [Host tier on the heap]
# A TensorCache's host tier keeps each offloaded CPU tensor as a copy in a
# blob of its buffer pool, heap memory that the pool keeps as a spare when the
# blob is freed and hands out again in the next step (Note [Buffer reuse] in
# cpp/src/mem/buffer_pool.cpp). From the second step on, the blobs come out of
# memory that was in use on the heap before the step began: the heap does not
# grow by them, and a heap reading alone showed ebbtide-cpu on the CPU at
# about half the peak of no offloading, when it holds as much (the copies)
# or more. So the meter adds, per cache, the host tier's bytes held (stats()
# "tiers") as far as the blobs can have come from spares: up to the most the
# tier held at once in the cache's earlier steps (the pool keeps that much).
# Blobs beyond that are new heap memory, already counted. This assumes the
# step's blob sizes were seen before (the pool reuses a plain blob for the
# same size only), as in steps of one shape; the first step counts its blobs
# through the heap alone.


class _HostTier:
    """The host-tier bytes of one cache that a step's heap reading misses."""

    def __init__(self, cache):
        self._cache = weakref.ref(cache)
        self.most_held = 0  # the most the tier held at once, over the steps measured
        self._start = 0
        self._spares = 0

    def _held(self):
        cache = self._cache()
        core = getattr(cache, "_core", None)
        if core is None:
            return 0
        # The core's own counters: TensorCache.stats() would also poll the
        # cache's completions, from this (the sampling) thread.
        try:
            tiers = core.stats()["tiers"]
        except RuntimeError:  # closed
            return 0
        return sum(t["bytes_held"] for t in tiers if t["tier"] == "cpu")

    def begin(self):
        self._start = self._held()
        self._spares = self.most_held

    def extra(self):
        held = self._held()
        self.most_held = max(self.most_held, held)
        return max(0, min(held - self._start, self._spares))


_host_tiers = weakref.WeakKeyDictionary()  # TensorCache -> _HostTier, kept across steps


class PeakMeter:
    """``with PeakMeter(device, caches) as m: ...; m.sample(); ...`` then ``m.peak_bytes``.

    Args:
        device: the training device (torch.device).
        caches: the TensorCaches whose steps are measured; on the CPU their
            host tiers are counted (Note [Host tier on the heap]).
        interval_s: how often a background thread samples the CPU heap.
    """

    def __init__(self, device, caches=(), interval_s=0.001):
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._base = 0
        self._stop = threading.Event()
        self._thread = None
        self._tiers = []
        if device.type != "cuda":
            for cache in caches:
                if cache not in _host_tiers:
                    _host_tiers[cache] = _HostTier(cache)
                self._tiers.append(_host_tiers[cache])

    def __enter__(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            for tier in self._tiers:
                tier.begin()
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
            held = _heap_bytes() - self._base + sum(tier.extra() for tier in self._tiers)
            self.peak_bytes = max(self.peak_bytes, held)

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
