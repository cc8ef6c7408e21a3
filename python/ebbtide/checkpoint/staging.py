"""Copies of a state made before its save, into the staging buffer the C++
writer keeps (Note [Staging buffer] in cpp/src/ckpt/writer_arena.cpp): the
layout of the staged tensors in the buffer, the thread that fills a buffer
off the caller's path, and the copy itself. Used by DCP's async_save
(dcp_staging.py) and by async delta saves (Note [Async delta saves] in
native_save.py)."""
import logging
import threading

import torch

from ebbtide import _core
from ebbtide.checkpoint import tree
from ebbtide.checkpoint.dcp_format import _test_hook_gate

ALIGN = 64  # staged tensors start on a cache line of the staging buffer
NATIVE_COPY_MIN = 1 << 20  # smaller tensors are copied by torch (Note [Staging copy] in dcp_staging.py)


class NoRoom(Exception):
    """The staging buffer cannot hold the state."""


def in_buffer(t):
    """Whether a staged copy of `t` lies in the staging buffer (0-d and empty tensors do not)."""
    return t.dim() > 0 and t.numel() > 0 and t.data_ptr() != 0


def staged_bytes(tensors):
    """Bytes of staging buffer that copies of `tensors`, laid out in order by
    BufferViews, take."""
    total = 0
    for t in tensors:
        if in_buffer(t):
            total = -(-total // ALIGN) * ALIGN + t.numel() * t.element_size()
    return total


class BufferViews:
    """Hands out the writer's staging buffer for copies of tensors, in order,
    each on an ALIGN boundary and a storage of its own (a saver frames or
    writes each storage whole); NoRoom past its end."""

    def __init__(self, native):
        buf = native.staging_buffer
        self.native, self.capacity, self.off = native, 0 if buf is None else buf.numel(), 0

    def region(self, nbytes):
        """A uint8 tensor of `nbytes` in the buffer, with a storage of its own."""
        start = -(-self.off // ALIGN) * ALIGN
        if start + nbytes > self.capacity:
            raise NoRoom
        self.off = start + nbytes
        return self.native.staging_view(start, nbytes)

    def view(self, t):
        """A CPU tensor of t's dtype and shape for its copy: in the buffer,
        or (0-d, empty) made by torch as torch's staging makes them."""
        if t.dim() == 0:
            return torch.tensor(0, dtype=t.dtype)
        if not in_buffer(t):
            return torch.zeros_like(t, device="cpu")
        return self.region(t.numel() * t.element_size()).view(t.dtype).view(t.shape)


def _stageable(t):
    """A host tensor staged storage-whole (others are cloned by torch)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized and not t.is_conj()
            and not t.is_neg() and t.untyped_storage().nbytes() > 0)


def state_bytes(tensors):
    """Bytes of staging buffer a staged_state() of these tensors takes: their storages, once each."""
    seen, total = set(), 0
    for t in tensors:
        if _stageable(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total = -(-total // ALIGN) * ALIGN + t.untyped_storage().nbytes()
    return total


def staged_state(native, state, map_tree):
    """A copy of `state` (host tensors only) in the writer's staging buffer
    that shares what it shares: one staged storage per storage, copied whole
    on the writer's threads, each tensor a view of its own at the same
    offset and strides (parameters stay parameters; sparse, conjugate and
    quantized tensors are cloned). None, with nothing copied, when the
    buffer is missing or too small. `map_tree(obj, path, leaf)` rebuilds the
    containers (lossy._map_tree)."""
    from ebbtide.checkpoint.lossy import _DESCEND
    tensors = [t for _, t in tree.walk_tensors(state)]
    if any(t.device.type != "cpu" for t in tensors):
        return None
    views = BufferViews(native)
    storages, copies = {}, []
    try:
        for t in tensors:
            st = t.untyped_storage()
            if _stageable(t) and st.data_ptr() not in storages:
                region = views.region(st.nbytes())
                storages[st.data_ptr()] = region
                copies.append((region.data_ptr(), st.data_ptr(), st.nbytes(), False, 0))
    except NoRoom:
        return None
    native.stage(copies)

    def leaf(obj, path):
        if not isinstance(obj, torch.Tensor):
            return _DESCEND
        if not _stageable(obj):
            return obj.clone()
        x = torch.empty(0, dtype=obj.dtype)
        x.set_(storages[obj.untyped_storage().data_ptr()].untyped_storage(), obj.storage_offset(), obj.shape,
               obj.stride())
        return torch.nn.Parameter(x, requires_grad=obj.requires_grad) if isinstance(obj, torch.nn.Parameter) else x
    return map_tree(state, "state", leaf)


def native_copy(src, dst, in_staging):
    """(dst, src, nbytes, device, stream) for the writer's stage() when it can
    copy `src` into `dst` (large, contiguous, same dtype and shape; CUDA
    sources only into the staging buffer, `in_staging`), else None."""
    if (dst.device.type != "cpu" or src.dtype != dst.dtype or src.shape != dst.shape or not src.is_contiguous()
            or not dst.is_contiguous() or src.nbytes < NATIVE_COPY_MIN or src.is_conj() or src.is_neg()):
        return None
    if src.device.type == "cuda":
        if not (in_staging and _core.cuda_available()):
            return None
    elif src.device.type != "cpu":
        return None
    return (dst.data_ptr(), src.data_ptr(), src.nbytes, src.device.type == "cuda", tree.core_stream(src.device))


def fill_device(tensors):
    """The CUDA device to page-lock a staging buffer for (the caller's, when
    it holds some of `tensors`), or -1 for host state or without a usable
    CUDA driver."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    if not devices or not _core.cuda_available():
        return -1
    here = torch.cuda.current_device()
    return here if torch.device("cuda", here) in devices else min(d.index or 0 for d in devices)


class Filler:
    """Fills the writer's staging buffer on a thread of its own (Note
    [Staging buffer]): start() never waits for an earlier fill (the new
    thread does), join() waits for every fill started."""

    def __init__(self, native, what):
        self.native, self.what, self.thread = native, what, None

    def start(self, nbytes, device):
        before, native = self.thread, self.native

        def fill():
            if before is not None:
                before.join()
            buf = native.staging_buffer
            if nbytes == 0 or (buf is not None and buf.numel() >= nbytes):
                return
            _test_hook_gate("staging-fill")
            try:
                native.reserve_staging(nbytes, device)
            except Exception as e:  # noqa: BLE001 - the next save writes through, or copies after a fill, again
                logging.getLogger("ebbtide").warning("ebbtide: no staging buffer of %d bytes for %s: %s", nbytes,
                                                     self.what, e)
        self.thread = threading.Thread(target=fill, name="ebbtide-staging-fill", daemon=True)
        self.thread.start()

    def join(self):
        t = self.thread
        if t is not None:
            t.join()
