"""The native checkpoint format's load path: ``checkpoint.load`` (into new
tensors, or in place into a module's or a dict's tensors), ``checkpoint.inspect``
and the data verification it runs (docs/checkpoints.md). Public names are
re-exported by ``ebbtide.checkpoint``; saving is in native_save.py.

Loading executes no code: the index and shard tables are validated as hostile
input (validate.py) before anything is read.
"""
import mmap
import os

import torch

from ebbtide.checkpoint import tree
from ebbtide.checkpoint import validate
from ebbtide.checkpoint.checks import check_of, tag
from ebbtide.checkpoint.native_save import _dist


__all__ = ["load", "inspect"]


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
        d = torch.device(device)
        if d.type == "cuda" and d.index is None:  # "cuda" means the current device
            d = torch.device("cuda", torch.cuda.current_device())
        return d
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


def _in_place_storages(meta, dests, device):
    """Note [Load in place]: storage index -> destination tensor whose storage
    the shard's bytes may be read into directly: every checkpoint tensor on
    that storage has a destination, all on one storage of the same size and
    device, with the same dtype, shape, strides and offset, one of them
    spanning the whole storage, and no other checkpoint storage maps there.
    Other storages load into fresh memory and are copied."""
    if not dests or "delta" in meta:
        return {}
    by_storage = {}
    for t in meta["tensors"]:
        if "storage" in t:
            by_storage.setdefault(t["storage"], []).append(t)
    chosen, claimed = {}, set()
    for sid, entries in by_storage.items():
        nbytes = meta["storages"][sid]["nbytes"]
        if not nbytes:
            continue
        dev = _map_device(meta["storages"][sid]["device"], device)
        ds = [dests.get(t["path"]) for t in entries]
        if not all(d is not None and _same_layout(d, t, nbytes, dev) for d, t in zip(ds, entries)):
            continue
        # One destination storage, overwritten whole: a destination must span it,
        # or bytes the caller did not ask to load (a view's neighbours) would change.
        ptrs = {d.untyped_storage().data_ptr() for d in ds}
        if len(ptrs) != 1 or not any(d.is_contiguous() and d.storage_offset() == 0 and
                                     d.numel() * d.element_size() == nbytes for d in ds):
            continue
        key = (str(dev), ptrs.pop())
        if key in claimed:  # two saved storages onto one destination: neither in place
            chosen = {k: v for k, v in chosen.items() if (str(v.device), v.untyped_storage().data_ptr()) != key}
            continue
        claimed.add(key)
        chosen[sid] = ds[0]
    return chosen


def _same_layout(d, t, nbytes, device):
    """Destination tensor `d` matches checkpoint tensor entry `t` (on a storage
    of `nbytes`, loaded to `device`) byte for byte."""
    return (d.layout == torch.strided and not d.is_conj() and not d.is_neg() and d.device == device and
            d.dtype == tree.dtype_from_name(t["dtype"]) and list(d.shape) == t["shape"] and
            list(d.stride()) == t["stride"] and d.storage_offset() == t["offset"] and
            d.untyped_storage().nbytes() == nbytes)


def _read_storages(shard, device, threads=0, in_place=None, only=None):
    """Reads the storages of `shard` (a validate.Shard): one uint8 tensor per
    storage holding its bytes, or the caller's tensor for storages in
    `in_place` (Note [Load in place]). With `only`, the storages not in it
    stay stand-ins on the meta device and are not read. A chunk that fails
    its checksum or decoding raises (ChecksumError naming the tensor, the
    file and the offset)."""
    storages = []
    targets = []
    for sid, s in enumerate(shard.meta["storages"]):
        if only is not None and sid not in only:
            storages.append(torch.empty(s["nbytes"], dtype=torch.uint8, device="meta"))
            continue
        dev = _map_device(s["device"], device)
        if in_place and sid in in_place:
            buf = in_place[sid]
        elif dev.type == "cpu":
            buf = _host_buffer(s["nbytes"])
        else:
            buf = torch.empty(s["nbytes"], dtype=torch.uint8, device=dev)
        storages.append(buf)
        if s["nbytes"]:  # its blob has the same size (validate.check_meta)
            targets.append((s["blob"], buf.untyped_storage().data_ptr(), s["nbytes"], dev.type == "cuda",
                            tree.core_stream(dev)))
    try:
        shard.reader.read(targets, threads)
    except validate.READER_ERRORS as e:
        raise tag(e, "ckpt.chunk")
    return storages


def _load_shard(shard, device, threads=0, dests=None):
    """Reads one shard, checked by validate.open_chain. `dests` (path ->
    existing tensor) lets storages be read straight into the caller's tensors
    (Note [Load in place]); their entries in the returned state are those
    tensors."""
    in_place = _in_place_storages(shard.meta, dests, device)
    storages = _read_storages(shard, device, threads, in_place)
    tensors = tree.view_tensors(shard.file, shard.meta, storages, in_place, dests)
    return tree.build(shard.meta["tree"], tensors, shard.file)


