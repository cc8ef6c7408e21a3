"""torch.distributed.checkpoint (DCP) storage plugin on ebbtide's I/O engine.

``EbbtideWriter`` and ``EbbtideReader`` plug into ``dcp.save``,
``dcp.async_save`` and ``dcp.load`` (FSDP2, torchtitan, torchtune): DCP plans
what each rank saves and how it reshards on load; the bytes are moved by the
C++ checkpoint writer and reader (O_DIRECT from pinned aligned buffers,
io_uring where available, crc32c per chunk, optional zstd), and a save is
committed by renaming its directory. See docs/checkpoints.md,
"torch.distributed.checkpoint".

Note [DCP layout]
Each rank writes one file ``__<rank>_0.distcp`` that is an ebbtide shard
(docs/checkpoint-format.md): a superblock in block 0, data chunks at 4 KiB
offsets, the chunk table (crc32c, codec) after the data. Each DCP write item
is one blob. A tensor item's blob is framed (Note [Framed blobs] in
cpp/src/ckpt/writer.cpp) with the bytes torch.save writes around its storage
(made by torch.save itself under ``torch.serialization.skip_data`` into a
sink that keeps everything but the storage bytes), so that uncompressed, the
blob is exactly what torch.save would have written. ``.metadata`` is DCP's own
pickle with ``_StorageInfo(relative_path, offset, length)`` naming the blob's
first byte and size: torch's FileSystemReader reads the range and torch.loads
it, never looking at the rest of the file, so it loads these checkpoints as
its own. Compressed blobs carry the transform descriptor ``ebbtide-zstd/1``,
which FileSystemReader refuses ("Unknown extension"). EbbtideReader reads
ebbtide shards through the C++ reader (tables validated, checksums verified,
chunks decompressed) and takes tensors out of the frame by the layout the
shard's JSON metadata records; any other file (FileSystemWriter's) by
bounds-checked byte ranges and ``torch.load(weights_only=True)``.

Note [DCP metadata safety]
``.metadata`` is a pickle, which can run any code when loaded.
torch's weights_only unpickler cannot read it (DCP writes pickle protocol 4,
whose FRAME opcode it refuses), so EbbtideReader unpickles it with
``_MetadataUnpickler``, whose ``find_class`` allows only the DCP metadata
dataclasses, torch.Size/dtype/layout/memory_format and pathlib paths: no other
callable can be reached. Then every field the reader uses is type- and
range-checked (``_check_metadata``): file names must be plain names inside the
checkpoint directory, offsets and lengths integers; the C++ side checks each
range against the real file, which must be a regular file (Note [Untrusted
byte ranges] in cpp/src/ckpt/range_read.cpp).

Note [DCP striping]
``EbbtideWriter(path, stripe_dirs=[d1, ...])`` spreads each rank's data file
over ``path`` and one stripe directory per entry, as ebbtide.checkpoint does
(docs/checkpoints.md, "Striping"): the coordinator reserves the save through
the core's SaveTransaction (cpp/include/ebbtide/ckpt/transaction.hpp: the
stripe directories ``<d>/<basename>.stripe-<tag>-<id>`` with their
owner.json, made and removed under Note [Stripe ownership] in
cpp/src/ckpt/transaction.cpp), every rank writes ``__<rank>_0.distcp`` with
its chunks round-robin over the shard file and a stripe file of that name in
each stripe directory, and the commit writes ``.ebbtide-stripes.json``
({"id", "stripes"}) beside ``.metadata``: the record the next save reads to
remove the replaced stripes, and the reader reads to find them. A blob's bytes
then lie in several files, so a striped item's ``_StorageInfo`` names the
shard file, the blob's index in the shard as ``offset`` and its size as
``length``, and carries the transform descriptor ``ebbtide-stripe/1``, which
FileSystemReader refuses ("Unknown extension"). EbbtideReader treats the
record as hostile: each entry must be a stripe directory of this checkpoint
(its name, and an owner.json naming this checkpoint path and the record's
id), else ValueError naming the entry.
"""
import dataclasses
import functools
import io
import json
import math
import os
import pathlib
import pickle
import re
import sys
import threading
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.futures import Future
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint import state_dict_saver as _saver
from torch.distributed.checkpoint.filesystem import _StorageInfo, FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from ebbtide import _ckpt_tree as tree
from ebbtide import _ckpt_validate as check
from ebbtide import _core
from ebbtide._ckpt_checks import fail, tag
from ebbtide import checkpoint as _checkpoint
from ebbtide.checkpoint import _host_buffer, _stripe_dir_list

__all__ = ["EbbtideWriter", "EbbtideReader", "load_metadata"]

METADATA_NAME = ".metadata"
DCP_VERSION = "1.0.0"
LAYOUT = "ebbtide-dcp"
LAYOUT_VERSION = 1
COMPRESSED_DESCRIPTOR = "ebbtide-zstd/1"
STRIPED_DESCRIPTOR = "ebbtide-stripe/1"
STRIPE_RECORD = ".ebbtide-stripes.json"
MAX_METADATA_BYTES = 1 << 30


@dataclasses.dataclass
class _SavePlanData:
    """What the coordinator hands each rank in prepare_global_plan."""

    prefix: str
    tmp_dir: str
    stripes: list = dataclasses.field(default_factory=list)  # stripe directories (Note [DCP striping])


class _FrameSink:
    """File-like target for torch.save that keeps the bytes written and skips
    the gap left by skip_data() (the storage bytes)."""

    def __init__(self):
        self.parts = []
        self.pos = 0
        self.end = 0

    def write(self, b):
        mv = memoryview(b).cast("B")
        self.parts.append((self.pos, bytes(mv)))
        self.pos += mv.nbytes
        self.end = max(self.end, self.pos)
        return mv.nbytes

    def seek(self, pos, whence=0):
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.end + pos
        return self.pos

    def tell(self):
        return self.pos

    def flush(self):
        pass


def _torch_frame(t, nbytes):
    """(head, tail): the bytes torch.save(t) writes before and after the
    `nbytes` bytes of t's storage. RuntimeError when torch's output does not
    have that shape (a torch change this module must follow)."""
    sink = _FrameSink()
    with torch.serialization.skip_data():
        torch.save(t, sink)
    parts = sorted(sink.parts)
    end, gap = 0, None
    for pos, data in parts:  # the one stretch nothing was written to is the storage
        if pos > end:
            if gap is not None:
                raise RuntimeError("torch.save left more than one gap; ebbtide.dcp cannot frame this tensor")
            gap = (end, pos)
        end = max(end, pos + len(data))
    if gap is None:
        gap = (end, end) if nbytes == 0 else None
    if gap is None or gap[1] - gap[0] != nbytes:
        raise RuntimeError(f"torch.save wrote its storage bytes unexpectedly (gap {gap}, storage {nbytes} bytes); "
                           "ebbtide.dcp cannot frame this tensor")
    # Assembled around the gap, never through it (a storage can be gigabytes).
    head, tail = bytearray(gap[0]), bytearray(end - gap[1])
    for pos, data in parts:
        if pos < gap[0]:
            head[pos:pos + len(data)] = data
        else:
            tail[pos - gap[1]:pos - gap[1] + len(data)] = data
    return bytes(head), bytes(tail)


@functools.lru_cache(maxsize=None)
def _direct_devices():
    """Devices whose tensors a load reads into directly (Note [Reading into
    the targets]): CUDA only where the core can drive it."""
    return ("cpu", "cuda") if _core.cuda_available() else ("cpu",)


def _owned_storage(t, on_device=False):
    """A tensor equal to `t` that is the whole of its storage (like
    FileSystemWriter, which clones such tensors before torch.save): on the
    CPU, or with `on_device` on t's device (cloned there when needed)."""
    t = t.detach()
    if t.device.type != "cpu" and not on_device:
        t = t.cpu()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


