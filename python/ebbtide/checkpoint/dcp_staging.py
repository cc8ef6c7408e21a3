"""The DCP plugin's staging: what ``EbbtideWriter.stage`` does for
``dcp.async_save``. The copy of the state async_save makes before it
returns lands in a staging buffer the C++ writer keeps across saves (Note
[Staging buffer] in cpp/src/ckpt/writer_arena.cpp); a call that finds no
buffer ready writes the state through instead (Note [First DCP async
save]); ``async_staging=True`` copies on a thread of its own (Note [Async
staging]); ``staging="none"`` copies nothing (Note [Uncopied DCP saves]).
EbbtideWriter (dcp_writer.py) mixes ``DcpStager`` in.
"""
import concurrent.futures
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict, _iterate_state_dict
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from ebbtide import _fork
from ebbtide.checkpoint import native_save as _checkpoint
from ebbtide.checkpoint import staging
from ebbtide.checkpoint.dcp_format import _test_hook_gate


class _StagingHandle:
    """A pending async staging copy, in native_save.py's registry of background
    snapshots that torch.optim steps wait for (Note [Async staging])."""

    def __init__(self):
        self._origin = _fork.Origin()  # a forked child's optimizer steps do not wait for it (Note [Objects across fork])
        self._event = threading.Event()
        self.snapshot_wait_seconds = 0.0

    def staged(self):
        return self._event.is_set()

    def wait_staged(self):
        self._event.wait()

    def done(self):
        self._event.set()
        _checkpoint._background.discard(self)