def _nested_state_hint(saved, own):
    """What to do when a module's keys are missing from the checkpoint's top
    level: say where its state is, when an entry holds it (the usual
    {"model": ..., "optimizer": ..., "step": ...}), else what into= takes."""
    holders = sorted(k for k, v in saved.items() if isinstance(k, str) and isinstance(v, dict) and own <= set(v))
    if holders:
        k = holders[0]
        return (f"; into= takes the module's own state, which this checkpoint holds under {k!r}: "
                f"state = ebbtide.checkpoint.load(path); model.load_state_dict(state[{k!r}]) loads it "
                "and returns the rest")
    return "; into= takes what the module's state_dict() saved (load without into= to see what is there)"


def _check_before_reading(shard, dests, into, strict, path):
    """Shape and key errors for a load into existing tensors, raised before any
    byte of them is overwritten. `dests`: the tensors of `into` (a module's
    state_dict) by checkpoint path; `shard`: the checked shard, whose `decoded`
    state holds stand-ins shaped as the loaded tensors will be."""
    saved = dict(tree.walk_tensors(shard.decoded))
    if isinstance(into, torch.nn.Module):
        if not isinstance(shard.decoded, dict):
            raise ValueError(f"checkpoint: cannot load {path} into a module: the checkpoint holds a "
                             f"{type(shard.decoded).__name__}, not a state dict")
        if strict:
            keys = set(shard.decoded)
            own = set(into.state_dict())
            missing, unexpected = sorted(own - keys), sorted(k for k in keys - own if isinstance(k, str))
            if missing or unexpected:
                raise ValueError(f"checkpoint: cannot load {path} into the module (strict): "
                                 f"missing keys {missing[:10]}, unexpected keys {unexpected[:10]}"
                                 + _nested_state_hint(shard.decoded, own))
    for p, d in dests.items():
        t = saved.get(p)
        if t is not None and list(d.shape) != list(t.shape):
            name = p[len("state."):] if isinstance(into, torch.nn.Module) else p
            raise ValueError(f"checkpoint: tensor {name!r}: shape {tuple(t.shape)} in the checkpoint, "
                             f"{tuple(d.shape)} in the target")


def load(path, *, device=None, into=None, rank=None, strict=True):
    """Loads the checkpoint directory `path`.

    device: where tensors go (default: where they were saved). rank: the shard
    to load (default: this process's rank under torch.distributed, else 0 for
    single-shard checkpoints); rank='all' returns a list, one state per rank.
    into: an nn.Module (load_state_dict after shape checks) or a (nested) dict
    of tensors to copy into in place; shape mismatches raise ValueError naming
    the tensor, before anything is overwritten. Where a destination tensor has
    the saved layout, its bytes are read straight into it (Note [Load in
    place]): no second copy of the state is made. Returns the loaded state (or
    `into`). The checkpoint is treated as hostile input (docs/checkpoints.md,
    "Threat model"): a malformed or crafted file raises ValueError naming the
    file and the problem (ChecksumError, an OSError, for a bad checksum;
    NotImplementedError for a newer format), before any tensor memory is
    allocated where the problem is in the tables, metadata or delta chain;
    `inspect` makes the same checks (Note [One validator] in checks.py)."""
    path = os.path.abspath(os.fspath(path))
    idx = validate.read_index(path)
    if rank == "all":
        return [load(path, device=device, rank=r) for r in range(idx["world_size"])]
    r = _resolve_rank(idx, rank, path)
    chain = validate.open_chain(path, idx, r)  # the shard and its delta bases, checked
    # The destinations by checkpoint path (a module's state_dict sits at the root).
    dests = None
    if into is not None:
        dests = dict(tree.walk_tensors(into.state_dict() if isinstance(into, torch.nn.Module) else into))
        _check_before_reading(chain[0], dests, into, strict, path)
    state = None
    for k in range(len(chain) - 1, -1, -1):  # the deepest base first: a delta decodes against its base as loaded
        shard = chain[k]
        loaded = _load_shard(shard, device, dests=dests if k == 0 else None)
        if shard.base is not None:
            from ebbtide.checkpoint import lossy as _lossy
            loaded = _lossy.decode(loaded, state, shard.file)
        state = loaded
    if into is None:
        return state
    return _load_into(into, state, strict)


def _load_into(into, state, strict):
    # Shapes, keys and the state's kind were checked before reading (_check_before_reading).
    if isinstance(into, torch.nn.Module):
        into.load_state_dict(state, strict=strict)
        return into
    _copy_into(into, state, "state", strict)
    return into