# Note [Device shards]
# A synchronous dcp.save of CUDA tensors (FSDP shards on the GPU) hands them
# to the core's device path when the core can drive CUDA: the writer's
# workers copy each chunk from device memory into its page-locked save ring
# on the tensor's current stream (Note [Save ring] in
# cpp/src/ckpt/writer.cpp) while earlier chunks are written, instead of a
# synchronous copy of every tensor to fresh pageable host memory first. The
# file is the same: torch.save's frame around the storage is made from a CPU
# tensor of the same layout (a CUDA tensor's frame would record its device),
# so FileSystemReader loads the tensors onto the CPU as before. Other tensors
# (conjugate or negative views, empty ones) take the host copy.
def _device_source(t):
    """CUDA tensor `t` as the whole of a storage on its device, to be saved
    from device memory (Note [Device shards]), or None when it takes the
    host copy."""
    if t.device.type != "cuda" or t.is_conj() or t.is_neg() or t.numel() == 0 or not _core.cuda_available():
        return None
    return _owned_storage(t, on_device=True)


def _frame_stand_in(t):
    """A CPU tensor with t's dtype, shape, strides and storage size, whose
    torch.save frame is that of t copied to the CPU (its bytes are never
    read: the frame is made under skip_data)."""
    cpu = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    if cpu.untyped_storage().nbytes() != t.untyped_storage().nbytes():
        raise RuntimeError(f"ebbtide.dcp: no CPU stand-in for a tensor of shape {tuple(t.shape)} and strides "
                           f"{t.stride()} over {t.untyped_storage().nbytes()} bytes")
    return cpu


_unpickled_natives = {}  # options -> native writer, for writers unpickled here (Note [Writer in another process])


class _StagingHandle:
    """A pending async staging copy, in checkpoint.py's registry of background
    snapshots that torch.optim steps wait for (Note [Async staging])."""

    def __init__(self):
        self._event = threading.Event()
        self.snapshot_wait_seconds = 0.0

    def staged(self):
        return self._event.is_set()

    def wait_staged(self):
        self._event.wait()

    def done(self):
        self._event.set()
        _checkpoint._background.discard(self)


def _thread_upload():
    """Whether the caller is torch's async_save with its thread executor
    (Note [First DCP async save]): read from async_save's frame; anything
    else (another torch, the process executor) counts as no."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_name != "async_save":
        f = f.f_back
    kind = f.f_locals.get("async_checkpointer_type") if f is not None else None
    return kind is not None and getattr(kind, "value", None) == "thread"


def _upload_threads():
    """The threads of DCP's thread executor now alive (torch names them)."""
    return {t for t in threading.enumerate() if t.name.startswith("AsyncCheckpointExecutor")}


