"""Validation of checkpoint files read from disk (docs/checkpoints.md,
"Threat model"). Everything here treats the checkpoint as hostile: a field of
the wrong type, a path leading out of the checkpoint directory, a tensor
reaching past its storage or a special file in place of a regular one raises
ValueError naming the file and what is wrong, before any tensor memory is
allocated. The binary shard tables are checked by the C++ reader (Note
[Hostile headers] in cpp/src/ckpt/format.cpp); this module checks the JSON
index and metadata against them.
"""
import errno
import os
import re
import stat

import torch

from ebbtide import _ckpt_tree as tree
from ebbtide import _core

# JSON numbers become Python ints of any size; torch and the C++ core take
# 64-bit ones. Sizes, strides and offsets above this are refused.
MAX_INT = 1 << 62
MAX_INDEX_BYTES = 64 << 20  # index.json and owner.json are small; a bigger one is not ours
MAX_DIMS = 64
ID = re.compile(r"[0-9a-f]{1,64}")  # a checkpoint id


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
            raise ValueError(f"{path}: {what} is a symbolic link; only regular files are read") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: {what} is not a regular file; only regular files are read")
        if st.st_size > limit:
            raise ValueError(f"{path}: {what} has {st.st_size} bytes, more than the {limit} a checkpoint writes")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            total += len(b)
            if total > limit:
                raise ValueError(f"{path}: {what} has more than {limit} bytes")
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_index(idx, ip, format_version):
    """Checks the fields of a parsed index.json (`ip` its path) that loading
    uses; ValueError naming the field, NotImplementedError for a newer
    format version."""
    def bad(what):
        return ValueError(f"{ip}: corrupt checkpoint index ({what})")
    if not isinstance(idx, dict) or idx.get("format") != "ebbtide-checkpoint":
        raise ValueError(f"{ip}: not an ebbtide checkpoint index")
    v = idx.get("format_version")
    if not is_int(v, 1, MAX_INT) or v > format_version:
        raise NotImplementedError(f"{ip}: checkpoint format version {v!r} is not supported by this ebbtide "
                                  f"(it reads versions 1 to {format_version}); upgrade ebbtide to load it")
    if not isinstance(idx.get("id"), str) or not ID.fullmatch(idx["id"]):
        raise bad(f"id {idx.get('id')!r} is not a hex string")
    world = idx.get("world_size")
    if not is_int(world, 1, 1 << 20):
        raise bad(f"world_size {world!r} is not a positive integer")
    shards = idx.get("shards")
    if not isinstance(shards, list) or len(shards) != world:
        raise bad(f"shards must be a list of {world} file names")
    for s in shards:
        check_member_name(s, ip, "shards entry")
    stripes = idx.get("stripes", [])
    if not isinstance(stripes, list) or not all(isinstance(s, str) for s in stripes) or len(stripes) > 255:
        raise bad("stripes must be a list of at most 255 directory paths")
    if not isinstance(idx.get("compress", "none"), str):
        raise bad("compress is not a string")
    if "delta" in idx:
        check_delta(idx["delta"], ip)
    return idx


def check_member_name(name, where, what):
    """`name` names a file inside the checkpoint directory: one plain path
    component (no '/', not '.' or '..', no NUL). The file itself is opened
    without following a symlink, so it cannot lead out of the directory."""
    if (not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", "..")
            or len(name) > 255):
        raise ValueError(f"{where}: corrupt checkpoint index ({what} {str(name)[:80]!r} is not a file name "
                         "inside the checkpoint directory)")
    return name


def check_delta(delta, where):
    if (not isinstance(delta, dict) or not isinstance(delta.get("base"), str) or not delta["base"]
            or "\0" in delta["base"] or not isinstance(delta.get("base_id"), str)):
        raise ValueError(f"{where}: corrupt delta entry {str(delta)[:80]!r} (needs base and base_id strings)")


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
            raise ValueError(f"{ip}: corrupt checkpoint index (stripes entry {str(sd)[:120]!r} is not an absolute "
                             f"path of a stripe directory of checkpoint {idx['id']})")
        out.append(os.path.join(sd, shard_name))
    return out