def _copy_into(dst, src, path, strict):
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor):
            raise ValueError(f"checkpoint: {path}: a tensor is expected, the checkpoint holds {type(src).__name__}")
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"checkpoint: tensor {path}: shape {tuple(src.shape)} in the checkpoint, "
                             f"{tuple(dst.shape)} in the target")
        if src is not dst:  # read in place already (Note [Load in place])
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


def inspect(path, *, verify=True, progress=None):
    """Describes a checkpoint and checks it the way load() does, with the same
    code (Note [One validator] in checks.py).

    Args:
        path: the checkpoint directory.
        verify: also read every chunk and check its checksum and decoding,
            and the checks load() makes on the data (sparse indices, lossy
            codes), in the shard and in its delta bases. Without it no tensor
            data is read.
        progress: optional f(done_bytes, total_bytes), called after each
            shard with the shard files' bytes checked so far.

    Returns:
        {"path", "index", "shards": [...]}; per shard its file, format
        version, sizes, tensors (path, dtype, shape, storage bytes, stored
        bytes, codec, offset), "error" and "check" where load() would refuse
        the shard (its message and the id of the check in
        checks.CHECKS), and, with `verify`, "problems": a list of
        (tensor, file offset, message), one per bad chunk.

    Raises:
        FileNotFoundError: no checkpoint directory or index there.
        ValueError: a corrupt or hostile index.json.
        NotImplementedError: a newer format version.
    """
    path = os.path.abspath(os.fspath(path))
    idx = validate.read_index(path)
    out = {"path": path, "index": idx, "shards": []}
    sizes = [_file_bytes(os.path.join(path, name)) for name in idx["shards"]]
    for r, name in enumerate(idx["shards"]):
        if progress is not None:
            progress(sum(sizes[:r]), sum(sizes))
        try:
            chain = validate.open_chain(path, idx, r)
        except validate.READER_ERRORS as e:
            out["shards"].append({"file": os.path.join(path, name), "error": str(e), "check": check_of(e),
                                  "tensors": [], "problems": []})
            continue
        shard = _describe_shard(chain[0])
        shard["chain"] = [_describe_link(s, verify) for s in chain]
        if verify:
            shard["problems"] = [p for link in shard["chain"] for p in link["problems"]]
            if not shard["problems"]:
                try:
                    _verify_data(chain)
                except validate.READER_ERRORS as e:
                    shard["error"], shard["check"] = str(e), check_of(e)
        out["shards"].append(shard)
    if progress is not None:
        progress(sum(sizes), sum(sizes))
    return out


def _describe_link(shard, verify):
    """One link of a delta chain as inspect() lists it: its file, id, base,
    stored bytes, recorded lossy error and (verify) its bad chunks."""
    le = shard.meta.get("lossy_error")
    return {"file": shard.file, "id": shard.meta["id"], "compress": shard.meta.get("compress", "none"),
            "base": shard.base, "stored_bytes": sum(b["stored_bytes"] for b in shard.reader.blobs),
            "lossy_error": le.get("overall") if isinstance(le, dict) else None,
            "problems": shard.reader.verify() if verify else []}


def _file_bytes(path):
    try:
        return os.path.getsize(path)
    except OSError:  # missing or unreadable: reported by the checks
        return 0


def _describe_shard(shard):
    blobs = shard.reader.blobs
    meta = shard.meta
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
    return {"file": shard.file, "format_version": shard.reader.format_version, "file_bytes": shard.reader.file_bytes,
            "stripe_files": shard.stripes, "tensors": rows, "raw_bytes": sum(b["nbytes"] for b in blobs),
            "stored_bytes": sum(b["stored_bytes"] for b in blobs), "lossy_error": meta.get("lossy_error")}


def _verify_data(chain):
    """The checks load() makes on the data of a checked chain (sparse indices
    inside their shape, lossy codes and masks that fit), in load()'s order
    (the deepest base first), by the same code, reading only the storages
    they need (onto the CPU)."""
    from ebbtide.checkpoint import lossy as _lossy
    for shard in reversed(chain):
        meta = shard.meta
        need = set()
        for t in meta["tensors"]:
            if t.get("layout") == "sparse_coo":
                need.update(meta["tensors"][t[k]]["storage"] for k in ("indices", "values"))
        index_of = {id(t): i for i, t in enumerate(shard.tensors)}
        encoded = _lossy.encoded_tensors(shard.state) if shard.base is not None else []
        for _, e in encoded:
            need.update(meta["tensors"][index_of[id(e[k])]]["storage"] for k in ("mask", "codes", "codebook"))
        if not need:
            continue
        storages = _read_storages(shard, "cpu", only=need)
        tensors = tree.view_tensors(shard.file, meta, storages)
        if encoded:
            state = tree.build(meta["tree"], tensors, shard.file)
            _lossy.verify(state, shard.file)