def _local_tensors(obj, path=""):
    """(tensor, path) for each tensor in a state dict, the local tensor of a DTensor."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", None)
        yield (local if isinstance(local, torch.Tensor) else obj), path
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _local_tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _local_tensors(v, f"{path}.{i}" if path else str(i))


def _saved_versions(obj):
    """(tensor, version counter, path) for each tensor in a state dict: what
    an in-place change bumps."""
    for t, path in _local_tensors(obj):
        if not t.is_inference():
            yield t, t._version, path


def _cuda_devices(obj):
    """The CUDA devices holding tensors of a state dict."""
    return {t.device for t, _ in _local_tensors(obj) if t.device.type == "cuda"}


def _record_callers_streams(devices):
    """On the caller's thread: an event after the work queued so far on the
    current stream of each device in `devices` (Note [Async staging]).
    Blocking-sync events: the staging thread that waits for them sleeps."""
    events = []
    for d in sorted(devices, key=lambda d: d.index if d.index is not None else -1):
        ev = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.current_stream(d))
        events.append(ev)
    return events


class _DirectoryId:
    """A checkpoint is identified by its directory, as with FileSystemWriter/Reader."""

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return FileSystem.validate_checkpoint_id(checkpoint_id)


class EbbtideWriter(_DirectoryId, StorageWriter, BlockingAsyncStager):
    """DCP StorageWriter writing through ebbtide's C++ checkpoint writer.

    One file per rank, crash-safe: every rank writes into ``PATH.tmp-*``; the
    coordinator writes ``.metadata`` and commits the directory by rename, so
    PATH is always the previous complete checkpoint or the new one. Reuse one
    writer across saves to keep its buffers (a 64 MiB ring the writes go
    through, EBBTIDE_CKPT_RING; and, for async_save, its staged copy of the
    state).

    Args:
        path: checkpoint directory (replaced as a whole by each save).
        compress: None, or "lossless" (zstd per chunk, byte-grouped for
            numbers). Compressed checkpoints load only with EbbtideReader.
        zstd_level: zstd level (default EBBTIDE_CKPT_ZSTD_LEVEL or 1).
        chunk_bytes: checksum and compression unit (default 4 MiB).
        queue_depth: writes in flight.
        threads: snapshot copy and compression threads (0: min(4, cores)).
        direct: O_DIRECT where the filesystem allows it (default True).
        cache_staged_state_dict: async_save keeps its staged copy of the
            state for the next async_save (faster staging, one state of
            host memory held).
        async_staging: async_save returns before the staging copy is made
            (Note [Async staging]): it returns torch's AsyncSaveResponse,
            whose staging_completion says when the state may change again;
            every torch.optim step waits for it, and a tensor changed in
            place meanwhile fails the save (nothing is committed).
        stripe_dirs: extra directories (one per SSD) to stripe each rank's
            data over (Note [DCP striping]); such checkpoints load only with
            EbbtideReader, from `path`. Not with use_collectives=False.
        staging: "copy" (default): async_save copies the state before it
            returns. "none": it copies nothing and the upload writes the
            tensors' own bytes (Note [Uncopied DCP saves]): the caller must
            not change them until the upload future completes; a tensor
            changed in place before then fails the save, naming it, and
            nothing is committed. Not with async_staging=True.

    With ``use_collectives=False`` (each rank saves on its own, Note [DCP
    without collectives]) the ranks share PATH: rank r writes a data file of
    its own and ``__r.metadata``, the layout FileSystemWriter uses then.

    Raises:
        ValueError: a bad option (from save: a stripe directory that does
            not exist, is listed twice or lies inside `path`; staging not
            "copy" or "none", or "none" with async_staging).
        NotImplementedError: compress="lossless" in a build without zstd
            (from save); async_staging=True with a torch whose async_save
            cannot take a staging future.

    Example:
        >>> w = EbbtideWriter("/ckpt/step100")
        >>> dcp.save({"model": model.state_dict()}, storage_writer=w)
    """

    def __init__(self, path, *, compress=None, zstd_level=None, chunk_bytes=None, queue_depth=None, threads=None,
                 direct=None, cache_staged_state_dict=True, stripe_dirs=None, async_staging=False, staging="copy"):
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if compress not in (None, "lossless"):
            raise ValueError(f"compress={compress!r}: expected None or 'lossless'")
        if async_staging and not hasattr(_saver, "AsyncSaveResponse"):
            raise NotImplementedError(f"EbbtideWriter(async_staging=True): torch {torch.__version__}'s async_save "
                                      "cannot take a staging future (it needs AsyncSaveResponse)")
        if staging not in ("copy", "none"):
            raise ValueError(f"EbbtideWriter: staging={staging!r} is not valid (valid: 'copy', 'none')")
        if staging == "none" and async_staging:
            raise ValueError("EbbtideWriter: staging='none' copies nothing, so there is no staging to run in the "
                             "background: pass async_staging=False")
        self.async_staging = bool(async_staging)
        self.staging = staging
        self._unstaged = None  # staging="none": the saved tensors' version counters (Note [Uncopied DCP saves])
        self._written = None  # the first async_save, written through: set once its bytes are (Note [First DCP async save])
        self._cache_filler = None  # the thread that makes the staged copy after a written-through save
        self._stager = None  # the staging thread (async_staging)
        self.path = os.fspath(path)
        self.stripe_dirs = _stripe_dir_list(stripe_dirs)
        self.compress = compress
        self._options = dict(chunk_bytes=chunk_bytes, queue_depth=queue_depth, threads=threads,
                             zstd_level=zstd_level, direct=direct)
        self._native = _core.CkptWriter(**self._options)
        self.save_id = str(uuid.uuid4())
        self._frames = {}
        self.rank = 0
        self.is_coordinator = True
        self.use_collectives = True

    # Note [Writer in another process]
    # dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    # pickles the storage writer into DCP's checkpoint process. What crosses is
    # the configuration (path, options, stripes, save id); the native writer,
    # the staging thread and the staged copy stay behind, and the process side
    # takes a native writer of the same options from a per-process cache, so
    # the saves it runs one after another keep one set of pinned buffers.
    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_native", "_stager", "_txn", "state_dict_cache", "_unstaged", "_written", "_cache_filler"):
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._stager = None
        self._unstaged = None  # the version counters stay with the caller's process
        self._written = self._cache_filler = None
        self.state_dict_cache = None
        key = tuple(sorted(self._options.items()))
        native = _unpickled_natives.get(key)
        if native is None:
            native = _unpickled_natives[key] = _core.CkptWriter(**self._options)
        self._native = native

    def join(self):
        """Waits until the checkpoint the last save replaced is removed: the
        save returns once the new one is committed, and the writer removes
        the old one after (Note [Deferred removal] in cpp/src/ckpt/writer.cpp;
        also done when the writer is destroyed)."""
        self._native.join()

    # -- AsyncStager ---------------------------------------------------------------
    def stage(self, state_dict):
        """async_save's staging: a CPU copy of `state_dict` (kept for the next
        call with cache_staged_state_dict; pinned only where CUDA is usable).
        With async_staging, a Future of that copy, made on the writer's
        staging thread (Note [Async staging]). With staging="none",
        `state_dict` itself (Note [Uncopied DCP saves])."""
        if self.staging == "none":
            self._unstaged = list(_saved_versions(state_dict))
            return state_dict
        if self._cache_filler is not None:  # Note [First DCP async save]
            self._cache_filler.join()
            self._cache_filler = None
        if (not self.async_staging and self.cache_staged_state_dict and self.state_dict_cache is None
                and _thread_upload()):
            self._written = (threading.Event(), _upload_threads(), state_dict)
            self._synchronize_after_execute = True
            return state_dict
        if not self.async_staging:
            return self._stage_now(state_dict)
        versions = list(_saved_versions(state_dict))
        devices = _cuda_devices(state_dict)
        ready = _record_callers_streams(devices)  # Note [Async staging]: the caller's streams, now
        device = torch.cuda.current_device() if devices else None
        handle = _StagingHandle()
        _checkpoint._install_optimizer_hook()
        _checkpoint._background.add(handle)
        if self._stager is None:
            self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ebbtide-dcp-staging")
        try:
            return self._stager.submit(self._stage_checked, state_dict, versions, handle, ready, device)
        except BaseException:
            handle.done()
            raise

    # Note [Uncopied DCP saves]
    # EbbtideWriter(staging="none") is DCP's no-staging mode: stage() hands
    # async_save the caller's state dict, so async_save blocks for nothing but
    # torch's own set-up, and the upload's write_data reads the tensors
    # through the writer's ring (Note [Pipelined save]) as a synchronous save
    # does. The caller promises not to change them until the upload future
    # completes. stage() notes each tensor's version counter; write_data
    # compares them once every byte is written and durable, and a change
    # fails the save there, before finish() could commit (the previous
    # checkpoint stays). Unlike ebbtide.checkpoint's snapshot="none",
    # torch.optim steps do not wait for it: a save that fails in DCP's
    # planning never reaches write_data, and a step waiting for it would wait
    # forever. Changes through `.data` are not seen.

    # Note [Async staging]
    # EbbtideWriter(async_staging=True) makes async_save return before the
    # staging copy: stage() returns a Future (torch's own protocol: async_save
    # then returns AsyncSaveResponse, and its upload thread waits for the
    # Future before planning), and the copy runs on the writer's staging
    # thread (the large tensors on the writer's threads, GIL released, Note
    # [Staging copy]) while the caller goes on with the next forward and
    # backward, which read the state but do not change it. The same two guards
    # as ebbtide.checkpoint's background snapshot (Note [Background snapshot]
    # in checkpoint.py) keep the checkpoint exactly the state at async_save():
    # every torch.optim step waits for pending staging first (the same global
    # step pre-hook and registry), and after the copy each saved tensor's
    # version counter is compared with the one seen at async_save(); a change
    # made in place meanwhile fails the staging future, so the upload raises
    # before anything is written and the last committed checkpoint stays.
    # torch's DefaultStager(use_async_staging) has neither guard: there, a
    # caller that steps before staging_completion saves a torn state silently.
    # A failed staging always fails upload_completion; staging_completion
    # carries the error only if the staging ends after async_save has
    # returned (torch's async_save reports a staging future that is already
    # done as a success), so wait for upload_completion to know the outcome.
    # CUDA tensors: the staging thread's copies run on its own current
    # stream, which is not ordered after the caller's (a step queued on a
    # side stream could be copied half done, and no version counter would
    # tell). So async_save records an event on the current stream of each
    # device holding saved tensors, on the caller's thread, and the staging
    # thread waits for those events before it copies; it also makes the
    # caller's device its own, so the pinned staged copy is made in that
    # device's context, not in a new one on GPU 0.
    # Note [First DCP async save]
    # The default async_save blocks for a staging copy of the state, and the
    # first one of a writer also allocates that copy: fresh memory, which on
    # the 2-core VM costs 0.3-2.6 s per GB to fault in, so it blocked about 3x
    # as long as a synchronous dcp.save (as ebbtide.checkpoint's first async
    # save did, Note [First async save] in cpp/src/ckpt/writer.cpp). So the
    # first call hands DCP the caller's state dict uncopied and asks torch to
    # call synchronize_staging() before async_save returns; that waits until
    # write_data has written and synced the tensors' bytes through the ring
    # (as dcp.save does), or until the upload thread ended without getting
    # there (a planning error: the future carries it). Then a thread makes
    # the staged copy, pages faulted in, for the next call, which waits for
    # it. Only with DCP's thread executor, found in async_save's frame: with
    # the process executor the state is pickled on a thread after
    # async_save returns, so the first call copies as before.
    def synchronize_staging(self):
        pending = self._written
        self._synchronize_after_execute = False
        if pending is None:
            return
        written, before, state_dict = pending
        # DCP's executor started its thread before this call; gone already, or
        # ended without reaching write_data, the upload failed (its future says why).
        uploads = _upload_threads() - before
        while not written.wait(0.01) and any(t.is_alive() for t in uploads):
            pass
        self._written = None  # after write_data took it
        self._cache_filler = threading.Thread(target=self._fill_cache, args=(state_dict,),
                                              name="ebbtide-dcp-staged-copy", daemon=True)
        self._cache_filler.start()

    def _fill_cache(self, state_dict):
        cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        for t, _ in _local_tensors(cache):
            if t.device.type == "cpu" and t.numel():
                t.view(-1).view(torch.uint8).zero_() if t.is_contiguous() else t.zero_()  # faulted in now
        self.state_dict_cache = cache

    def _stage_checked(self, state_dict, versions, handle, ready=(), device=None):
        try:
            if device is not None:
                torch.cuda.set_device(device)
            for ev in ready:
                ev.synchronize()
            _test_hook_gate("staging")
            staged = self._stage_now(state_dict)
            changed = [path for t, v, path in versions if t._version != v]
            if changed:
                raise RuntimeError(
                    f"dcp.async_save to {self.path}: tensor {changed[0]!r}"
                    f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''} was changed in place "
                    "while it was being staged (async_staging=True), so the copy may be torn; nothing was "
                    "written. Wait for the AsyncSaveResponse's staging_completion (every torch.optim step "
                    "does) before changing saved tensors")
            return staged
        finally:
            handle.done()

    def _stage_now(self, state_dict):
        if not self.cache_staged_state_dict:
            staged = _create_cpu_state_dict(state_dict)
            return self._copy_staged(state_dict, staged)
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return self._copy_staged(state_dict, self.state_dict_cache)

    def close(self):
        """Stops the staging thread (async_staging), after the staging it is doing."""
        if self._stager is not None:
            self._stager.shutdown(wait=True)
            self._stager = None

    # Note [Staging copy]
    # async_save blocks its caller for stage() only, and that is one copy of
    # the state. torch's _copy_state_dict copies tensor by tensor with copy_
    # (one core here: about 12 GB/s); the writer's copy() does what a native
    # save's snapshot does (8 MiB pieces over its threads, streaming stores:
    # about 19 GB/s). So the large plain host tensors are copied by the writer
    # first, and _copy_state_dict then runs on a structure in which each of
    # them is replaced by its own staged tensor: copy_ of a tensor onto itself
    # returns at once, and everything else (DTensors, device tensors, small or
    # strided ones, the structure checks) is done by torch as before.
    _NATIVE_COPY_MIN = 1 << 20

    def _copy_staged(self, src, staged):
        copies = {}  # by destination: tied tensors share one staged tensor

        def swap(s, d):
            if type(s) is torch.Tensor and type(d) is torch.Tensor:
                if (s.device.type == "cpu" and d.device.type == "cpu" and s.dtype == d.dtype and s.shape == d.shape
                        and s.is_contiguous() and d.is_contiguous() and s.nbytes >= self._NATIVE_COPY_MIN
                        and not (s.is_conj() or s.is_neg())):
                    copies[d.data_ptr()] = (d.data_ptr(), s.data_ptr(), s.nbytes)
                    return d
                return s
            if isinstance(s, dict) and isinstance(d, dict) and s.keys() == d.keys():
                return {k: swap(v, d[k]) for k, v in s.items()}
            if isinstance(s, (list, tuple)) and isinstance(d, (list, tuple)) and len(s) == len(d):
                out = [swap(a, b) for a, b in zip(s, d)]
                return tuple(out) if isinstance(s, tuple) else out
            return s

        swapped = swap(src, staged)
        self._native.copy(list(copies.values()))
        return _copy_state_dict(swapped, staged)

    # -- StorageWriter --------------------------------------------------------------
    def reset(self, checkpoint_id=None):
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        # A new id for every save, also when DCP does not reset() the writer
        # (dcp.save without checkpoint_id): a save without collectives names
        # its data file after it.
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        self.use_collectives = bool(kwargs.get("use_collectives", True))

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        if not self.use_collectives:
            if self.stripe_dirs:
                raise ValueError("EbbtideWriter: stripe_dirs needs a save with collectives (no rank can "
                                 "commit the stripe directories of a save without them)")
            return self._rank_plans(plans)
        # prepare_global_plan and finish both run on the coordinator.
        self._txn = _core.CkptSaveTransaction.reserve(os.path.abspath(self.path), self.stripe_dirs, STRIPE_RECORD)
        tmp, stripes = self._txn.tmp_dir, list(self._txn.stripes)
        return [dataclasses.replace(p, storage_data=_SavePlanData(f"__{i}_", tmp, stripes))
                for i, p in enumerate(plans)]

    def write_data(self, plan, planner):
        sd = plan.storage_data
        file = os.path.join(sd.tmp_dir, f"{sd.prefix}0.distcp")
        ours = not os.path.lexists(file)  # the native save creates it (O_EXCL) or fails
        try:
            return self._write_data(plan, planner)
        except BaseException:
            try:
                self._drop_failed_save(file if ours else None)
            except Exception as e:  # the write's error is the one to report
                warnings.warn(f"EbbtideWriter: the failed save's files could not be removed ({e}); the next save "
                              "of the checkpoint removes them")
            raise

    # Note [Failed DCP saves]
    # A save whose write_data fails is never finished: DCP raises without
    # calling finish, and gives the storage layer no other signal. Where this
    # process is the only writer (no process group, or a group of one), its
    # save directories are discarded at once; a rank saving without
    # collectives removes the data file it was writing (its name is new to
    # this save, so nothing else refers to it). With several ranks writing
    # into one directory, no rank knows when the others have stopped, so the
    # directories stay until the next save to PATH removes them
    # (SaveTransaction.reserve). The previous checkpoint is untouched either way.
    def _drop_failed_save(self, file):
        if not self.use_collectives:
            try:
                if file is not None:
                    os.unlink(file)
            except FileNotFoundError:
                pass
            return
        alone = not (torch.distributed.is_available() and torch.distributed.is_initialized()
                     and torch.distributed.get_world_size() > 1)
        txn = getattr(self, "_txn", None)
        if alone and self.is_coordinator and txn is not None:
            self._txn = None
            txn.discard()

    def _write_data(self, plan, planner):
        sd = plan.storage_data
        name = f"{sd.prefix}0.distcp"
        file = os.path.join(sd.tmp_dir, name)
        blobs, frames, layout, keep = [], [], [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                raw = bytearray(data.getbuffer())
                buf = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                keep.append(buf)
                blobs.append((fqn, buf.data_ptr(), len(raw), False, 0, 1, "zstd" if self.compress else "none"))
                frames.append((b"", b""))
                layout.append({"kind": "bytes"})
                continue
            t = _device_source(data)  # Note [Device shards]
            on_device = t is not None
            if not on_device:
                t = _owned_storage(data)
            keep.append(t)
            nbytes = t.untyped_storage().nbytes()
            # torch.save's bytes around a storage depend only on the tensor's layout.
            key = (t.dtype, tuple(t.shape), t.stride(), nbytes)
            if key not in self._frames:
                self._frames[key] = _torch_frame(_frame_stand_in(t) if on_device else t, nbytes)
            head, tail = self._frames[key]
            blobs.append((fqn, t.untyped_storage().data_ptr(), nbytes, on_device, tree.core_stream(t.device),
                          t.element_size(), tree.codec_for(t.dtype, self.compress)))
            frames.append((head, tail))
            layout.append({"kind": "tensor", "head": len(head), "dtype": tree.dtype_name(t.dtype),
                           "size": list(t.shape), "stride": list(t.stride())})
        meta = json.dumps({"layout": LAYOUT, "version": LAYOUT_VERSION, "items": layout})
        stripe_files = [os.path.join(d, name) for d in sd.stripes]
        # `keep` holds every blob's memory unchanged until wait() returns (the
        # caller's tensors during dcp.save, or DCP's staged copy during
        # async_save), so the writer copies chunk k while chunk k-1 is being
        # written instead of snapshotting everything first (Note [Pipelined save]).
        unstaged, self._unstaged = self._unstaged, None  # Note [Uncopied DCP saves]
        written = self._written  # Note [First DCP async save]
        try:
            h = self._native.save(file, blobs, meta, block=True, pipelined=True, frames=frames,
                                  stripe_files=stripe_files)
            h.wait()
        finally:
            if written is not None:
                written[0].set()
        del keep
        _test_hook_gate("uncopied-written")
        changed = [path for t, v, path in unstaged or () if t._version != v]
        if changed:
            raise RuntimeError(
                f"dcp.async_save to {self.path}: tensor {changed[0]!r}"
                f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''} was changed in place while "
                f"{file} was being written from it (staging='none'), so the file may hold a torn copy; nothing "
                "was committed. With staging='none', wait for async_save's future before changing saved tensors")
        written = _core.CkptReader(file, stripes=stripe_files).blobs
        desc = ([STRIPED_DESCRIPTOR] if stripe_files else []) + ([COMPRESSED_DESCRIPTOR] if self.compress else [])
        results = [WriteResult(index=item.index, size_in_bytes=b["nbytes"],
                               storage_data=_StorageInfo(name, k if stripe_files else b["offset"], b["nbytes"],
                                                         transform_descriptors=desc or None))
                   for k, (item, b) in enumerate(zip(plan.items, written))]
        fut = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results):
        storage = {}
        for wr_list in results:
            storage.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.version = DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        if not self.use_collectives:
            self._commit_rank(metadata)
            return
        txn = self._txn
        with open(os.path.join(txn.tmp_dir, METADATA_NAME), "xb") as f:
            pickle.dump(metadata, f)  # made durable by the commit
        _test_hook("before-commit")
        record = [(STRIPE_RECORD, json.dumps({"id": txn.id, "stripes": list(txn.stripes)}).encode())]
        # fsyncs, renames, fsyncs the parent, removes the replaced checkpoint's stripes; the
        # replaced checkpoint itself goes on the writer's thread (Note [Deferred removal] in
        # cpp/src/ckpt/writer.cpp). A failed save's directories go with the next save
        # (SaveTransaction.reserve).
        self._native.commit(txn, record if txn.stripes else [])

    def storage_meta(self):
        return _md.StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    # Note [DCP without collectives]
    # dcp.save(..., use_collectives=False) plans, writes and finishes on each
    # rank alone, so no rank can commit the directory for all. The ranks share
    # PATH; rank r writes its data under a name new to this save
    # (__r_<save id>_0.distcp), then __r.metadata by write, fsync and rename,
    # and only then removes its older data files. A save killed at any point
    # leaves that rank's previous metadata and the data it names in place; a
    # data file no metadata names is removed by the rank's next save.
    def _rank_plans(self, plans):
        path = os.path.abspath(self.path)
        os.makedirs(path, exist_ok=True)
        prefix = f"__{self.rank}_{self.save_id[:8]}_"
        return [dataclasses.replace(p, storage_data=_SavePlanData(prefix, path)) for p in plans]

    def _commit_rank(self, metadata):
        path = os.path.abspath(self.path)
        final = os.path.join(path, f"__{self.rank}{METADATA_NAME}")
        tmp = f"{final}.tmp-{self.save_id[:8]}"
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        _test_hook("before-commit")
        os.replace(tmp, final)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        named = {si.relative_path for si in metadata.storage_data.values()}
        mine = re.compile(rf"__{self.rank}_[0-9a-f]{{8}}_\d+\.distcp$|__{self.rank}{re.escape(METADATA_NAME)}\.tmp-")
        for name in os.listdir(path):
            if mine.match(name) and name not in named:
                try:
                    os.remove(os.path.join(path, name))
                except OSError as e:
                    warnings.warn(f"ebbtide.dcp: {os.path.join(path, name)}, left by an earlier save, could not "
                                  f"be removed ({e})", RuntimeWarning, stacklevel=2)


def _test_hook(point):
    """Crash tests: EBBTIDE_DCP_TEST_PARK=<point> parks the saving process at
    `point` (after writing a file <tmp>/PARKED) until it is killed."""
    if _core.env_setting("EBBTIDE_DCP_TEST_PARK") == point:
        import time

        marker = _core.env_setting("EBBTIDE_DCP_TEST_PARK_MARKER")
        with open(marker, "w") as f:
            f.write(point)
        while True:
            time.sleep(3600)


_test_gates = {}  # point -> callable, run where _test_hook_gate(point) is reached (tests only)


def _test_hook_gate(point):
    """Tests stage races deterministically: a callable in _test_gates[point]
    runs (and may block) where the code reaches `point`."""
    fn = _test_gates.get(point)
    if fn is not None:
        fn()


# -- metadata --------------------------------------------------------------------------
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n): getattr(_md, n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a lookup in torch's layouts
_ALLOWED[("pathlib", "PosixPath")] = pathlib.PosixPath
_ALLOWED[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Note [DCP metadata safety]: only DCP metadata types can be created."""

    def __init__(self, f, where):
        super().__init__(f)
        self.where = where

    def find_class(self, module, name):
        obj = _ALLOWED.get((module, name))
        if obj is None and module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            obj = getattr(torch, name)
        if obj is None:
            raise fail("dcp.meta.class", self.where, module=module, name=name)
        return obj


