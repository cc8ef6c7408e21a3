"""Fast, crash-safe checkpoints of PyTorch state dicts (docs/checkpoints.md).

    from ebbtide import checkpoint
    info = checkpoint.save(state, "ckpt/step100")                    # durable on return
    h = checkpoint.save(state, "ckpt/step200", async_=True)          # returns after the snapshot
    ...; info = h.wait()                                              # raises the writer's error
    state = checkpoint.load("ckpt/step200", device="cpu")
    checkpoint.load("ckpt/step200", into=model)                       # shape-checked load_state_dict

Files are written by the C++ core (ebbtide._core.CkptWriter): snapshot into
reusable pinned buffers, background O_DIRECT writes with crc32c per chunk,
header last, commit by atomic rename. Loading executes no code.
"""
import json
import mmap
import os
import time
import uuid

import torch

from ebbtide import _ckpt_tree as tree
from ebbtide import _core

FORMAT_VERSION = _core.CKPT_FORMAT_VERSION
INDEX_NAME = "index.json"
StateError = _core.StateError
ChecksumError = _core.ChecksumError

__all__ = ["save", "load", "inspect", "join", "Writer", "SaveHandle", "SaveInfo", "FORMAT_VERSION",
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
    torch.distributed, wait() is collective (every rank must call it)."""

    def __init__(self, finish):
        self._finish = finish
        self._info = None
        self._error = None
        self._done = False
        self._native = None

    def done(self):
        return self._done or (self._native is not None and self._native.done())

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


class Writer:
    """Holds the reusable snapshot buffers and the background writer thread.
    At most one save in flight: a second async save raises StateError, unless
    `block=True` (then it waits for the first). Options default from
    EBBTIDE_CKPT_* environment variables."""

    def __init__(self, *, chunk_bytes=None, queue_depth=None, threads=None, zstd_level=None, direct=None):
        self._native = _core.CkptWriter(chunk_bytes=chunk_bytes, queue_depth=queue_depth, threads=threads,
                                        zstd_level=zstd_level, direct=direct)
        self._pending = None

    @property
    def busy(self):
        return self._native.busy

    def join(self):
        """Waits until the writer is idle: the save in flight is durable and the
        checkpoint it replaced has been removed (removal runs after the save
        returns; the next save on this writer waits for it)."""
        self._native.join()

    def save(self, state_dict, path, *, async_=False, compress=None, base=None, block=False, lossy=None,
             stripe_dirs=None):
        return _save(self, state_dict, path, async_=async_, compress=compress, base=base, block=block,
                     lossy=lossy, stripe_dirs=stripe_dirs)


_default_writer = None


def _writer():
    global _default_writer
    if _default_writer is None:
        _default_writer = Writer()
    return _default_writer


def join():
    """Writer.join() for the default writer used by save()."""
    if _default_writer is not None:
        _default_writer.join()


def save(state_dict, path, *, async_=False, compress=None, base=None, block=False, lossy=None, writer=None,
         stripe_dirs=None):
    """Saves `state_dict` (nested dicts/lists/tuples of tensors and plain values)
    to the directory `path`, replacing an existing checkpoint atomically.

    compress: None (raw), "lossless" (byte grouping + zstd) or "delta" (lossy,
    ExCP-style residual against the checkpoint `base`; options in `lossy`, see
    ebbtide._ckpt_lossy.LossyOptions). async_: return a SaveHandle right after
    the snapshot. block: with a save in flight on the writer, wait for it
    instead of raising StateError. stripe_dirs: extra directories (one per
    device) to stripe the tensor data over: chunks go round-robin over `path`
    and these, written in parallel; each gets a directory
    `<dir>/<basename(path)>.stripe-<id>` holding one file per rank, recorded in
    the index (docs/checkpoints.md, "Striping"). Returns SaveInfo (or a
    SaveHandle)."""
    return _save(writer or _writer(), state_dict, path, async_=async_, compress=compress, base=base,
                 block=block, lossy=lossy, stripe_dirs=stripe_dirs)


def _dist():
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d, d.get_rank(), d.get_world_size()
    return None, 0, 1


def _check_stripe_dirs(stripe_dirs, path):
    if stripe_dirs is None:
        return []
    if isinstance(stripe_dirs, (str, bytes, os.PathLike)):
        raise ValueError("checkpoint.save: stripe_dirs must be a list of directories, not one path")
    out = []
    for d in stripe_dirs:
        d = os.path.abspath(os.fspath(d))
        if not os.path.isdir(d):
            raise ValueError(f"checkpoint.save: stripe directory {d} does not exist (or is not a directory)")
        if d in out:
            raise ValueError(f"checkpoint.save: stripe directory {d} is listed twice")
        if d == path or d.startswith(path + os.sep):
            raise ValueError(f"checkpoint.save: stripe directory {d} lies inside the checkpoint {path}")
        out.append(d)
    if len(out) > 255:
        raise ValueError(f"checkpoint.save: {len(out)} stripe directories; at most 255")
    return out


def _stripe_dir(d, path, ckpt_id):
    return os.path.join(d, f"{os.path.basename(path)}.stripe-{ckpt_id}")


STRIPE_OWNER = "owner.json"


def _remove_stale_stripes(path, dirs, keep):
    """Removes stripe directories of `path` in `dirs` that no committed
    checkpoint refers to (left by a killed or failed save); keeps `keep`."""
    prefix = os.path.basename(path) + ".stripe-"
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            full = os.path.join(d, n)
            if not n.startswith(prefix) or full in keep:
                continue
            try:
                with open(os.path.join(full, STRIPE_OWNER)) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                continue
            if owner.get("checkpoint") == path:
                _rmtree(full)


def _committed_index(path):
    try:
        return _read_index(path)
    except (OSError, ValueError, NotImplementedError):
        return None


def _save(w, state_dict, path, *, async_, compress, base, block, lossy, stripe_dirs=None):
    if compress not in (None, "none", "lossless", "delta"):
        raise ValueError(f"checkpoint.save: compress={compress!r} is not valid "
                         "(valid: None, 'lossless', 'delta')")
    if compress == "delta" and base is None:
        raise ValueError("checkpoint.save: compress='delta' needs base=PATH of the previous checkpoint")
    if compress in ("lossless", "delta") and not _core.ckpt_have_zstd():
        raise NotImplementedError("checkpoint.save: compression needs libzstd, and this build has none")
    if w._pending is not None and not w._pending._done and not block and w._native.busy:
        raise StateError(f"checkpoint.save: a save to {w._pending._path} is still in flight on this "
                         "writer; call wait() on its handle first, or pass block=True")
    if w._pending is not None and not w._pending._done:
        try:  # finish the previous save; its error stays with its handle
            w._pending.wait()
        except Exception:  # noqa: BLE001
            pass
    w._native.join()  # the previous save's deferred removal of the checkpoint it replaced
    path = os.path.abspath(os.fspath(path))
    stripe_dirs = _check_stripe_dirs(stripe_dirs, path)
    dist, rank, world = _dist()
    t_start = time.perf_counter()

    lossy_error = None
    delta = None
    original_bytes = None
    if compress == "delta":
        original_bytes = _state_bytes(state_dict)
        from ebbtide import _ckpt_lossy
        base_abs = os.path.abspath(os.fspath(base))
        base_state = load(base_abs, device="cpu", rank=rank if world > 1 else None)
        state_dict, lossy_error = _ckpt_lossy.encode(state_dict, base_state, lossy)
        delta = {"base": os.path.relpath(base_abs, os.path.dirname(path)), "base_id": _read_index(base_abs)["id"]}

    fl = tree.Flattener(compress in ("lossless", "delta"))
    root = fl.tree(state_dict)
    ckpt_id = uuid.uuid4().hex
    version = 2 if stripe_dirs else 1  # unstriped checkpoints stay readable by version-1 readers
    meta = {"format": "ebbtide-checkpoint", "format_version": version, "id": ckpt_id, "rank": rank,
            "world_size": world, "tree": root, "tensors": fl.tensors, "storages": fl.storages,
            "compress": compress or "none", "torch": torch.__version__}
    if delta:
        meta["delta"] = delta
    if lossy_error is not None:
        meta["lossy_error"] = lossy_error
    blobs = []
    for name, st, nbytes, device, elem, codec in fl.blobs:
        on_dev = device.type == "cuda"
        stream = torch.cuda.current_stream(device).cuda_stream if on_dev else 0
        blobs.append((name, st.data_ptr() if nbytes else 0, nbytes, on_dev, stream, elem, codec))

    # One temporary directory (and one stripe directory per stripe_dirs entry)
    # for all ranks, named by rank 0.
    old_stripes = []
    stripes = []
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _core.ckpt_remove_stale_temps(path)
        old = _committed_index(path)
        old_stripes = list(old.get("stripes", [])) if old else []
        if stripe_dirs or old_stripes:
            _remove_stale_stripes(path, set(stripe_dirs) | {os.path.dirname(s) for s in old_stripes},
                                  set(old_stripes))
        tmp = _core.ckpt_make_temp_dir(path)
        try:
            for d in stripe_dirs:
                sd = _stripe_dir(d, path, ckpt_id)
                os.mkdir(sd)
                stripes.append(sd)
                _core.ckpt_write_file_durably(os.path.join(sd, STRIPE_OWNER),
                                              json.dumps({"checkpoint": path, "id": ckpt_id}))
        except BaseException:
            for sd in stripes:
                _rmtree(sd)
            _rmtree(tmp)
            raise
    else:
        tmp = None
    if dist is not None:
        box = [(tmp, ckpt_id, stripes)]
        dist.broadcast_object_list(box, src=0)
        tmp, ckpt_id, stripes = box[0]
        meta["id"] = ckpt_id
    shard = f"rank{rank}.ebt"
    index = {"format": "ebbtide-checkpoint", "format_version": version, "id": ckpt_id,
             "world_size": world, "shards": [f"rank{r}.ebt" for r in range(world)],
             "compress": compress or "none", "created": time.time()}
    if stripes:
        index["stripes"] = meta["stripes"] = stripes
    if delta:
        index["delta"] = delta
    single = dist is None
    pipelined = not async_  # the caller waits: the snapshot overlaps the writes
    try:
        native = w._native.save(os.path.join(tmp, shard), blobs, json.dumps(meta),
                                commit_dir=tmp if single else "", commit_path=path if single else "",
                                extra_files=[(INDEX_NAME, json.dumps(index, indent=1))] if single else [],
                                block=block, stripe_files=[os.path.join(sd, shard) for sd in stripes],
                                pipelined=pipelined)
    except BaseException:
        if single:
            _rmtree(tmp)
            for sd in stripes:
                _rmtree(sd)
        raise
    # Async: the snapshot holds the data now. Pipelined: the writer still reads the tensors.
    keep = (fl, blobs, state_dict) if pipelined else None
    del fl, blobs

    def finish():
        nonlocal keep
        err = None
        try:
            r = native.wait()
        except BaseException as e:  # noqa: BLE001 - reported to every rank below
            err = e
            r = None
        keep = None
        if dist is not None:
            errs = [None] * world
            dist.all_gather_object(errs, None if err is None else f"rank {rank}: {err}")
            failed = [e for e in errs if e]
            if not failed and rank == 0:
                try:
                    _core.ckpt_write_file_durably(os.path.join(tmp, INDEX_NAME), json.dumps(index, indent=1))
                    _core.ckpt_commit_directory(tmp, path)
                except BaseException as e:  # noqa: BLE001
                    failed = [f"rank 0 commit: {e}"]
                    err = e
            status = [None]
            if rank == 0:
                status = [failed]
            dist.broadcast_object_list(status, src=0)
            failed = status[0]
            if failed:
                if rank == 0:
                    _rmtree(tmp)
                    for sd in stripes:
                        _rmtree(sd)
                if err is not None:
                    raise err
                raise OSError(f"checkpoint.save to {path} failed on another rank: {'; '.join(failed)}")
        elif err is not None:
            _rmtree(tmp)
            for sd in stripes:
                _rmtree(sd)
            raise err
        if rank == 0:  # committed: the previous checkpoint's stripes go
            for sd in old_stripes:
                if sd not in stripes:
                    _rmtree(sd)
        info = SaveInfo(r)
        files = [os.path.join(path, shard)] + [os.path.join(sd, shard) for sd in stripes]
        info.update(path=path, file=os.path.join(path, shard), files=files, stripes=stripes, rank=rank, world_size=world,
                    compress=compress or "none",
                    original_bytes=original_bytes or info["raw_bytes"],
                    ratio=((original_bytes or info["raw_bytes"]) / info["stored_bytes"]) if info["stored_bytes"] else 1.0,
                    wall_seconds=time.perf_counter() - t_start)
        if lossy_error is not None:
            info["error"] = lossy_error
        return info

    handle = SaveHandle(finish)
    handle._native = native
    handle._path = path
    w._pending = handle
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


def _rmtree(p):
    import shutil
    shutil.rmtree(p, ignore_errors=True)


def _read_index(path):
    ip = os.path.join(path, INDEX_NAME)
    if not os.path.isdir(path):
        raise FileNotFoundError(2, "checkpoint directory does not exist", path)
    try:
        with open(ip, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(2, f"not an ebbtide checkpoint (no {INDEX_NAME})", path) from None
    try:
        idx = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{ip}: corrupt checkpoint index ({e})") from None
    if idx.get("format") != "ebbtide-checkpoint":
        raise ValueError(f"{ip}: not an ebbtide checkpoint index")
    v = idx.get("format_version")
    if not isinstance(v, int) or v > FORMAT_VERSION or v < 1:
        raise NotImplementedError(f"{ip}: checkpoint format version {v} is not supported by this ebbtide "
                                  f"(it reads versions 1 to {FORMAT_VERSION}); upgrade ebbtide to load it")
    return idx


def _resolve_rank(idx, rank, path):
    world = idx["world_size"]
    if rank is None:
        dist, r, w = _dist()
        if dist is not None and w == world:
            return r
        if world == 1:
            return 0
        raise ValueError(f"checkpoint {path} has {world} shards (world size {world}); this process is not part "
                         f"of a matching torch.distributed job: pass rank=R to load one shard or rank='all'")
    if not (0 <= rank < world):
        raise ValueError(f"checkpoint {path}: rank {rank} out of range (world size {world})")
    return rank


def _map_device(saved, device):
    if device is not None:
        return torch.device(device)
    d = torch.device(saved)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"checkpoint: a tensor was saved on {saved}, which is not available here; "
                         "pass device='cpu'")
    return d


# Storages at least this large are allocated page-aligned on the host, so the
# reader's O_DIRECT reads land in them in place (Note [Read pipeline]).
_ALIGNED_MIN_BYTES = 1 << 20


def _host_buffer(nbytes):
    if nbytes >= _ALIGNED_MIN_BYTES:
        # An anonymous mapping is page-aligned; the tensor keeps it alive.
        return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8)


def _stripe_files(idx, shard_name):
    return [os.path.join(sd, shard_name) for sd in idx.get("stripes", [])]


def _load_shard(file, device, threads=0, stripes=()):
    reader = _core.CkptReader(file, stripes=list(stripes))
    meta = json.loads(reader.meta)
    blobs_info = reader.blobs
    storages = []
    targets = []
    for s in meta["storages"]:
        dev = _map_device(s["device"], device)
        if dev.type == "cpu":
            buf = _host_buffer(s["nbytes"])
        else:
            buf = torch.empty(s["nbytes"], dtype=torch.uint8, device=dev)
        storages.append(buf)
        if s["nbytes"]:
            b = blobs_info[s["blob"]]
            if b["nbytes"] != s["nbytes"]:
                raise ValueError(f"{file}: storage of {b['name']} has {b['nbytes']} bytes in the shard, "
                                 f"{s['nbytes']} in the metadata")
            on_dev = dev.type == "cuda"
            stream = torch.cuda.current_stream(dev).cuda_stream if on_dev else 0
            targets.append((s["blob"], buf.data_ptr(), on_dev, stream))
    reader.read(targets, threads)
    tensors = []
    for t in meta["tensors"]:
        if t.get("layout") == "sparse_coo":
            tensors.append(torch.sparse_coo_tensor(tensors[t["indices"]], tensors[t["values"]], t["shape"]))
            continue
        dtype = tree.dtype_from_name(t["dtype"], file)
        st = storages[t["storage"]]
        x = torch.empty(0, dtype=dtype, device=st.device)
        x.set_(st.untyped_storage(), t["offset"], t["shape"], t["stride"])
        if t.get("parameter"):
            x = torch.nn.Parameter(x, requires_grad=t.get("requires_grad", True))
        tensors.append(x)
    state = tree.build(meta["tree"], tensors)
    return state, meta


def load(path, *, device=None, into=None, rank=None, strict=True):
    """Loads the checkpoint directory `path`.

    device: where tensors go (default: where they were saved). rank: the shard
    to load (default: this process's rank under torch.distributed, else 0 for
    single-shard checkpoints); rank='all' returns a list, one state per rank.
    into: an nn.Module (load_state_dict after shape checks) or a (nested) dict
    of tensors to copy into in place; shape mismatches raise ValueError naming
    the tensor. Returns the loaded state (or `into`)."""
    path = os.path.abspath(os.fspath(path))
    idx = _read_index(path)
    if rank == "all":
        return [load(path, device=device, rank=r) for r in range(idx["world_size"])]
    r = _resolve_rank(idx, rank, path)
    state, meta = _load_shard(os.path.join(path, idx["shards"][r]), device,
                              stripes=_stripe_files(idx, idx["shards"][r]))
    if meta.get("id") != idx.get("id"):
        raise ValueError(f"{path}: shard rank{r}.ebt belongs to checkpoint {meta.get('id')}, "
                         f"the index to {idx.get('id')}")
    if "delta" in meta:
        from ebbtide import _ckpt_lossy
        base_path = os.path.normpath(os.path.join(os.path.dirname(path), meta["delta"]["base"]))
        base_idx = _read_index(base_path)
        if base_idx["id"] != meta["delta"]["base_id"]:
            raise ValueError(f"{path}: delta checkpoint needs base {base_path} with id {meta['delta']['base_id']}, "
                             f"but that directory now holds checkpoint {base_idx['id']}")
        base_state = load(base_path, device=device, rank=r)
        state = _ckpt_lossy.decode(state, base_state)
    if into is None:
        return state
    return _load_into(into, state, strict)


def _load_into(into, state, strict):
    if isinstance(into, torch.nn.Module):
        own = into.state_dict()
        _check_shapes(own, state, "model")
        into.load_state_dict(state, strict=strict)
        return into
    _copy_into(into, state, "state", strict)
    return into


def _check_shapes(own, state, where):
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint: cannot load into {where}: the checkpoint holds a {type(state).__name__}, "
                         "not a state dict")
    for k, v in own.items():
        if k in state and isinstance(v, torch.Tensor) and isinstance(state[k], torch.Tensor):
            if tuple(v.shape) != tuple(state[k].shape):
                raise ValueError(f"checkpoint: tensor {k!r}: shape {tuple(state[k].shape)} in the checkpoint, "
                                 f"{tuple(v.shape)} in {where}")


def _copy_into(dst, src, path, strict):
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor):
            raise ValueError(f"checkpoint: {path}: a tensor is expected, the checkpoint holds {type(src).__name__}")
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"checkpoint: tensor {path}: shape {tuple(src.shape)} in the checkpoint, "
                             f"{tuple(dst.shape)} in the target")
        with torch.no_grad():
            dst.copy_(src)
        return
    if isinstance(dst, dict):
        if not isinstance(src, dict):
            raise ValueError(f"checkpoint: {path}: a dict is expected, the checkpoint holds {type(src).__name__}")
        missing = [k for k in dst if k not in src]
        if strict and missing:
            raise ValueError(f"checkpoint: {path}: keys missing from the checkpoint: {missing[:10]}")
        for k, v in dst.items():
            if k in src:
                if isinstance(v, (torch.Tensor, dict, list)):
                    _copy_into(v, src[k], tree._join(path, k), strict)
                else:
                    dst[k] = src[k]
        return
    if isinstance(dst, list):
        if not isinstance(src, (list, tuple)) or len(src) != len(dst):
            raise ValueError(f"checkpoint: {path}: list of {len(dst)} expected")
        for i, v in enumerate(dst):
            if isinstance(v, (torch.Tensor, dict, list)):
                _copy_into(v, src[i], f"{path}[{i}]", strict)
            else:
                dst[i] = src[i]


def inspect(path, *, verify=True):
    """Describes a checkpoint: index, and per shard its tensors (path, dtype,
    shape, storage bytes, stored bytes, codec, offset) and, with `verify`, the
    problems found by reading every chunk (list of (tensor, offset, message))."""
    path = os.path.abspath(os.fspath(path))
    idx = _read_index(path)
    out = {"path": path, "index": idx, "shards": []}
    for name in idx["shards"]:
        f = os.path.join(path, name)
        reader = _core.CkptReader(f, stripes=_stripe_files(idx, name))
        meta = json.loads(reader.meta)
        blobs = reader.blobs
        rows = []
        for t in meta["tensors"]:
            if "storage" not in t:
                rows.append({"path": t["path"], "dtype": t.get("layout"), "shape": t["shape"], "nbytes": 0,
                             "stored_bytes": 0, "codec": "-", "offset": 0, "shared": False})
                continue
            s = meta["storages"][t["storage"]]
            b = blobs[s["blob"]] if s["nbytes"] else None
            rows.append({"path": t["path"], "dtype": t["dtype"], "shape": t["shape"], "nbytes": s["nbytes"],
                         "stored_bytes": b["stored_bytes"] if b else 0, "codec": b["codec"] if b else "none",
                         "offset": b["offset"] if b else 0, "shared": b is not None and b["name"] != t["path"]})
        shard = {"file": f, "format_version": reader.format_version, "file_bytes": reader.file_bytes,
                 "stripe_files": _stripe_files(idx, name),
                 "tensors": rows, "raw_bytes": sum(b["nbytes"] for b in blobs),
                 "stored_bytes": sum(b["stored_bytes"] for b in blobs),
                 "lossy_error": meta.get("lossy_error")}
        if verify:
            shard["problems"] = reader.verify()
        out["shards"].append(shard)
    return out
