"""The validator of ebbtide checkpoints (Note [One validator] in
checks.py): `open_chain` checks a shard, and the delta bases it
depends on, exactly as load() needs them, for load() and `ebbtide ckpt
inspect` alike. Everything here treats the checkpoint as hostile
(docs/checkpoints.md, "Threat model"): a field of the wrong type, a path
leading out of the checkpoint directory, a tensor reaching past its storage,
a tree referring to a tensor that is not there or a special file in place of
a regular one raises the error of its entry in checks.CHECKS, naming
the file and what is wrong, before any tensor memory is allocated. The
binary shard tables are checked by the C++ reader (Note [Hostile headers] in
cpp/src/ckpt/format.cpp); this module checks the JSON index and metadata
against them, and builds the tensors and the object tree on the meta device
with the code that load() builds them with.
"""
import errno
import json
import os
import re
import stat
import threading

import torch

from ebbtide.checkpoint import tree
from ebbtide import _core
from ebbtide.checkpoint.checks import fail, tag

# JSON numbers become Python ints of any size; torch and the C++ core take
# 64-bit ones. Sizes, strides and offsets above this are refused.
MAX_INT = 1 << 62
MAX_INDEX_BYTES = 64 << 20  # index.json and owner.json are small; a bigger one is not ours
MAX_DIMS = 64
ID = re.compile(r"[0-9a-f]{1,64}")  # a checkpoint id
INDEX_NAME = "index.json"
FORMAT_VERSION = _core.CKPT_FORMAT_VERSION
# What the C++ readers raise for a file they refuse; anything else is a bug or the machine's.
READER_ERRORS = (OSError, ValueError, NotImplementedError)


def is_int(x, lo=0, hi=MAX_INT):
    """A JSON integer (not a bool) in [lo, hi]."""
    return type(x) is int and lo <= x <= hi