def _is_int(x):
    return type(x) is int and 0 <= x <= check.MAX_INT


def _check_metadata(md, where):
    """Checks DCP metadata `md` (read from `where`) field by field (Note [DCP
    metadata safety]), and that its entries and its storage_data name each
    other: every chunk a load may ask for is stored, every stored item is a
    chunk of an entry (so a load of the whole state reads every data file
    inspect checks)."""
    if not isinstance(md, _md.Metadata):
        raise fail("dcp.meta.type", where, type=type(md).__name__)
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise fail("dcp.meta.dicts", where)
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise fail("dcp.meta.fqn", where, fqn=fqn)
        if isinstance(m, _md.BytesStorageMetadata):
            continue
        if not isinstance(m, _md.TensorStorageMetadata) or not isinstance(m.properties, _md.TensorProperties):
            raise fail("dcp.meta.entry", where, fqn=fqn, type=type(m).__name__)
        if not isinstance(m.properties.dtype, torch.dtype):
            raise fail("dcp.meta.dtype", where, fqn=fqn, dtype=m.properties.dtype)
        if not isinstance(m.size, tuple) or len(m.size) > check.MAX_DIMS or not all(map(_is_int, m.size)):
            raise fail("dcp.meta.size", where, fqn=fqn, size=m.size)
        if not isinstance(m.chunks, list):
            raise fail("dcp.meta.chunks", where, fqn=fqn)
        for c in m.chunks:
            if (not isinstance(c, _md.ChunkStorageMetadata) or not isinstance(c.offsets, tuple)
                    or not isinstance(c.sizes, tuple) or len(c.offsets) != len(m.size)
                    or len(c.sizes) != len(m.size) or not all(map(_is_int, c.offsets))
                    or not all(map(_is_int, c.sizes))
                    or any(o + s > n for o, s, n in zip(c.offsets, c.sizes, m.size))):
                raise fail("dcp.meta.chunk", where, fqn=fqn, chunk=c, size=tuple(m.size))
    if md.storage_meta is not None and not isinstance(md.storage_meta, _md.StorageMeta):
        raise fail("dcp.meta.storage_meta", where, type=type(md.storage_meta).__name__)
    for idx, si in md.storage_data.items():
        if (not isinstance(idx, _md.MetadataIndex) or not isinstance(idx.fqn, str)
                or not (idx.offset is None or isinstance(idx.offset, tuple) and all(map(_is_int, idx.offset)))):
            raise fail("dcp.meta.storage_key", where, key=idx)
        if not isinstance(si, _StorageInfo):
            raise fail("dcp.meta.storage_info", where, fqn=idx.fqn, type=type(si).__name__)
        p = si.relative_path
        if (not isinstance(p, str) or p in ("", ".", "..") or "/" in p or "\0" in p or p == METADATA_NAME):
            raise fail("dcp.meta.file_name", where, fqn=idx.fqn, name=p)
        if not _is_int(si.offset) or not _is_int(si.length):
            raise fail("dcp.meta.range", where, fqn=idx.fqn, offset=si.offset, length=si.length)
        d = si.transform_descriptors
        if d is not None and (not isinstance(d, (list, tuple)) or not all(isinstance(x, str) for x in d)):
            raise fail("dcp.meta.transforms", where, fqn=idx.fqn, descriptors=d)
    for fqn, m in md.state_dict_metadata.items():  # MetadataIndex compares by fqn and offset, as DCP's planner asks
        if isinstance(m, _md.BytesStorageMetadata):
            if _md.MetadataIndex(fqn) not in md.storage_data:
                raise fail("dcp.meta.unstored", where, what="bytes entry", fqn=fqn, at="")
            continue
        for c in m.chunks:
            if _md.MetadataIndex(fqn, c.offsets) not in md.storage_data:
                raise fail("dcp.meta.unstored", where, what="chunk of tensor", fqn=fqn, at=f" at {tuple(c.offsets)}")
    chunks = _chunk_table(md)
    for idx in md.storage_data:
        m = md.state_dict_metadata.get(idx.fqn)
        if isinstance(m, _md.BytesStorageMetadata):
            listed = idx.offset is None
        else:
            listed = idx.offset is not None and (idx.fqn, tuple(idx.offset)) in chunks
        if not listed:
            raise fail("dcp.meta.unlisted", where, fqn=idx.fqn, offset=None if idx.offset is None else
                       tuple(idx.offset), what="bytes entry" if isinstance(m, _md.BytesStorageMetadata) else
                       "chunk of a tensor")


