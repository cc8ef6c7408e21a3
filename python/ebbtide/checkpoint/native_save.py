"""The native checkpoint format's save path: ``checkpoint.save``, ``Writer``,
save handles, snapshots of CUDA state, and the collectives that commit a save
across ranks (docs/checkpoints.md). Public names are re-exported by
``ebbtide.checkpoint``; loading is in native_load.py.

Files are written by the C++ core (ebbtide._core.CkptWriter): snapshot into
reusable pinned buffers, background O_DIRECT writes with crc32c per chunk,
header last, commit by atomic rename.
"""
import atexit
import json
import logging
import os
import threading
import time
import weakref

import torch

from ebbtide import _core, _fork
from ebbtide.checkpoint import staging
from ebbtide.checkpoint import tree
from ebbtide.checkpoint import validate
from ebbtide.checkpoint.collectives import _collectives


FORMAT_VERSION = validate.FORMAT_VERSION
INDEX_NAME = validate.INDEX_NAME
StateError = _core.StateError
ChecksumError = _core.ChecksumError

__all__ = ["save", "join", "wait_for_snapshots", "Writer", "SaveHandle", "SaveInfo", "FORMAT_VERSION", "INDEX_NAME",
           "StateError", "ChecksumError"]


class SaveInfo(dict):
    """What a save produced: raw_bytes, stored_bytes, file_bytes, ratio,
    snapshot_seconds, total_seconds, path, files, backend, and for lossy
    saves `error` ({"overall": {...}, "tensors": {path: {"max_abs", "rel_l2"}}})."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


class SaveHandle:
    """A save in progress. wait() blocks until the checkpoint is durable and
    committed and returns SaveInfo, or raises the writer's error. Under
    torch.distributed, wait() is collective (every rank must call it).

    staged() / wait_staged(): whether the snapshot is taken, i.e. the saved
    tensors may change again. True from the start unless the save was made
    with snapshot="background" (Note [Background snapshot]) or "none" (then
    once the tensors' bytes are written, Note [Uncopied async saves])."""

    def __init__(self, finish):
        self._origin = _fork.Origin()  # Note [Objects across fork]: a forked child never waits for it
        self._finish = finish
        self._info = None
        self._error = None
        self._done = False
        self._native = None
        self._staged = None  # threading.Event for background snapshots
        self._encoder = None  # the thread of an async delta save (Note [Async delta saves])
        self.snapshot_seconds = None  # background: from save() to the snapshot taken (and checked)
        self.snapshot_wait_seconds = 0.0  # time optimizer steps waited for this snapshot

    def staged(self):
        return self._staged is None or self._staged.is_set()

    def wait_staged(self):
        """Blocks until the snapshot is taken (a failed snapshot counts as
        taken: its error comes from wait())."""
        if self._staged is not None:
            self._staged.wait()

    def done(self):
        if self._done:
            return True
        return self.staged() and self._native is not None and self._native.done()

    def wait(self):
        if not self._done:
            try:
                self._info = self._finish()
            except BaseException as e:
                self._error = e
            self._done = True
        if self._error is not None:
            raise self._error
        return self._info


# Note [Background snapshot]
# save(..., async_=True, snapshot="background") returns before the snapshot:
# a thread copies the tensors into the writer's pinned buffers (the C++
# snapshot, GIL released) while the caller goes on with the next forward and
# backward, which read the state but do not change it. Two guards keep the
# checkpoint exactly the state at save():
# - every torch.optim optimizer's step() waits for pending snapshots first (a
#   global step pre-hook, registered on the first such save);
# - after the copy the thread compares each saved tensor's version counter with
#   the one seen at save(): an in-place change made meanwhile (an optimizer
#   step outside torch.optim, BatchNorm running stats in a forward, ...) may
#   have torn the copy, so the save is rejected (StateError from wait(),
#   naming the tensor) and nothing is committed (Note [Gated commit] in
#   cpp/src/ckpt/writer.cpp). Changes through `.data` bypass version counters
#   and are not seen.
# CUDA tensors are copied on a side stream that waits for the work queued
# before save() only, so the copies overlap the next forward on the copy
# engine instead of queueing behind it. Under torch.distributed the thread
# also reserves the save's directories, a collective (Note [Checkpoint
# collectives]), so save() waits neither for the GPU nor for the other ranks.
# Note [Uncopied async saves]
# save(..., async_=True, snapshot="none") copies nothing: the save is
# pipelined as a synchronous one is (Note [Save ring] in writer_shard.cpp: the
# writer's threads read each chunk from the tensors into its 64 MiB ring
# just before writing it), but on the writer's thread, so save() returns
# after the Python-side set-up (flattening, the temporary directory). The
# caller promises not to change the tensors until handle.wait_staged()
# (here: until every byte is written and durable), and the same guards as a
# background snapshot hold it to that: every torch.optim step waits for it
# first, and a tensor whose version counter moved before the writes ended
# fails the save (the writer waits before its commit, Note [Gated commit],
# until a thread of this module has checked the counters). Meant for
# machines whose memory copy is too slow to keep a blocking snapshot under
# 10% of a save (docs/checkpoints.md, "What an async save blocks on").
_background = weakref.WeakSet()  # handles whose snapshot (or uncopied writes) is running; each has _origin
_hook = None


_snapshot_streams = {}  # device -> torch.cuda.Stream


def _snapshot_stream(device):
    """A side stream for a background snapshot's device copies, ordered after
    the work queued on `device`'s current stream so far and not after what the
    caller queues next: the copies run beside the next forward instead of
    behind it (the version check covers kernels that change a saved tensor)."""
    s = _snapshot_streams.get(device)
    if s is None:
        s = _snapshot_streams[device] = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    return s


def _copy_streams(devices, background):
    """The stream each CUDA device's copies are ordered on (its handle, as the
    core takes it), for the devices in `devices`: the current stream, or for
    a background snapshot the device's side stream, ordered after the
    current one once per save and device (one event each, not one per
    tensor)."""
    return {d: (_snapshot_stream(d) if background else torch.cuda.current_stream(d)).cuda_stream for d in devices}


def _wait_for_snapshots(optimizer, args, kwargs):
    for h in list(_background):
        if not h._origin.here():
            continue  # the parent's snapshot, in a forked child (Note [Objects across fork])
        if not h.staged():
            t = time.perf_counter()
            h.wait_staged()
            h.snapshot_wait_seconds += time.perf_counter() - t


def _install_optimizer_hook():
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _hook = register_optimizer_step_pre_hook(_wait_for_snapshots)


@atexit.register
def _at_exit():
    # A save still in flight when the interpreter exits normally is finished
    # (its error logged); then the global hook and the default writer go, so
    # nothing holds the native writer past the module's teardown.
    global _hook, _default_writer
    w = _default_writer
    if w is not None and not w._origin.here():
        w = None  # a forked child's copy of the parent's: Note [Objects across fork]
    if w is not None and w._pending is not None and not w._pending._done:
        try:
            w._pending.wait()
        except Exception as e:  # noqa: BLE001 - nobody is left to raise it to
            logging.getLogger("ebbtide").error("ebbtide: checkpoint save to %s failed at exit: %s",
                                               w._pending._path, e)
    if _hook is not None:
        _hook.remove()
        _hook = None
    _default_writer = None


def wait_for_snapshots():
    """Waits for every background snapshot of this process (what each
    optimizer step does before it changes parameters)."""
    _wait_for_snapshots(None, (), {})


class Writer:
    """Holds the reusable snapshot buffers (synchronous saves: a 64 MiB ring,
    EBBTIDE_CKPT_RING; async ones: a copy of the state) and the background
    writer thread.
    At most one save in flight: a second async save raises StateError, unless
    `block=True` (then it waits for the first). Options default from
    EBBTIDE_CKPT_* environment variables."""

    def __init__(self, *, chunk_bytes=None, queue_depth=None, threads=None, zstd_level=None, direct=None):
        self._origin = _fork.Origin()  # Note [Objects across fork]
        self._native = _core.CkptWriter(chunk_bytes=chunk_bytes, queue_depth=queue_depth, threads=threads,
                                        zstd_level=zstd_level, direct=direct)
        self._pending = None
        self._filler = staging.Filler(self._native, "checkpoint.save")  # Note [Async delta saves]

    @property
    def busy(self):
        """A save is in flight (its snapshot or its writes)."""
        return self._pending is not None and not self._pending.done()

    def join(self):
        """Waits until the writer is idle: the save in flight is durable and the
        checkpoints it and earlier saves replaced are removed (removal runs in
        the background after a save is done, Note [Deferred removal])."""
        if self._pending is not None:
            self._pending.wait_staged()
            if self._pending._encoder is not None:  # Note [Async delta saves]: its writes start there
                self._pending._encoder.join()
        self._filler.join()
        self._native.join()

    def save(self, state_dict, path, *, async_=False, compress=None, base=None, block=False, lossy=None,
             stripe_dirs=None, snapshot="blocking"):
        return _save(self, state_dict, path, async_=async_, compress=compress, base=base, block=block,
                     lossy=lossy, stripe_dirs=stripe_dirs, snapshot=snapshot)


_default_writer = None


def _writer():
    global _default_writer
    # A forked child gets its own: the parent's background thread is not there
    # (Note [Objects across fork]).
    if _default_writer is None or not _default_writer._origin.here():
        _default_writer = Writer()
    return _default_writer


def join():
    """Writer.join() for the default writer used by save()."""
    if _default_writer is not None and _default_writer._origin.here():
        _default_writer.join()


def save(state_dict, path, *, async_=False, compress=None, base=None, block=False, lossy=None, writer=None,
         stripe_dirs=None, snapshot="blocking"):
    """Saves `state_dict` (nested dicts/lists/tuples of tensors and plain values)
    to the directory `path`, replacing an existing checkpoint atomically.

    compress: None (raw), "lossless" (byte grouping + zstd) or "delta" (lossy,
    ExCP-style residual against the checkpoint `base`; options in `lossy`, see
    ebbtide.checkpoint.lossy.LossyOptions). async_: return a SaveHandle right after
    the snapshot. block: with a save in flight on the writer, wait for it
    instead of raising StateError. stripe_dirs: extra directories (one per
    device) to stripe the tensor data over: chunks go round-robin over `path`
    and these, written in parallel; each gets a directory
    `<dir>/<basename(path)>.stripe-<tag>-<id>` holding one file per rank, recorded in
    the index (docs/checkpoints.md, "Striping"). snapshot: with async_,
    "blocking" (default) returns once the tensors are copied; "background"
    returns at once and copies them on a thread: the next optimizer step
    waits for the copy, and a tensor changed in place before it finished
    fails the save (Note [Background snapshot]); "none" copies nothing: the
    writes read the tensors themselves until handle.wait_staged(), which
    every optimizer step waits for, and a tensor changed in place before
    then fails the save (Note [Uncopied async saves]; uncompressed only).
    Returns SaveInfo (or a SaveHandle)."""
    return _save(writer or _writer(), state_dict, path, async_=async_, compress=compress, base=base,
                 block=block, lossy=lossy, stripe_dirs=stripe_dirs, snapshot=snapshot)


def _dist():
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d, d.get_rank(), d.get_world_size()
    return None, 0, 1




def _stripe_dir_list(stripe_dirs):
    """`stripe_dirs` as a list of paths; SaveTransaction checks the directories."""
    if stripe_dirs is None:
        return []
    if isinstance(stripe_dirs, (str, bytes, os.PathLike)):
        raise ValueError("checkpoint.save: stripe_dirs must be a list of directories, not one path")
    return [os.fspath(d) for d in stripe_dirs]


def _check_save_args(async_, compress, base, snapshot):
    """Rejects bad save() arguments before anything is written."""
    if snapshot not in ("blocking", "background", "none"):
        raise ValueError(f"checkpoint.save: snapshot={snapshot!r} is not valid "
                         "(valid: 'blocking', 'background', 'none')")
    if snapshot != "blocking" and not async_:
        raise ValueError(f"checkpoint.save: snapshot={snapshot!r} needs async_=True (a synchronous save "
                         "returns when the checkpoint is durable anyway)")
    if snapshot == "none" and compress not in (None, "none"):
        raise ValueError(f"checkpoint.save: snapshot='none' writes the tensors' own bytes, uncompressed; "
                         f"compress={compress!r} needs a snapshot (snapshot='blocking' or 'background')")
    if compress not in (None, "none", "lossless", "delta"):
        raise ValueError(f"checkpoint.save: compress={compress!r} is not valid "
                         "(valid: None, 'lossless', 'delta')")
    if compress == "delta" and base is None:
        raise ValueError("checkpoint.save: compress='delta' needs base=PATH of the previous checkpoint")


def _claim(w, block, path):
    """Claims the writer for a save to `path` (CheckpointWriter::claim, which
    refuses a second save in flight with StateError). With `block`, the save
    in flight is waited for first; a previous save whose writes are done is
    finished before the claim returns (under torch.distributed, its commit).
    Its error stays with its handle."""
    pending = w._pending
    if block and pending is not None and not pending._done:
        try:
            pending.wait()
        except Exception:  # noqa: BLE001
            pass
    w._native.claim(path)
    if pending is not None and not pending._done:
        try:
            pending.wait()
        except Exception:  # noqa: BLE001
            pass
        except BaseException:
            w._native.release_claim()
            raise


class _Save:
    """One checkpoint save, in the order its steps run (Note [Save pipeline]
    in cpp/src/ckpt/writer.cpp for the core's part): encode() flattens the
    state, reserve_directories() reserves the save's directories (rank 0,
    through the core's SaveTransaction, cpp/include/ebbtide/ckpt/transaction.hpp)
    and shares them, start() hands the blobs to the core writer (stage() on a
    thread for background snapshots), finish() waits, commits and describes
    the result. The commit itself is commit_checkpoint in
    cpp/src/ckpt/commit.cpp: run by the writer for a single process, by
    rank 0's SaveTransaction once every rank is durable under
    torch.distributed.

    finish() is kept by the SaveHandle, so nothing here references the
    handle, and the state and blobs are dropped once the snapshot holds them."""

    def __init__(self, w, path, *, async_, compress, block, background, stripe_dirs, uncopied=False):
        self.w = w
        self.path = os.path.abspath(os.fspath(path))
        self.stripe_dirs = _stripe_dir_list(stripe_dirs)
        self.dist, self.rank, self.world = _dist()
        self.single = self.dist is None
        self.t_start = time.perf_counter()
        self.compress = compress
        self.block = block
        self.background = background
        self.uncopied = uncopied  # Note [Uncopied async saves]
        # The caller waits, or promises to keep the tensors: the writes read them through the ring.
        self.pipelined = not async_ or uncopied
        self.lossy_error = self.delta = self.original_bytes = None
        self.stripes, self.tmp, self.ckpt_id, self.txn = [], None, None, None
        self.native = self.stage_error = self.keep = None
        self.group = self.reserve_ticket = None  # Note [Checkpoint collectives]
        self.staged = threading.Event() if background or uncopied else None
        self.encoding = False  # Note [Async delta saves]: encoded and started on a thread
        self.fill_bytes = 0  # Note [Async delta saves]: the staging buffer to fill once the call is done
        self.reserve = 0  # Note [First async save] in writer_arena.cpp: the arena to grow after a written-through save
        self.shard = f"rank{self.rank}.ebt"

    def encode(self, state_dict, base, lossy):
        """Delta-encodes against `base` (compress="delta"), flattens the state
        into blobs and builds the shard's metadata."""
        if self.compress == "delta":
            self.original_bytes = _state_bytes(state_dict)
            from ebbtide.checkpoint import lossy as _lossy
            from ebbtide.checkpoint.native_load import load
            base_abs = os.path.abspath(os.fspath(base))
            base_state = load(base_abs, device="cpu", rank=self.rank if self.world > 1 else None)
            state_dict, self.lossy_error = _lossy.encode(state_dict, base_state, lossy, self.w._native)
            self.delta = {"base": os.path.relpath(base_abs, os.path.dirname(self.path)),
                          "base_id": validate.read_index(base_abs)["id"]}
        fl = tree.Flattener(self.compress in ("lossless", "delta"))
        root = fl.tree(state_dict)
        self.version = 2 if self.stripe_dirs else 1  # unstriped checkpoints stay readable by version-1 readers
        meta = {"format": "ebbtide-checkpoint", "format_version": self.version,
                "rank": self.rank, "world_size": self.world, "tree": root, "tensors": fl.tensors,
                "storages": fl.storages, "compress": self.compress or "none", "torch": torch.__version__}
        if self.delta:
            meta["delta"] = self.delta
        if self.lossy_error is not None:
            meta["lossy_error"] = self.lossy_error
        streams = _copy_streams({device for _, _, _, device, _, _ in fl.blobs if device.type == "cuda"},
                                self.background)
        blobs = []
        for name, st, nbytes, device, elem, codec in fl.blobs:
            on_dev = device.type == "cuda"
            blobs.append((name, st.data_ptr() if nbytes else 0, nbytes, on_dev, streams.get(device, 0), elem, codec))
        self.meta, self.blobs, self.fl, self.state_dict = meta, blobs, fl, state_dict
        self.versions = fl.versions

    def reserve_directories(self):
        """Rank 0 reserves the save's directories (SaveTransaction.reserve:
        what killed saves left removed, the committed checkpoint's stripes
        noted, the temporary directory and one stripe directory per
        stripe_dirs entry made, Note [Stripe ownership] in
        cpp/src/ckpt/transaction.cpp); every rank gets their names and the new
        checkpoint's id, or rank 0's error."""
        failed = None
        if self.rank == 0:
            try:
                self.txn = _core.CkptSaveTransaction.reserve(self.path, self.stripe_dirs, INDEX_NAME)
            except Exception as e:
                if self.dist is None:
                    raise
                failed = e
            else:
                self.tmp, self.ckpt_id, self.stripes = self.txn.tmp_dir, self.txn.id, list(self.txn.stripes)
        if self.dist is not None:
            box = [(self.tmp, self.ckpt_id, self.stripes,
                    None if failed is None else (isinstance(failed, ValueError), str(failed)))]
            ticket, self.reserve_ticket = self.reserve_ticket, None
            with _collectives.turn(ticket):  # Note [Checkpoint collectives]
                self.dist.broadcast_object_list(box, src=0, group=self.group)
            self.tmp, self.ckpt_id, self.stripes, error = box[0]
            if failed is not None:
                raise failed
            if error is not None:
                raise (ValueError if error[0] else OSError)(f"checkpoint.save to {self.path} failed on rank 0: "
                                                            f"{error[1]}")
        self.meta["id"] = self.ckpt_id
        if self.stripes:
            self.meta["stripes"] = self.stripes
        self.created = time.time()
        self.index = self.index_json()

    def take_ticket(self):
        """Under torch.distributed, on the caller's thread: the group and the
        place in line of this save's reservation (Note [Checkpoint collectives])."""
        if self.dist is not None:
            self.group = _collectives.group(self.dist)
            self.reserve_ticket = _collectives.ticket()

    def drop_ticket(self):
        """A reservation that will not run gives its turn up."""
        ticket, self.reserve_ticket = self.reserve_ticket, None
        if ticket is not None:
            with _collectives.turn(ticket):
                pass

    def index_json(self):
        index = {"format": "ebbtide-checkpoint", "format_version": self.version, "id": self.ckpt_id,
                 "world_size": self.world, "shards": [f"rank{r}.ebt" for r in range(self.world)],
                 "compress": self.compress or "none", "created": self.created}
        if self.stripes:
            index["stripes"] = self.stripes
        if self.delta:
            index["delta"] = self.delta
        return json.dumps(index, indent=1)

    def start(self):
        """The snapshot, then the background write; a single process's
        writer also commits (Note [Save pipeline])."""
        single = self.single
        try:
            return self.w._native.save(
                os.path.join(self.tmp, self.shard), self.blobs, json.dumps(self.meta),
                commit_dir=self.tmp if single else "", commit_path=self.path if single else "",
                extra_files=[(INDEX_NAME, self.index)] if single else [], block=self.block,
                stripe_files=[os.path.join(sd, self.shard) for sd in self.stripes],
                pipelined=self.pipelined, gated=self.background or self.uncopied, reserve_arena=self.reserve)
        except BaseException:
            if single:
                self.txn.discard()
            raise

    def write_through_if_fresh(self):
        """Note [First async save] in cpp/src/ckpt/writer_arena.cpp: an async save
        with a blocking snapshot that the writer's arena cannot hold is
        written through the ring like a synchronous save (its caller waits
        for the writes of the tensors' bytes, not for fresh memory), and the
        writer grows the arena for the next one after it."""
        needed = sum((b[2] + 4095) // 4096 * 4096 for b in self.blobs)
        if needed > self.w._native.snapshot_capacity:
            self.pipelined = True
            self.reserve = needed

    def start_blocking(self):
        self.native = self.start()
        if self.reserve:  # Note [First async save]: back to the caller once the tensors are read
            self.native.wait_copied()
        # Async: the snapshot holds the data now. Pipelined: the writer still reads the tensors.
        self.keep = (self.fl, self.blobs, self.state_dict) if self.pipelined else None
        versions = self.versions
        self._drop_inputs()
        self.versions = versions if self.uncopied else None

    def watch_writes(self, handle):
        """Note [Uncopied async saves], on its own thread: once the tensors'
        bytes are written and durable, approves the commit unless a saved
        tensor changed meanwhile; then the tensors may change again."""
        n = self.native
        try:
            n.wait_written()
            self.decide(n, "while the save (snapshot='none') was writing it from its own memory, so the file "
                           "may hold a torn copy")
        finally:
            self.keep = self.versions = None
            handle.snapshot_seconds = time.perf_counter() - self.t_start
            self.staged.set()
            _background.discard(handle)

    def decide(self, n, when):
        """Approves the gated save `n` (Note [Gated commit]) unless a saved
        tensor's version counter moved since save(); then rejects it, the
        message naming the tensor and `when` it changed."""
        changed = [p for t, v, p in self.versions if t._version != v]
        if changed:
            n.reject(f"checkpoint.save to {self.path}: tensor {changed[0]!r}"
                     f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''} was changed in place "
                     f"{when}; nothing was committed. Wait for handle.wait_staged() (every torch.optim step "
                     "does) before changing saved tensors")
        else:
            n.approve()

    def _drop_inputs(self):
        self.fl = self.blobs = self.state_dict = self.meta = self.versions = None

    def start_from_thread(self, handle, prepare):
        """On a snapshot or encoding thread: prepare(), then the core's
        save, which the handle then waits for; returns it, or None after
        keeping the error for wait() and releasing the writer."""
        try:
            prepare()
            n = self.start()
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            self.drop_ticket()
            self.w._native.release_claim()  # in case the core's save() was not reached
            self.stage_error = e
            return None
        self.native = handle._native = n
        return n

    def stage(self, handle, cuda_device):
        """Background snapshot (Note [Background snapshot]), on its own
        thread: starts the save, then approves its commit unless a saved
        tensor changed meanwhile."""
        self.keep = (self.fl, self.blobs, self.state_dict)

        def prepare():
            if self.reserve_ticket is not None:  # Note [Checkpoint collectives]
                self.reserve_directories()
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
        try:
            n = self.start_from_thread(handle, prepare)
            if n is not None:
                self.decide(n, "while its background snapshot was taken, so the copy may be torn")
        finally:
            self.keep = None  # the snapshot holds the data now
            self._drop_inputs()
            handle.snapshot_seconds = time.perf_counter() - self.t_start
            self.staged.set()
            _background.discard(handle)

    # Note [Async delta saves]
    # A delta save (compress="delta") encodes the state against its base
    # (ExCP, Note [ExCP encoding] in cpp/src/ckpt/excp.cpp): it reads the
    # base back and makes passes over every weight and moment. With async_=True
    # and a blocking snapshot, save() only copies the state into the writer's
    # staging buffer (Note [Staging buffer] in cpp/src/ckpt/writer_arena.cpp)
    # on the writer's threads, storage by storage so that ties and views stay
    # as they are, and returns: one copy of the state, all that a lossless
    # async save makes its caller wait for too. A thread then loads the base,
    # encodes the staged copy on the writer's threads, reserves the
    # directories and starts the writes; wait() waits for it and raises its
    # error. A save that finds no staging buffer ready (the first of a
    # writer, a state grown past the buffer), or state outside host memory,
    # encodes in the call as a synchronous delta save does, and a thread
    # fills a buffer for the next one, started only once the call's encode
    # and snapshot are done: beside them, the fill (mapping and faulting in
    # memory of the state's size) competed for the cores and slowed the call. The staged copy is not touched again
    # until the next save's copy, which comes only once this save is done
    # (one save in flight per writer).
    def stage_delta(self, state_dict):
        """Note [Async delta saves]: `state_dict` copied into the writer's
        staging buffer, or None (encode in the call; fill_bytes says what
        buffer to fill for the next save once this call's work is done)."""
        from ebbtide.checkpoint.lossy import _map_tree
        staged = staging.staged_state(self.w._native, state_dict, _map_tree)
        if staged is None:
            tensors = [t for _, t in tree.walk_tensors(state_dict)]
            if all(t.device.type == "cpu" for t in tensors):
                self.fill_bytes = staging.state_bytes(tensors)
        else:
            self.encoding = True
            self.staged = threading.Event()
        return staged

    def encode_and_start(self, staged, base, lossy, handle):
        """Note [Async delta saves], on its own thread: encodes the staged
        copy, reserves the directories (in ticket order, Note [Checkpoint
        collectives]) and starts the writes."""
        def prepare():
            self.encode(staged, base, lossy)
            self.reserve_directories()
        try:
            self.start_from_thread(handle, prepare)
        finally:
            self._drop_inputs()  # the snapshot holds the encoded state now
            self.staged.set()

    def wait_native(self):
        """The core's result for this rank, or the error that stopped it."""
        try:
            if self.background or self.encoding:
                self.staged.wait()
                if self.stage_error is not None:
                    raise self.stage_error
            return self.native.wait(), None
        except BaseException as e:  # noqa: BLE001 - reported to every rank
            return None, e
        finally:
            self.keep = None

    def commit_across_ranks(self, err):
        """Under torch.distributed: rank 0 commits once every rank's shard is
        durable; every rank learns the outcome. Raises on failure anywhere,
        after rank 0 discarded the new directories."""
        dist, rank = self.dist, self.rank
        errs = [None] * self.world
        with _collectives.turn(_collectives.ticket()):  # Note [Checkpoint collectives]
            dist.all_gather_object(errs, None if err is None else f"rank {rank}: {err}", group=self.group)
            failed = [e for e in errs if e]
            if not failed and rank == 0:
                try:  # the commit; the replaced checkpoint goes on the writer's thread, its stripes now
                    self.w._native.commit(self.txn, [(INDEX_NAME, self.index.encode())])
                except BaseException as e:  # noqa: BLE001
                    failed = [f"rank 0 commit: {e}"]
                    err = e
            status = [failed if rank == 0 else None]
            dist.broadcast_object_list(status, src=0, group=self.group)
        failed = status[0]
        if failed:
            if rank == 0 and self.txn is not None:  # None: the reservation failed
                self.txn.discard()
            if err is not None:
                raise err
            raise OSError(f"checkpoint.save to {self.path} failed on another rank: {'; '.join(failed)}")

    def finish(self):
        """SaveHandle.wait(): the checkpoint committed, the replaced one's
        stripes removed; returns the SaveInfo."""
        r, err = self.wait_native()
        if self.dist is not None:
            self.commit_across_ranks(err)
        elif err is not None:  # the writer removed the temporary directory and the stripe files
            if self.txn is not None:
                self.txn.discard()
            raise err
        else:  # the writer committed
            self.txn.committed()
        return self.info(r)

    def info(self, r):
        info = SaveInfo(r)
        path, shard = self.path, self.shard
        files = [os.path.join(path, shard)] + [os.path.join(sd, shard) for sd in self.stripes]
        original = self.original_bytes or info["raw_bytes"]
        info.update(path=path, file=os.path.join(path, shard), files=files, stripes=self.stripes, rank=self.rank,
                    world_size=self.world, compress=self.compress or "none", original_bytes=original,
                    ratio=(original / info["stored_bytes"]) if info["stored_bytes"] else 1.0,
                    wall_seconds=time.perf_counter() - self.t_start)
        if self.lossy_error is not None:
            info["error"] = self.lossy_error
        return info


def _save(w, state_dict, path, *, async_, compress, base, block, lossy, stripe_dirs=None, snapshot="blocking"):
    _check_save_args(async_, compress, base, snapshot)
    background = snapshot == "background"
    s = _Save(w, path, async_=async_, compress=compress, block=block, background=background,
              stripe_dirs=stripe_dirs, uncopied=snapshot == "none")
    _claim(w, block, s.path)
    staged = None
    try:  # until the core's save() (on the snapshot or encoding thread) takes the claim
        if async_ and snapshot == "blocking" and compress == "delta":
            staged = s.stage_delta(state_dict)  # Note [Async delta saves]
        if staged is None:
            s.encode(state_dict, base, lossy)
        del state_dict
        s.take_ticket()
        # Note [Checkpoint collectives]: a background snapshot under torch.distributed reserves on its thread.
        if staged is None and not (background and s.dist is not None):
            s.reserve_directories()
        if async_ and snapshot == "blocking" and compress in (None, "none"):
            s.write_through_if_fresh()
        if staged is None and not background:
            s.start_blocking()
        if s.fill_bytes:  # after the encode and the snapshot (Note [Async delta saves])
            w._filler.start(s.fill_bytes, -1)
    except BaseException:
        s.drop_ticket()
        w._native.release_claim()
        raise
    handle = SaveHandle(s.finish)
    handle._native = s.native
    handle._path = s.path
    w._pending = handle
    if staged is not None:
        # The thread holds the writer until the save is started, as the snapshot thread below does.
        handle._encoder = threading.Thread(target=lambda: (w, s.encode_and_start(staged, base, lossy, handle)),
                                           name="ebbtide-ckpt-encode", daemon=False)
        try:
            handle._encoder.start()
        except BaseException as e:
            handle._encoder = None
            s.drop_ticket()
            w._native.release_claim()
            s.stage_error = e
            s.staged.set()
            raise
    if s.uncopied:
        handle._staged = s.staged
        _install_optimizer_hook()
        _background.add(handle)
        try:  # like the snapshot thread below: holds the writer until the commit is decided
            threading.Thread(target=lambda: (w, s.watch_writes(handle)), name="ebbtide-ckpt-watch",
                             daemon=False).start()
        except BaseException:
            s.native.reject(f"checkpoint.save to {s.path}: no thread could watch the save")
            s.staged.set()
            _background.discard(handle)
            raise
    if background:
        handle._staged = s.staged
        _install_optimizer_hook()
        _background.add(handle)
        # The thread makes CUDA calls (pinned buffers, device copies): give it
        # the caller's device, not the driver's default of device 0.
        cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        # The thread holds the writer (and so its C++ half) until the snapshot is
        # decided: a writer is never destroyed with a gated save waiting on it.
        try:
            threading.Thread(target=lambda: (w, s.stage(handle, cuda_device)), name="ebbtide-ckpt-snapshot",
                             daemon=False).start()
        except BaseException as e:  # no thread: the handle reports it too
            s.drop_ticket()
            w._native.release_claim()
            s.stage_error = e
            s.staged.set()
            _background.discard(handle)
            raise
    if async_:
        return handle
    return handle.wait()



def _state_bytes(state):
    seen, total = set(), 0
    for _, t in tree.walk_tensors(state):
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
