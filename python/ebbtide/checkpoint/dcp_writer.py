"""The DCP plugin's writer: ``EbbtideWriter`` for ``dcp.save`` and
``dcp.async_save`` (the C++ checkpoint writer, the commit by rename), and the
torch.save framing of each tensor blob. async_save's staging is in
dcp_staging.py; the file layout and its Notes ([DCP layout], [DCP striping],
[DCP metadata safety]) are in dcp_format.py; ``ebbtide.dcp`` re-exports the
public names.
"""
import dataclasses
import functools
import json
import os
import pickle
import re
import uuid
import warnings

import torch
from torch.futures import Future
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint import state_dict_saver as _saver
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ebbtide import _core
from ebbtide.checkpoint import tree
from ebbtide.checkpoint.dcp_staging import DcpStager
from ebbtide.checkpoint.native_save import _stripe_dir_list
from ebbtide.checkpoint.dcp_format import (COMPRESSED_DESCRIPTOR, DCP_VERSION, LAYOUT, LAYOUT_VERSION,
                                           METADATA_NAME, STRIPED_DESCRIPTOR, STRIPE_RECORD, _DirectoryId,
                                           _test_hook, _test_hook_gate)


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
# cpp/src/ckpt/writer_shard.cpp) while earlier chunks are written, instead of a
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


class EbbtideWriter(_DirectoryId, StorageWriter, DcpStager):
    """DCP StorageWriter writing through ebbtide's C++ checkpoint writer.

    One file per rank, crash-safe: every rank writes into ``PATH.tmp-*``; the
    coordinator writes ``.metadata`` and commits the directory by rename, so
    PATH is always the previous complete checkpoint or the new one. Reuse one
    writer across saves to keep its buffers (a 64 MiB ring the writes go
    through, EBBTIDE_CKPT_RING; and, for async_save, a staging buffer the
    size of the state that its staged copies land in, Note [Staging buffer]).

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
            state for the next async_save, in the writer's staging buffer
            (faster staging, one state of host memory held; the first call
            writes the state through instead, Note [First DCP async save]).
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
        DcpStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
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
        self._init_staging()
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
        for k in ("_native", "_stager", "_txn", "state_dict_cache", "_unstaged", "_written", "_filler", "_views",
                  "_copier", "_copying"):
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_staging()  # the version counters, threads and staged copies stay with the caller's process
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
        also done when the writer is destroyed); and until a staging buffer
        being filled for the next async_save is ready (Note [First DCP async
        save] in dcp_staging.py)."""
        self._join_filler()
        self._native.join()

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
        _test_hook_gate("staging-copy-wait")
        self._wait_copied([b[1] for b in blobs])  # Note [Overlapped staging copy]: the staged bytes are whole
        unstaged, self._unstaged = self._unstaged, None  # Note [Uncopied DCP saves]
        written = self._written  # Note [First DCP async save]
        try:
            h = self._native.save(file, blobs, meta, block=True, pipelined=True, frames=frames,
                                  stripe_files=stripe_files)
            if written is not None:
                # The caller's tensors may change once the save reads them no
                # more: every chunk in the ring (its last writes, the header and
                # the syncs go on without them).
                h.wait_copied()
                written[0].set()
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