def rank_metadata_ranks(path):
    """The ranks with a ``__<rank>.metadata`` in `path` (a save without
    collectives), in order."""
    ranks = []
    for name in os.listdir(path):
        m = re.fullmatch(r"__(\d+)" + re.escape(METADATA_NAME), name)
        if m:
            ranks.append(int(m.group(1)))
    return sorted(ranks)


def _metadata_name(rank=None):
    return METADATA_NAME if rank is None else f"__{int(rank)}{METADATA_NAME}"


def load_metadata(path, rank=None):
    """Reads and checks the ``.metadata`` of DCP checkpoint directory `path`
    (Note [DCP metadata safety]).

    Args:
        path: checkpoint directory.
        rank: read rank `rank`'s ``__<rank>.metadata`` instead, written by a
            save without collectives (Note [DCP without collectives]).

    Returns:
        torch.distributed.checkpoint.metadata.Metadata

    Raises:
        FileNotFoundError: no .metadata (not a DCP checkpoint, or a save that
            was killed before its commit).
        ValueError: the file is not valid, safe DCP metadata.
    """
    mp = os.path.join(os.fspath(path), _metadata_name(rank))
    try:
        raw = check.read_regular_file(mp, "DCP metadata", limit=MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise FileNotFoundError(f"{mp}: no DCP metadata; {path} is not a committed checkpoint (a save killed "
                                "before its commit leaves the previous checkpoint in place and its own files "
                                "in PATH.tmp-*)") from None
    try:
        md = _MetadataUnpickler(io.BytesIO(raw), mp).load()
    except ValueError as e:
        if getattr(e, "check", None):
            raise
        raise fail("dcp.meta.pickle", mp, type=type(e).__name__, error=e) from None
    except Exception as e:  # truncated or corrupt pickle: any of pickle's many error types
        raise fail("dcp.meta.pickle", mp, type=type(e).__name__, error=e) from None
    _check_metadata(md, mp)
    return md


# -- reader ----------------------------------------------------------------------------------
def _check_layout(meta, blobs, file):
    """Checks a shard's JSON metadata written by EbbtideWriter against its blob table."""
    if not isinstance(meta, dict) or meta.get("layout") != LAYOUT or meta.get("version") != LAYOUT_VERSION:
        raise fail("dcp.shard.layout", file, layout=str(meta.get("layout") if isinstance(meta, dict) else meta)[:64])
    items = meta.get("items")
    if not isinstance(items, list) or len(items) != len(blobs):
        raise fail("dcp.shard.items", file, items=len(items) if isinstance(items, list) else "no", blobs=len(blobs))
    for k, (it, b) in enumerate(zip(items, blobs)):
        if not isinstance(it, dict) or it.get("kind") not in ("bytes", "tensor"):
            raise fail("dcp.shard.item_kind", file, k=k)
        if it["kind"] == "bytes":
            continue
        if not isinstance(it.get("dtype"), str):
            raise fail("dcp.shard.item_dtype", file, k=k)
        dtype = tree.dtype_from_name(it["dtype"], f"{file}: item {k}")
        size, stride, head = it.get("size"), it.get("stride"), it.get("head")
        if (not isinstance(size, list) or not isinstance(stride, list) or len(size) != len(stride)
                or len(size) > check.MAX_DIMS or not all(map(_is_int, size + stride)) or not _is_int(head)):
            raise fail("dcp.shard.item_layout", file, k=k, size=size, stride=stride, head=head)
        extent = 0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride))
        need = extent * dtype.itemsize
        if need and (head % dtype.itemsize or head + need > b["nbytes"]):
            raise fail("dcp.shard.item_fit", file, k=k, name=b["name"][:200], size=tuple(size), dtype=dtype,
                       head=head, nbytes=b["nbytes"])
        it["_dtype"], it["_nbytes"] = dtype, need  # the bytes the tensor spans from `head`
    return items