def _upload_kind():
    """How torch's async_save, the caller, uploads: "thread" (its thread
    executor), "process" (its checkpoint process, or a torch whose
    async_save this cannot read: the staged copy may be pickled), or None
    when stage() was not called by async_save. Read from async_save's frame."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_name != "async_save":
        f = f.f_back
    if f is None:
        return None
    kind = getattr(f.f_locals.get("async_checkpointer_type"), "value", None)
    return "thread" if kind == "thread" else "process"


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


def _over_tensors(state_dict, tensor_func):
    """state_dict rebuilt by _iterate_state_dict with tensor_func(t) for each
    plain tensor, the local tensor of each DTensor and each shard of a
    ShardedTensor (torch's _create_cpu_state_dict's structure and order)."""
    import copy

    def dtensor(obj, pg, device, _):
        if len(obj.size()) == 0:
            return obj
        ret = obj.to(device="cpu") if obj.device != torch.device("cpu") else copy.deepcopy(obj)
        ret._local_tensor = tensor_func(obj._local_tensor)
        return ret

    def sharded(obj, pg, device, _):
        if not obj.local_shards():
            return obj
        ret = obj.to(device="cpu") if obj.device != torch.device("cpu") else copy.deepcopy(obj)
        for ours, theirs in zip(ret.local_shards(), obj.local_shards()):
            ours.tensor = tensor_func(theirs.tensor)
        return ret
    return _iterate_state_dict(state_dict, sharded, dtensor, lambda t, pg, device, _: tensor_func(t), pg=None,
                               device=None, cpu_offload=False, ranks_only=(), type_check=False)


def _staged_views(state_dict, native):
    """A staged copy's structure for `state_dict` (what torch's
    _create_cpu_state_dict makes) whose tensors lie in the writer's staging
    buffer (staging.BufferViews); None when it does not fit."""
    try:
        return _over_tensors(state_dict, staging.BufferViews(native).view)
    except staging.NoRoom:
        return None


def _layout_key(state_dict):
    """What decides a staged copy's structure: each tensor's path, dtype, shape and device type."""
    return tuple((p, t.dtype, tuple(t.shape), t.device.type) for t, p in _local_tensors(state_dict))


class DcpStager(BlockingAsyncStager):
    """EbbtideWriter's AsyncStager half: stage() and synchronize_staging()
    (torch's protocol), close(), and the staging buffer's filler. The writer
    sets self._native (its C++ writer), cache_staged_state_dict,
    async_staging and staging."""

    def _init_staging(self):
        self._unstaged = None  # staging="none": the saved tensors' version counters (Note [Uncopied DCP saves])
        self._written = None  # a written-through async_save: set once its bytes are (Note [First DCP async save])
        self._filler = None  # fills the writer's staging buffer (Note [Staging buffer]); made with _native
        self._views = None  # (layout key, buffer address, staged structure over the staging buffer)
        self._stager = None  # the staging thread (async_staging)
        self._copier = None  # runs the writer's staging copy beside torch's set-up (Note [Overlapped staging copy])
        self._copying = None  # that copy: (Future, first and end address it writes, upload threads before it)

    def stage(self, state_dict):
        """async_save's staging: a CPU copy of `state_dict` (kept for the next
        call with cache_staged_state_dict, in the writer's staging buffer:
        Note [Staging buffer]). With async_staging, a Future of that copy,
        made on the writer's staging thread (Note [Async staging]). With
        staging="none", and on the first call (Note [First DCP async save]),
        `state_dict` itself."""
        if self.staging == "none":
            self._unstaged = list(_saved_versions(state_dict))
            return state_dict
        kind = _upload_kind()
        self._finish_copying()  # a copy an async_save that raised left running: before the buffer is reused
        if not self.async_staging:
            if kind == "thread" and self.cache_staged_state_dict:
                staged = self._stage_in_buffer(state_dict, overlap=True)
                if staged is not None:
                    if self._copying is not None:
                        self._synchronize_after_execute = True
                    return staged
                self._written = (threading.Event(), _upload_threads(), state_dict)
                self._synchronize_after_execute = True
                return state_dict
            return self._stage_now(state_dict, kind != "process")
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
            return self._stager.submit(self._stage_checked, state_dict, versions, handle, ready, device,
                                       kind != "process")
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
    # in native_save.py) keep the checkpoint exactly the state at async_save():
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
    # device's context, not in a new one on GPU 0. With no staging buffer
    # ready, this thread fills one itself: its caller does not wait for it.

    # Note [First DCP async save]
    # The default async_save blocks for a staging copy of the state into the
    # writer's staging buffer (Note [Staging buffer] in
    # cpp/src/ckpt/writer_arena.cpp). A call that finds no buffer ready (the
    # first of a writer, a state grown past the buffer, a fill still
    # running) would have to fault in fresh memory inside the copy (0.3-2.6 s
    # per GB on the 2-core VM: about 3x a synchronous dcp.save) or wait for
    # the fill. Neither: it hands DCP the caller's state dict uncopied and
    # asks torch to call synchronize_staging() before async_save returns;
    # that waits until write_data has written and synced the tensors' bytes
    # through the ring (as dcp.save does), or until the upload thread ended
    # without getting there (a planning error: the future carries it). Then
    # a filler thread maps and faults in a buffer of the state's size, in
    # C++ (reserve_staging), for the next call, which copies into it if the
    # fill has ended and otherwise writes through again: no call ever waits
    # for a fill. join() waits for it. Only with DCP's thread executor, found
    # in async_save's frame: with the process executor the state is pickled
    # on a thread after async_save returns, so that call copies (into
    # torch-allocated memory, which pickles; Note [Writer in another process]).
    # Note [Overlapped staging copy]
    # async_save blocks for stage() and then for torch's own set-up (an
    # executor and its thread per call, the upload's submission, its
    # debug-level log records): about 10 ms a call on the 2-core VM, 15% of a
    # 1.5 GB state's copy, all of it what a native async save does not pay.
    # So where stage() copies host tensors into the staging buffer for DCP's
    # thread executor, it starts the writer's copy on a thread of its own
    # (the C++ copy releases the GIL), has torch copy the small tensors on
    # the caller's thread beside it, and returns the staged structure at
    # once, asking torch to call synchronize_staging() before async_save
    # returns: that waits for the copy and raises its error. The caller
    # therefore gets control back only once the staged copy is whole, as
    # before; the upload thread's write_data waits for the same copy before
    # it reads the staged bytes, and a failed copy fails it before anything
    # is written. CUDA sources keep the blocking copy (their copies are
    # queued on the caller's streams, from the caller's thread). A failed
    # copy stays the writer's until the uploads started since it have ended
    # (each fails in write_data): only then does async_save raise, or the
    # next stage() or close() go on, so no upload can find another save's
    # copy, or none, and commit what the failed one left in the buffer. The
    # wait for the copy ignores KeyboardInterrupt until the copy is done (it
    # reads the caller's tensors, which the copy thread holds), then raises it.
    def _finish_copying(self):
        """Waits for the staging copy in flight, if any, and, when it failed,
        for the uploads started since it (they fail in write_data)."""
        copying = self._copying
        if copying is None:
            return
        try:
            self._copy_result(copying)
        except Exception:
            self._await_uploads(copying)
        self._copying = None

    @staticmethod
    def _await_uploads(copying):
        for t in _upload_threads() - copying[3]:
            t.join()

    @staticmethod
    def _copy_result(copying):
        """The copy's result, waited for through KeyboardInterrupt (raised after)."""
        future, interrupted = copying[0], None
        while not future.done():
            try:
                concurrent.futures.wait([future])
            except KeyboardInterrupt as e:
                interrupted = e
        if interrupted is not None:
            raise interrupted
        future.result()

    def _overlapped_copy(self, copies, sources):
        del sources  # held until the copy ends: the copies read their memory by address
        _test_hook_gate("staging-copy")
        self._native.stage(copies)

    def _wait_copied(self, addresses=None):
        """Waits for the staging copy in flight and raises its error (Note
        [Overlapped staging copy]); with `addresses`, only when one of them
        lies in what it copies into (a synchronous dcp.save writes the
        caller's tensors and waits for nothing)."""
        copying = self._copying
        if copying is None:
            return
        _future, lo, hi, _before = copying
        if addresses is None or any(lo <= a < hi for a in addresses):
            self._copy_result(copying)

    def synchronize_staging(self):
        copying = self._copying
        if copying is not None:
            try:
                self._copy_result(copying)
            except Exception:
                self._synchronize_after_execute = False
                self._await_uploads(copying)  # each fails in write_data: nothing is committed
                raise
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
        self._start_fill(state_dict)

    def _start_fill(self, state_dict):
        """Starts the fill of Note [First DCP async save]: a staging buffer
        for `state_dict`, page-locked for CUDA copies when it holds CUDA
        tensors."""
        tensors = [t for t, _ in _local_tensors(state_dict)]
        if self._filler is None:
            self._filler = staging.Filler(self._native, self.path)
        self._filler.start(staging.staged_bytes(tensors), staging.fill_device(tensors))

    def _join_filler(self):
        if self._filler is not None:
            self._filler.join()

    def _stage_checked(self, state_dict, versions, handle, ready=(), device=None, in_buffer=True):
        try:
            if device is not None:
                torch.cuda.set_device(device)
            for ev in ready:
                ev.synchronize()
            _test_hook_gate("staging")
            staged = self._stage_now(state_dict, in_buffer)
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

    def _stage_now(self, state_dict, in_buffer):
        """The staged copy, made now: in the writer's staging buffer
        (`in_buffer`; mapped here first when none fits), else in
        torch-allocated memory (kept with cache_staged_state_dict)."""
        if not self.cache_staged_state_dict:
            return self._copy_staged(state_dict, _create_cpu_state_dict(state_dict))
        if in_buffer:
            staged = self._stage_in_buffer(state_dict)
            if staged is None:
                self._join_filler()
                staged = self._stage_in_buffer(state_dict)
            if staged is None:
                tensors = [t for t, _ in _local_tensors(state_dict)]
                self._native.reserve_staging(staging.staged_bytes(tensors), staging.fill_device(tensors))
                staged = self._stage_in_buffer(state_dict)
            return staged
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return self._copy_staged(state_dict, self.state_dict_cache)

    def _stage_in_buffer(self, state_dict, overlap=False):
        """The staged copy in the writer's staging buffer, or None (nothing
        copied) when it has none or one too small for `state_dict`; with
        `overlap`, host copies may still be running when it returns (Note
        [Overlapped staging copy])."""
        buf = self._native.staging_buffer
        if buf is None:
            return None
        key, views = _layout_key(state_dict), self._views
        if views is None or views[0] != key or views[1] != buf.data_ptr():
            staged = _staged_views(state_dict, self._native)
            if staged is None:
                return None
            self._views = views = (key, buf.data_ptr(), staged)
        return self._copy_staged(state_dict, views[2], in_buffer=True, overlap=overlap)

    def close(self):
        """Stops the staging threads (async_staging, Note [Overlapped staging
        copy]), after the staging they are doing."""
        if self._stager is not None:
            self._stager.shutdown(wait=True)
            self._stager = None
        self._finish_copying()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

    # Note [Staging copy]
    # async_save blocks its caller for stage() only, and that is one copy of
    # the state. torch's _copy_state_dict copies tensor by tensor with copy_
    # (one core here: about 12 GB/s); the writer's stage() does what a native
    # save's snapshot does (8 MiB pieces over its threads, streaming stores:
    # about 19 GB/s; CUDA tensors with cuMemcpyDtoHAsync on their current
    # stream into the page-locked staging buffer). So the large plain host
    # tensors (and local tensors of DTensors; CUDA ones when the copy lands
    # in the staging buffer) are copied by the writer first, and
    # _copy_state_dict then runs on a structure in which each of them is
    # replaced by its own staged tensor: copy_ of a tensor onto itself
    # returns at once, and everything else (small or strided tensors, the
    # structure checks) is done by torch as before.
    def _copy_staged(self, src, staged, in_buffer=False, overlap=False):
        copies = {}  # by destination: tied tensors share one staged tensor

        def native(s, d):
            c = staging.native_copy(s, d, in_buffer)
            if c is not None:
                copies[d.data_ptr()] = c
            return c is not None

        def swap(s, d):
            if isinstance(s, torch.Tensor) and isinstance(d, torch.Tensor) and type(s) is type(d):
                if type(s) is torch.Tensor:
                    return d if native(s, d) else s
                ls, ld = getattr(s, "_local_tensor", None), getattr(d, "_local_tensor", None)  # a DTensor
                if type(ls) is torch.Tensor and type(ld) is torch.Tensor and native(ls, ld):
                    return d
                return s
            if isinstance(s, dict) and isinstance(d, dict) and s.keys() == d.keys():
                return {k: swap(v, d[k]) for k, v in s.items()}
            if isinstance(s, (list, tuple)) and isinstance(d, (list, tuple)) and len(s) == len(d):
                out = [swap(a, b) for a, b in zip(s, d)]
                return tuple(out) if isinstance(s, tuple) else out
            return s

        swapped = swap(src, staged)
        copies = list(copies.values())
        if overlap and copies and not any(c[3] for c in copies):  # host sources only
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ebbtide-dcp-copy")
            before = _upload_threads()
            self._copying = (self._copier.submit(self._overlapped_copy, copies, src), min(c[0] for c in copies),
                             max(c[0] + c[2] for c in copies), before)
            try:
                return _copy_state_dict(swapped, staged)
            except BaseException:
                self._finish_copying()
                raise
        self._native.stage(copies)
        return _copy_state_dict(swapped, staged)