def read_regular_file(path, what, limit=MAX_INDEX_BYTES):
    """Reads `path` if it is a regular file (Note [Regular files only] in
    cpp/src/io/direct_file.cpp): a symlink as the last component, a FIFO, a
    device or a directory raises ValueError at once instead of being followed
    or blocking. FileNotFoundError when it does not exist; ValueError when it
    is larger than `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise fail("file.symlink", path, what=what) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise fail("file.special", path, what=what)
        if st.st_size > limit:
            raise fail("file.too_large", path, what=what, size=st.st_size, limit=limit)
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            total += len(b)
            if total > limit:
                raise fail("file.too_large", path, what=what, size=f"at least {total}", limit=limit)
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_json(raw, **kwargs):
    """json.loads(raw, **kwargs) on a thread of its own. Python counts JSON
    nesting against the thread's recursion limit, so on the caller's thread
    deeply nested JSON would parse or fail depending on how deep the caller's
    stack is, and load() could refuse what inspect accepted; on a fresh
    thread the outcome depends on the bytes alone."""
    out = {}

    def run():
        try:
            out["value"] = json.loads(raw, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            out["error"] = e
    t = threading.Thread(target=run, name="ebbtide-json")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def read_index(path):
    """Reads and checks the index.json of checkpoint directory `path`."""
    ip = os.path.join(path, INDEX_NAME)
    if not os.path.isdir(path):
        raise fail("ckpt.index.no_directory", path)
    try:
        raw = read_regular_file(ip, "checkpoint index")
    except FileNotFoundError:
        raise fail("ckpt.index.missing", path, name=INDEX_NAME) from None
    try:
        idx = parse_json(raw)
    except (ValueError, RecursionError) as e:
        raise fail("ckpt.index.json", ip, error=e) from None
    return check_index(idx, ip)


def check_index(idx, ip, format_version=FORMAT_VERSION):
    """Checks the fields of a parsed index.json (`ip` its path) that loading
    uses; ValueError naming the field, NotImplementedError for a newer
    format version."""
    if not isinstance(idx, dict) or idx.get("format") != "ebbtide-checkpoint":
        raise fail("ckpt.index.format", ip)
    v = idx.get("format_version")
    if not is_int(v, 1, MAX_INT) or v > format_version:
        raise fail("ckpt.index.version", ip, version=v, known=format_version)
    if not isinstance(idx.get("id"), str) or not ID.fullmatch(idx["id"]):
        raise fail("ckpt.index.id", ip, id=idx.get("id"))
    world = idx.get("world_size")
    if not is_int(world, 1, 1 << 20):
        raise fail("ckpt.index.world_size", ip, world=world)
    shards = idx.get("shards")
    if not isinstance(shards, list) or len(shards) != world:
        raise fail("ckpt.index.shards", ip, world=world)
    for s in shards:
        check_member_name(s, ip, "shards entry")
    stripes = idx.get("stripes", [])
    if not isinstance(stripes, list) or not all(isinstance(s, str) for s in stripes) or len(stripes) > 255:
        raise fail("ckpt.index.stripes", ip)
    if not isinstance(idx.get("compress", "none"), str):
        raise fail("ckpt.index.compress", ip)
    if "delta" in idx:
        check_delta(idx["delta"], ip)
    return idx


def check_member_name(name, where, what):
    """`name` names a file inside the checkpoint directory: one plain path
    component (no '/', not '.' or '..', no NUL). The file itself is opened
    without following a symlink, so it cannot lead out of the directory."""
    if (not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", "..")
            or len(name) > 255):
        raise fail("ckpt.index.shard_name", where, what=what, name=str(name)[:80])
    return name


def check_delta(delta, where):
    if (not isinstance(delta, dict) or not isinstance(delta.get("base"), str) or not delta["base"]
            or "\0" in delta["base"] or not isinstance(delta.get("base_id"), str)):
        raise fail("ckpt.delta.entry", where, delta=str(delta)[:80])


def stripe_dir_matches(sd, ckpt_id):
    """`sd` may hold stripe files of checkpoint `ckpt_id`
    (ckpt::stripe_dir_matches in the core: an absolute, normalised path whose
    last component is a stripe directory name `<name>.stripe-[<tag>-]<id>`
    with that id)."""
    try:
        return isinstance(sd, str) and _core.ckpt_stripe_dir_matches(sd, ckpt_id)
    except (TypeError, UnicodeError):  # a string the core cannot take (lone surrogates)
        return False


def stripe_files(idx, shard_name, ip):
    """The stripe files of shard `shard_name` named by the checked index `idx`
    (read from `ip`); ValueError for a stripe entry that is not a stripe
    directory of this checkpoint (Note [Stripe ownership] in
    cpp/src/ckpt/transaction.cpp)."""
    out = []
    for sd in idx.get("stripes", []):
        if not stripe_dir_matches(sd, idx["id"]):
            raise fail("ckpt.index.stripe_dir", ip, entry=str(sd)[:120], id=idx["id"])
        out.append(os.path.join(sd, shard_name))
    return out


def check_meta(meta, blobs, file):
    """Checks a shard's metadata (parsed JSON) against its blob table (the C++
    reader's `blobs`): storages name existing blobs of their size, each blob
    exactly one storage; every strided tensor lies inside its storage; sparse
    tensors refer to earlier strided ones of a matching layout. The tree is
    checked while it is built (tree.build). ValueError naming `file` and the
    entry."""
    if not isinstance(meta, dict):
        raise fail("ckpt.meta.object", file)
    storages, tensors = meta.get("storages"), meta.get("tensors")
    if not isinstance(storages, list) or not isinstance(tensors, list):
        raise fail("ckpt.meta.lists", file)
    if "tree" not in meta:
        raise fail("ckpt.meta.tree", file)
    if not isinstance(meta.get("id"), str):
        raise fail("ckpt.meta.id", file)
    if "delta" in meta:
        check_delta(meta["delta"], file)
    used = {}
    for i, s in enumerate(storages):
        if not isinstance(s, dict) or not is_int(s.get("nbytes")) or not isinstance(s.get("device"), str):
            raise fail("ckpt.storage.fields", file, i=i)
        try:
            dev = torch.device(s["device"])
        except (RuntimeError, ValueError, TypeError):
            raise fail("ckpt.storage.device", file, i=i, device=s["device"][:40], why="is not a device name") from None
        if dev.type not in ("cpu", "cuda"):
            raise fail("ckpt.storage.device", file, i=i, device=s["device"][:40], why="is not cpu or cuda")
        if s["nbytes"] == 0:
            continue
        b = s.get("blob")
        if not is_int(b, 0, len(blobs) - 1):
            raise fail("ckpt.storage.blob", file, i=i, blob=b, n=len(blobs))
        if b in used:
            raise fail("ckpt.storage.blob_twice", file, first=used[b], i=i, blob=b)
        used[b] = i
        if blobs[b]["nbytes"] != s["nbytes"]:
            raise fail("ckpt.storage.nbytes", file, i=i, name=blobs[b]["name"], blob_bytes=blobs[b]["nbytes"],
                       nbytes=s["nbytes"])
    for b, blob in enumerate(blobs):  # load() reads the storages' blobs: one of none would be left unread
        if b not in used and blob["nbytes"]:
            raise fail("ckpt.storage.blob_unused", file, blob=b, name=blob["name"][:80])
    for i, t in enumerate(tensors):
        if not isinstance(t, dict) or not isinstance(t.get("path"), str):
            raise fail("ckpt.tensor.path", file, i=i)
        where = f"tensor {i} ({t['path'][:80]!r})"
        shape = t.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_int(n) for n in shape):
            raise fail("ckpt.tensor.shape", file, t=where, shape=str(shape)[:80])
        numel = 1
        for n in shape:
            numel *= n
        if numel > MAX_INT:
            raise fail("ckpt.tensor.numel", file, t=where, shape=shape)
        layout = t.get("layout", "strided")
        if layout == "sparse_coo":
            _check_sparse(t, i, tensors, storages, where, file)
            continue
        if layout != "strided":
            raise fail("ckpt.tensor.layout", file, t=where, layout=str(layout)[:40])
        if not isinstance(t.get("dtype"), str):
            raise fail("ckpt.tensor.dtype", file, t=where)
        dtype = tree.dtype_from_name(t["dtype"], file)
        stride, offset, sid = t.get("stride"), t.get("offset"), t.get("storage")
        if not isinstance(stride, list) or len(stride) != len(shape) or not all(is_int(x) for x in stride):
            raise fail("ckpt.tensor.stride", file, t=where, stride=str(stride)[:80], shape=shape)
        if not is_int(offset):
            raise fail("ckpt.tensor.offset", file, t=where, offset=offset)
        if not is_int(sid, 0, len(storages) - 1):
            raise fail("ckpt.tensor.storage", file, t=where, sid=sid, n=len(storages))
        for k in ("parameter", "requires_grad"):
            if k in t and not isinstance(t[k], bool):
                raise fail("ckpt.tensor.flag", file, t=where, flag=k)
        if numel:
            end = (offset + sum((n - 1) * x for n, x in zip(shape, stride)) + 1) * dtype.itemsize
            if end > storages[sid]["nbytes"]:
                raise fail("ckpt.tensor.extent", file, t=where, shape=shape, stride=stride, offset=offset, end=end,
                           sid=sid, nbytes=storages[sid]["nbytes"])


def _check_sparse(t, i, tensors, storages, where, file):
    """A sparse COO entry: indices and values are earlier strided tensors on
    one device, int64 indices [sparse_dim, nnz] and values [nnz,
    *shape[sparse_dim:]] (what torch.sparse_coo_tensor needs; only the index
    values, which are data, are left to check_invariants when the tensor is
    built)."""
    refs = {}
    for k in ("indices", "values"):
        j = t.get(k)
        if not is_int(j, 0, i - 1) or tensors[j].get("layout", "strided") != "strided":
            raise fail("ckpt.sparse.refs", file, t=where, what=k, ref=j)
        refs[k] = tensors[j]
    shape, ind, val = t["shape"], refs["indices"], refs["values"]
    dims = ind["shape"][0] if len(ind["shape"]) == 2 else -1
    if ind["dtype"] != "int64" or dims < 0 or dims > len(shape):
        raise fail("ckpt.sparse.layout", file, path=t["path"][:80],
                   error=f"indices are {ind['dtype']} {ind['shape']}, not int64 [sparse dims, nnz]")
    if not val["shape"] or val["shape"][0] != ind["shape"][1] or val["shape"][1:] != shape[dims:]:
        raise fail("ckpt.sparse.layout", file, path=t["path"][:80],
                   error=f"values of shape {val['shape']} do not hold {ind['shape'][1]} entries of the dense "
                         f"dimensions {shape[dims:]}")
    devices = {storages[ind["storage"]]["device"], storages[val["storage"]]["device"]}
    if len(devices) > 1:
        raise fail("ckpt.sparse.layout", file, path=t["path"][:80],
                   error=f"its indices and values were saved on {' and '.join(sorted(devices))}")


class Shard:
    """Shard `r` of checkpoint `path` (index `idx`, checked), opened and
    checked as load() needs it (Note [One validator]): its files confined as
    the threat model says (docs/checkpoints.md), its tables and extents (by the
    C++ reader), its metadata against them and the index, and its tensors and
    object tree built on the meta device (`tensors`, `state`) by the code that
    builds them from the data. Attributes: path, file, stripes, reader, meta,
    tensors, state, decoded (the state as its lossy tensors decode, set by
    open_chain)."""

    def __init__(self, path, idx, r):
        self.path, self.rank = path, r
        name = idx["shards"][r]
        self.file = os.path.join(path, name)
        self.stripes = stripe_files(idx, name, os.path.join(path, INDEX_NAME))
        try:
            self.reader = _core.CkptReader(self.file, stripes=self.stripes)
        except READER_ERRORS as e:
            raise tag(e, "ckpt.shard.tables")
        try:
            self.reader.check_extents()
        except READER_ERRORS as e:
            raise tag(e, "ckpt.shard.extents")
        try:
            meta = parse_json(self.reader.meta)
        except (ValueError, RecursionError) as e:
            raise fail("ckpt.meta.json", self.file, error=e) from None
        check_meta(meta, self.reader.blobs, self.file)
        if meta["id"] != idx["id"]:
            raise fail("ckpt.meta.other_checkpoint", path, name=name, shard_id=meta["id"][:64], id=idx["id"])
        self.meta = meta
        stand_ins = [torch.empty(s["nbytes"], dtype=torch.uint8, device="meta") for s in meta["storages"]]
        self.tensors = tree.view_tensors(self.file, meta, stand_ins)
        self.state = self.decoded = tree.build(meta["tree"], self.tensors, self.file)

    @property
    def base(self):
        """The base checkpoint's path of a delta shard (None otherwise)."""
        if "delta" not in self.meta:
            return None
        return os.path.normpath(os.path.join(os.path.dirname(self.path), self.meta["delta"]["base"]))