def read_stripe_dirs(path):
    """The stripe directories of DCP checkpoint directory `path` (Note [DCP
    striping]), from its stripe record, each checked to be a stripe directory
    of this checkpoint: [] for an unstriped checkpoint; ValueError naming the
    record and a refused entry."""
    rp = os.path.join(os.fspath(path), STRIPE_RECORD)
    try:
        raw = check.read_regular_file(rp, "stripe record")
    except FileNotFoundError:
        return []
    try:
        rec = check.parse_json(raw)
    except (ValueError, RecursionError) as e:
        raise fail("dcp.stripes.json", rp, error=e) from None
    ckpt_id = rec.get("id") if isinstance(rec, dict) else None
    dirs = rec.get("stripes") if isinstance(rec, dict) else None
    if not isinstance(ckpt_id, str) or not check.ID.fullmatch(ckpt_id) or not isinstance(dirs, list) or \
            len(dirs) > 255:
        raise fail("dcp.stripes.fields", rp)
    owner = os.path.abspath(os.fspath(path))
    for d in dirs:
        try:
            ok = isinstance(d, str) and _core.ckpt_owned_stripe_dir(d, owner, ckpt_id)
        except (TypeError, UnicodeError):  # a string the core cannot take (lone surrogates)
            ok = False
        if not ok:
            raise fail("dcp.stripes.entry", rp, entry=str(d)[:200], path=owner, id=ckpt_id)
    return dirs


class _Shard:
    """An ebbtide shard written by EbbtideWriter, opened and checked; its
    stripe files in `stripes` (Note [DCP striping])."""

    def __init__(self, file, stripes=()):
        self.stripe_files = [os.path.join(d, os.path.basename(file)) for d in stripes]
        try:
            self.reader = _core.CkptReader(file, stripes=self.stripe_files)
        except check.READER_ERRORS as e:
            raise tag(e, "dcp.shard.tables")
        try:
            self.reader.check_extents()
        except check.READER_ERRORS as e:
            raise tag(e, "dcp.shard.extents")
        self.blobs = self.reader.blobs
        try:
            meta = check.parse_json(self.reader.meta)
        except (ValueError, RecursionError) as e:
            raise fail("dcp.shard.json", file, error=e) from None
        self.items = _check_layout(meta, self.blobs, file)
        self.by_range = {(b["offset"], b["nbytes"]): k for k, b in enumerate(self.blobs)}
        self.file = file

    def blob_of(self, si, fqn):
        """The blob that DCP storage info `si` (of item `fqn`) names: by its
        byte range, or in a striped shard by its index; ValueError when it
        names none or its transform descriptors do not match the blob."""
        desc = list(si.transform_descriptors or ())
        striped = desc[:1] == [STRIPED_DESCRIPTOR]
        if striped != bool(self.stripe_files):
            kind = f"striped over {len(self.stripe_files)} stripe files" if self.stripe_files else "unstriped"
            raise fail("dcp.item.striping", self.file, fqn=fqn, descriptors=desc, kind=kind)
        if striped:
            k = si.offset if si.offset < len(self.blobs) and self.blobs[si.offset]["nbytes"] == si.length else None
        else:
            k = self.by_range.get((si.offset, si.length))
        if k is None:
            raise fail("dcp.item.blob", self.file, fqn=fqn, what="blob" if striped else "bytes", offset=si.offset,
                       length=si.length, verb="is" if striped else "are")
        rest = desc[1:] if striped else desc  # the stripe descriptor comes first
        if rest not in ([], [COMPRESSED_DESCRIPTOR]) or (self.blobs[k]["codec"] != "none" and not rest):
            raise fail("dcp.item.transforms", self.file, fqn=fqn, descriptors=si.transform_descriptors,
                       codec=self.blobs[k]["codec"])
        return k


def _chunk_table(md):
    """{(fqn, offsets): chunk} of every tensor entry's chunks."""
    return {(fqn, tuple(c.offsets)): c for fqn, m in md.state_dict_metadata.items()
            if isinstance(m, _md.TensorStorageMetadata) for c in m.chunks}