def check_meta(meta, blobs, file):
    """Checks a shard's metadata (parsed JSON) against its blob table (the C++
    reader's `blobs`): storages name existing blobs of their size, each blob
    one storage; every strided tensor lies inside its storage; sparse tensors
    refer to earlier strided ones; the tree only to existing tensors (checked
    while it is built). ValueError naming `file` and the entry."""
    def bad(what):
        return ValueError(f"{file}: corrupt checkpoint metadata ({what})")
    if not isinstance(meta, dict):
        raise bad("not a JSON object")
    storages, tensors = meta.get("storages"), meta.get("tensors")
    if not isinstance(storages, list) or not isinstance(tensors, list):
        raise bad("storages and tensors must be lists")
    if "tree" not in meta:
        raise bad("no object tree")
    if not isinstance(meta.get("id"), str):
        raise bad("id is not a string")
    if "delta" in meta:
        check_delta(meta["delta"], file)
    used = {}
    for i, s in enumerate(storages):
        if not isinstance(s, dict) or not is_int(s.get("nbytes")) or not isinstance(s.get("device"), str):
            raise bad(f"storage {i} needs an integer nbytes and a device string")
        try:
            dev = torch.device(s["device"])
        except (RuntimeError, ValueError, TypeError):
            raise bad(f"storage {i}: device {s['device'][:40]!r} is not a device name") from None
        if dev.type not in ("cpu", "cuda"):
            raise bad(f"storage {i}: device {s['device'][:40]!r} is not cpu or cuda")
        if s["nbytes"] == 0:
            continue
        b = s.get("blob")
        if not is_int(b, 0, len(blobs) - 1):
            raise bad(f"storage {i} names blob {b!r}; the shard has {len(blobs)}")
        if b in used:
            raise bad(f"storages {used[b]} and {i} both name blob {b}")
        used[b] = i
        if blobs[b]["nbytes"] != s["nbytes"]:
            raise bad(f"storage {i} of {blobs[b]['name']} has {blobs[b]['nbytes']} bytes in the shard, "
                      f"{s['nbytes']} in the metadata")
    for i, t in enumerate(tensors):
        if not isinstance(t, dict) or not isinstance(t.get("path"), str):
            raise bad(f"tensor {i} needs a path string")
        where = f"tensor {i} ({t['path'][:80]!r})"
        shape = t.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_int(n) for n in shape):
            raise bad(f"{where}: shape {str(shape)[:80]} is not a list of sizes")
        numel = 1
        for n in shape:
            numel *= n
        if numel > MAX_INT:
            raise bad(f"{where}: shape {shape} has more than 2^62 elements")
        layout = t.get("layout", "strided")
        if layout == "sparse_coo":
            for k in ("indices", "values"):
                j = t.get(k)
                if not is_int(j, 0, i - 1) or tensors[j].get("layout", "strided") != "strided":
                    raise bad(f"{where}: {k} {j!r} is not an earlier strided tensor")
            continue
        if layout != "strided":
            raise bad(f"{where}: layout {str(layout)[:40]!r} is not strided or sparse_coo")
        if not isinstance(t.get("dtype"), str):
            raise bad(f"{where}: dtype is not a string")
        dtype = tree.dtype_from_name(t["dtype"], file)
        stride, offset, sid = t.get("stride"), t.get("offset"), t.get("storage")
        if not isinstance(stride, list) or len(stride) != len(shape) or not all(is_int(x) for x in stride):
            raise bad(f"{where}: stride {str(stride)[:80]} does not match shape {shape}")
        if not is_int(offset):
            raise bad(f"{where}: offset {offset!r} is not a non-negative integer")
        if not is_int(sid, 0, len(storages) - 1):
            raise bad(f"{where}: storage {sid!r} out of range ({len(storages)} storages)")
        for k in ("parameter", "requires_grad"):
            if k in t and not isinstance(t[k], bool):
                raise bad(f"{where}: {k} is not a bool")
        if numel:
            end = (offset + sum((n - 1) * x for n, x in zip(shape, stride)) + 1) * dtype.itemsize
            if end > storages[sid]["nbytes"]:
                raise bad(f"{where}: shape {shape}, stride {stride} and offset {offset} reach byte {end} of "
                          f"storage {sid}, which has {storages[sid]['nbytes']} bytes")