def open_chain(path, idx, r):
    """Shard `r` of checkpoint `path` (absolute; index `idx`, checked) and,
    for a delta checkpoint, shard `r` of its base, of the base's base and so
    on: [Shard, ...], each checked (Shard), each base carrying the id its
    delta recorded, the chain ending in a checkpoint that is not a delta
    and never returning to a checkpoint in it, and every lossy tensor's
    encoding fitting its base as loaded (_lossy.check)."""
    chain = [Shard(path, idx, r)]
    seen = {idx["id"]}
    while chain[-1].base is not None:
        top, base = chain[-1], chain[-1].base
        if not os.path.isdir(base):
            raise fail("ckpt.delta.base_missing", base, delta=top.path)
        base_idx = read_index(base)
        if base_idx["id"] != top.meta["delta"]["base_id"]:
            raise fail("ckpt.delta.base_id", top.path, base=base, want=top.meta["delta"]["base_id"][:64],
                       have=base_idx["id"])
        if base_idx["id"] in seen:
            raise fail("ckpt.delta.cycle", top.file, base=base)
        seen.add(base_idx["id"])
        if r >= base_idx["world_size"]:
            raise fail("ckpt.delta.base_rank", top.path, rank=r, base=base, world=base_idx["world_size"])
        chain.append(Shard(base, base_idx, r))
    from ebbtide.checkpoint import lossy as _lossy
    for k in range(len(chain) - 2, -1, -1):  # bases first: a delta decodes against its base as loaded
        chain[k].decoded = _lossy.check(chain[k].state, chain[k + 1].decoded, chain[k].file)
    return chain