def _check_stored_tensor(md, chunks, idx, dtype, size, file, check_id):
    """A stored chunk of tensor entry idx.fqn has the dtype and sizes the
    metadata gives it (what a load into a state shaped as the metadata says
    needs). `chunks`: _chunk_table(md), in which _check_metadata found it."""
    m = md.state_dict_metadata[idx.fqn]
    sizes = list(chunks[(idx.fqn, tuple(idx.offset))].sizes)
    if dtype != m.properties.dtype or list(size) != sizes:
        raise fail(check_id, file, fqn=idx.fqn, dtype=str(dtype).replace("torch.", ""), size=list(size),
                   md_dtype=str(m.properties.dtype).replace("torch.", ""), md_size=sizes)


class _DataFile:
    """A data file of a DCP checkpoint, checked as a load needs it (Note [One
    validator] in _ckpt_checks.py): `shard` (an ebbtide shard, its items'
    blobs and layouts checked against the metadata) or None (a plain file of
    torch's FileSystemWriter, its byte ranges inside it); `size` its bytes;
    `entries` its (MetadataIndex, _StorageInfo); `chunks` _chunk_table(md);
    `stripes()` the checkpoint's stripe directories."""

    def __init__(self, path, md, chunks, name, entries, stripes):
        self.file = os.path.join(path, name)
        self.entries = entries
        try:
            self.size, is_shard = _core.ckpt_probe_file(self.file)
        except check.READER_ERRORS as e:
            raise tag(e, "dcp.file")
        self.shard = None
        if not is_shard:
            for idx, si in entries:
                if si.offset + si.length > self.size:
                    raise fail("dcp.plain.range", self.file, fqn=idx.fqn, offset=si.offset, length=si.length,
                               size=self.size)
                if si.transform_descriptors:
                    raise fail("dcp.plain.transforms", self.file, fqn=idx.fqn, descriptors=si.transform_descriptors)
            return
        shard = _Shard(self.file, stripes())
        blobs = [shard.blob_of(si, idx.fqn) for idx, si in entries]
        named = set(blobs)
        for k, b in enumerate(shard.blobs):  # a load reads the blobs the metadata names
            if k not in named:
                raise fail("dcp.shard.blob_unused", self.file, k=k, name=b["name"][:200])
        for (idx, _), k in zip(entries, blobs):
            it = shard.items[k]
            listed = isinstance(md.state_dict_metadata[idx.fqn], _md.TensorStorageMetadata)
            if (it["kind"] == "tensor") != listed:
                raise fail("dcp.item.kind", self.file, fqn=idx.fqn, stored="bytes" if listed else "a tensor",
                           listed="a tensor" if listed else "bytes")
            if listed:
                _check_stored_tensor(md, chunks, idx, it["_dtype"], it["size"], self.file, "dcp.item.tensor")
        self.shard = shard

    def plain_tensor(self, md, chunks, idx, si, buf):
        """The tensor torch.save'd in bytes `buf` of item `idx` of this plain
        file, checked to be the chunk the metadata lists (data checks: load()
        and a verifying inspect make them)."""
        try:
            t = torch.load(io.BytesIO(buf.numpy()), map_location="cpu", weights_only=True)
        except Exception as e:
            raise fail("dcp.plain.frame", self.file, fqn=idx.fqn, offset=si.offset, length=si.length,
                       error=f"{type(e).__name__}: {str(e)[:300]}") from None
        if not isinstance(t, torch.Tensor):
            raise fail("dcp.plain.object", self.file, fqn=idx.fqn, type=type(t).__name__)
        _check_stored_tensor(md, chunks, idx, t.dtype, t.shape, self.file, "dcp.plain.tensor")
        return t


def _files_of(md):
    """{data file name: [(MetadataIndex, _StorageInfo), ...]} of checked metadata."""
    out = {}
    for idx, si in md.storage_data.items():
        out.setdefault(si.relative_path, []).append((idx, si))
    return out


class EbbtideReader(_DirectoryId, StorageReader):
    """DCP StorageReader reading through ebbtide's C++ reader. Loads
    checkpoints written by EbbtideWriter (checksums verified, compressed or
    not) and by torch's FileSystemWriter.

    Args:
        path: checkpoint directory.
        threads: reader threads (0: the reader's default).
        batch_bytes: most bytes of one file read ahead at once.

    Raises:
        FileNotFoundError: no .metadata in `path` (read_metadata).
        ValueError: hostile or corrupt metadata or data, naming the file and
            the item (Note [DCP metadata safety]).
        ebbtide._core.ChecksumError: data that fails its crc32c.

    Example:
        >>> dcp.load(state, storage_reader=EbbtideReader("/ckpt/step100"))
    """

    def __init__(self, path, *, threads=0, batch_bytes=256 << 20):
        super().__init__()
        self.path = os.fspath(path)
        self.threads = threads
        self.batch_bytes = batch_bytes
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())
        self._stripes = None

    def reset(self, checkpoint_id=None):
        self.storage_data = {}
        self._stripes = None
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args, **kwargs):
        # rank: the rank-local metadata of a save without collectives (Note
        # [DCP without collectives]); DCP asks for it when .metadata is missing.
        rank = kwargs.get("rank")
        self._stripes = None  # a reader kept across loads (no reset) reads the stripes of the checkpoint as it is now
        self._metadata_file = os.path.join(self.path, _metadata_name(rank))
        md = load_metadata(self.path, rank=rank)
        if md.storage_meta is None:
            md.storage_meta = _md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        _check_metadata(metadata, getattr(self, "_metadata_file", os.path.join(self.path, METADATA_NAME)))
        self.metadata = metadata
        self.storage_data = metadata.storage_data
        self._chunks = _chunk_table(metadata)

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        per_file = {}
        for req in plan.items:
            si = self.storage_data.get(req.storage_index)
            if si is None:
                raise ValueError(f"{self.path}: the load plan asks for {req.storage_index}, which the checkpoint's "
                                 "metadata does not list")
            per_file.setdefault(si.relative_path, []).append(req)
        entries = _files_of(self.metadata)
        for name, reqs in per_file.items():
            # Each file read is checked whole first, as inspect checks it (Note [One validator] in _ckpt_checks.py).
            f = _DataFile(self.path, self.metadata, self._chunks, name, entries[name], self._stripe_dirs)
            if f.shard is not None:
                self._read_shard(f.shard, reqs, planner)
            else:
                self._read_plain(f, reqs, planner)
        fut = Future()
        fut.set_result(None)
        return fut

    def _stripe_dirs(self):
        if self._stripes is None:
            self._stripes = read_stripe_dirs(self.path)
        return self._stripes

    def _batches(self, reqs, size_of):
        batch, total = [], 0
        for r in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
            n = size_of(r)
            if batch and total + n > self.batch_bytes:
                yield batch
                batch, total = [], 0
            batch.append(r)
            total += n
        if batch:
            yield batch

    def _read_shard(self, shard, reqs, planner):
        def blob_of(r):
            return shard.blob_of(self.storage_data[r.storage_index], r.storage_index.fqn)

        for batch in self._batches(reqs, lambda r: self.storage_data[r.storage_index].length):
            bufs, into, rest = {}, [], []  # rest: (request, blob) read through a buffer of the blob
            for r in batch:
                k = blob_of(r)
                target = self._whole_target(shard, k, r, planner)
                if target is not None:
                    into.append((r, target, (k, shard.items[k]["head"], target.data_ptr(), target.nbytes,
                                             target.device.type == "cuda", tree.core_stream(target.device))))
                    continue
                rest.append((r, k))
                if k not in bufs:
                    bufs[k] = _host_buffer(shard.blobs[k]["nbytes"])
            try:  # every chunk of the blobs is checked (Note [Parts are checked whole] in cpp/src/ckpt/reader.cpp)
                if into:
                    shard.reader.read_parts([part for _, _, part in into], threads=self.threads)
                if bufs:
                    shard.reader.read([(k, b.data_ptr(), b.nbytes, False, 0) for k, b in bufs.items()],
                                      threads=self.threads)
            except check.READER_ERRORS as e:
                raise tag(e, "ckpt.chunk")
            for r, target, _ in into:
                planner.commit_tensor(r, target)
            for r, k in rest:  # each item's kind is the metadata's (_DataFile), so DCP's request's
                it, buf = shard.items[k], bufs[k]
                if r.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(r, io.BytesIO(buf.numpy().tobytes()))
                    continue
                if it["_nbytes"] == 0:
                    t = torch.empty(it["size"], dtype=it["_dtype"])
                else:
                    data = buf[it["head"]:it["head"] + it["_nbytes"]].view(it["_dtype"])
                    t = torch.as_strided(data, it["size"], it["stride"])
                self._commit(planner, r, t, shard.file)

    # Note [Reading into the targets]
    # A load into an existing state (the usual resume) asks for whole stored
    # tensors into tensors of the same dtype, shape and layout. Those are read
    # straight into the target: the tensor's bytes inside its torch.save frame
    # are a byte range of the blob (ShardReader::read with a part, checksums
    # verified chunk by chunk as ever), so no buffer of the blob is allocated
    # (fresh memory costs more than the read on some VMs: docs/benchmarks.md)
    # and nothing is copied twice. CUDA targets too (FSDP's shards on the
    # GPU), where the core can drive CUDA: each chunk goes from its pinned
    # staging buffer to the device on the target's current stream, and the
    # read waits for those copies. Resharded requests, other dtypes or
    # layouts and bytes items take the buffer path.
    @staticmethod
    def _whole_target(shard, k, req, planner):
        it = shard.items[k]
        if req.type == LoadItemType.BYTE_IO or it["kind"] != "tensor":
            return None  # the buffer path reports a kind mismatch
        size, stride = it["size"], it["stride"]
        if 0 in size or list(req.storage_offsets) != [0] * len(size) or list(req.lengths) != size:
            return None
        want, acc = [], 1
        for n in reversed(size):
            want.append(acc)
            acc *= n
        if stride != want[::-1]:
            return None
        target = planner.resolve_tensor(req).detach()
        if (target.device.type not in _direct_devices() or target.dtype != it["_dtype"] or list(target.shape) != size
                or not target.is_contiguous() or target.is_conj() or target.is_neg()):
            return None
        return target

    def _read_plain(self, f, reqs, planner):
        """Reads the items `reqs` of plain file `f` (a _DataFile, its ranges checked)."""
        for batch in self._batches(reqs, lambda r: self.storage_data[r.storage_index].length):
            ranges, bufs = [], {}
            for r in batch:
                si = self.storage_data[r.storage_index]
                key = (si.offset, si.length)
                if key not in bufs:
                    bufs[key] = torch.empty(si.length, dtype=torch.uint8)
                    ranges.append((si.offset, si.length, bufs[key].data_ptr()))
            _core.ckpt_read_file_ranges(f.file, ranges)
            for r in batch:
                si = self.storage_data[r.storage_index]
                buf = bufs[(si.offset, si.length)]
                if r.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(r, io.BytesIO(buf.numpy().tobytes()))
                    continue
                self._commit(planner, r, f.plain_tensor(self.metadata, self._chunks, r.storage_index, si, buf), f.file)

    @staticmethod
    def _commit(planner, req, tensor, file):
        if any(o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, tensor.shape)) or \
                len(req.storage_offsets) != tensor.dim():
            raise ValueError(f"{file}: item {req.storage_index.fqn!r}: stored chunk of shape {tuple(tensor.shape)} "
                             f"does not hold the requested offsets {tuple(req.storage_offsets)} and lengths "
                             f"{tuple(req.lengths)}")
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise ValueError(f"{file}: item {req.storage_index.fqn!r}: stored shape {tuple(tensor.size())} does not "
                             f"match the target's {tuple(target.size())}")
        if target.dtype != tensor.dtype:
            raise ValueError(f"{file}: item {req.storage_index.fqn!r}: stored dtype {tensor.dtype} does not match "
                             f"the target's {target.dtype}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


# -- inspection ------------------------------------------------------------------------------
def inspect(path, verify=True, rank=None, progress=None):
    """What `ebbtide ckpt inspect` shows of DCP checkpoint directory `path`
    (with `rank`: of that rank's part of a save without collectives, Note
    [DCP without collectives]), checked as EbbtideReader checks what it loads,
    by the same code (Note [One validator] in _ckpt_checks.py).

    Returns a dict: ``path``, ``items`` (one per state-dict entry: ``fqn``,
    ``kind`` "tensor" | "bytes", ``dtype``, ``size``, ``chunks``, ``bytes``),
    ``files`` (one per data file: ``file``, ``writer`` "ebbtide" |
    "FileSystemWriter", ``file_bytes``, ``items``, ``bytes``, ``codecs``, for
    ebbtide's files ``stripe_files``, Note [DCP striping]) and
    ``errors`` (one line each: a data file a load would refuse, with its
    reason; with `verify` also a chunk failing its checksum or decoding, and
    a plain file's item that is not the torch.save'd chunk the metadata
    lists). Without `verify` no tensor data is read. `progress`: optional
    f(done_bytes, total_bytes), called after each data file with the bytes
    the metadata gives the files checked so far.

    Raises:
        FileNotFoundError, ValueError: no or unusable ``.metadata`` (load_metadata).
    """
    path = os.fspath(path)
    md = load_metadata(path, rank=rank)
    items = []
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, _md.TensorStorageMetadata):
            items.append(dict(fqn=fqn, kind="tensor", dtype=str(m.properties.dtype).replace("torch.", ""),
                              size=list(m.size), chunks=len(m.chunks),
                              bytes=math.prod(m.size) * m.properties.dtype.itemsize))
        else:
            items.append(dict(fqn=fqn, kind="bytes", dtype=None, size=None, chunks=1, bytes=None))
    per_file = _files_of(md)
    chunks = _chunk_table(md)
    stripes = []

    def stripe_dirs():
        if not stripes:
            stripes.append(read_stripe_dirs(path))
        return stripes[0]

    files, errors = [], []
    total = sum(si.length for entries in per_file.values() for _, si in entries)
    done = 0
    for name in sorted(per_file):
        if progress is not None:
            progress(done, total)
        infos = [si for _, si in per_file[name]]
        entry = dict(file=name, items=len(infos), bytes=sum(si.length for si in infos))
        done += entry["bytes"]
        files.append(entry)
        try:
            f = _DataFile(path, md, chunks, name, per_file[name], stripe_dirs)
        except check.READER_ERRORS as e:
            errors.append(str(e))
            continue
        entry["file_bytes"] = f.size
        entry["writer"] = "ebbtide" if f.shard is not None else "FileSystemWriter"
        if f.shard is not None:
            entry["codecs"] = sorted({b["codec"] for b in f.shard.blobs})
            entry["stripe_files"] = f.shard.stripe_files
            if verify:
                for _blob, _off, msg in f.shard.reader.verify():
                    errors.append(msg)
            continue
        entry["codecs"] = ["none"]
        if verify:
            errors.extend(_verify_plain(f, md, chunks))
    if progress is not None:
        progress(total, total)
    return dict(path=path, items=items, files=files, errors=errors)


def _verify_plain(f, md, chunks):
    """The data checks EbbtideReader makes on the tensor items of plain file
    `f`, one item at a time: [error line, ...]."""
    errors = []
    for idx, si in f.entries:
        if not isinstance(md.state_dict_metadata[idx.fqn], _md.TensorStorageMetadata):
            continue
        buf = torch.empty(si.length, dtype=torch.uint8)
        try:
            _core.ckpt_read_file_ranges(f.file, [(si.offset, si.length, buf.data_ptr())])
            f.plain_tensor(md, chunks, idx, si, buf)
        except check.READER_ERRORS as e:
            errors.append(str(e))
    return errors
