"""safetensors files with ebbtide's I/O (docs/checkpoints.md, "safetensors").

The C++ core (ebbtide._core.SafetensorsReader, safetensors_save) parses and
validates headers as hostile input and moves the bytes (O_DIRECT, io_uring);
this module maps dtypes, allocates the tensors and reads HF index files.
"""
import collections
import mmap
import os

import torch

from ebbtide.checkpoint import tree
from ebbtide.checkpoint import validate as check
from ebbtide import _core
from ebbtide.checkpoint.checks import fail, tag


INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
                     ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES = {v: k for k, v in _DTYPES.items()}

# Host tensors at least this large get memory of their own, placed so that
# O_DIRECT reads land in them in place (Note [Reading in place] in
# cpp/src/ckpt/safetensors_read.cpp); smaller ones are copied from staging.
_IN_PLACE_MIN_BYTES = 1 << 20
_BLOCK = 4096


def _dtype_name(t, name):
    try:
        return _NAMES[t.dtype]
    except KeyError:
        raise ValueError(f"safetensors: tensor {name!r} has dtype {t.dtype}, which the safetensors format "
                         "does not have") from None


def _torch_dtype(dt, file, name):
    """The torch dtype of tensor `name` of `file` (load() asks for each tensor
    it reads, inspect for every tensor)."""
    try:
        return _DTYPES[dt]
    except KeyError:
        raise fail("st.dtype", file, name=name[:120], dtype=dt) from None


def _device(device):
    d = torch.device("cpu" if device is None else device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"safetensors: device {str(device)!r} asked for, but torch sees no CUDA device")
    if d.type == "cuda" and d.index is None:  # "cuda" means the current device
        d = torch.device("cuda", torch.cuda.current_device())
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"safetensors: device {d} is not supported (cpu or cuda)")
    return d


def save(tensors, path, metadata=None):
    if not isinstance(tensors, dict):
        raise TypeError(f"save_safetensors: tensors must be a dict of name -> tensor, not {type(tensors).__name__}")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise TypeError("save_safetensors: metadata must be a dict of str -> str")
    entries, keep = [], []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"save_safetensors: tensor names must be strings, not {type(name).__name__}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_safetensors: {name!r} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise ValueError(f"save_safetensors: tensor {name!r} has layout {t.layout}; only dense tensors are saved")
        t = t.detach().resolve_conj().resolve_neg().contiguous()
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"save_safetensors: tensor {name!r} is on {t.device}; move it to the CPU or a CUDA device")
        keep.append(t)
        entries.append((name, _dtype_name(t, name), list(t.shape), t.data_ptr(), t.nbytes, t.device.type == "cuda",
                        tree.core_stream(t.device)))
    return _core.safetensors_save(os.fspath(path), entries, list(metadata.items()))


def _host_buffer(nbytes, file_offset, itemsize):
    """Memory for a tensor at `file_offset` of the file: (uint8 tensor, owns
    its blocks). Large ones get a mapping of their own, the tensor placed at
    the file offset's position in a 4 KiB block."""
    head = file_offset % _BLOCK
    if nbytes < _IN_PLACE_MIN_BYTES or head % itemsize:
        return torch.empty(nbytes, dtype=torch.uint8), False
    m = mmap.mmap(-1, (head + nbytes + _BLOCK - 1) // _BLOCK * _BLOCK,
                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=head), True  # keeps `m` alive


def _read(reader, device, names=None):
    """Reads the tensors of an open SafetensorsReader (those in `names`, or
    all) onto `device`; returns {name: tensor}."""
    file = reader.path
    out, targets = {}, []
    stream = tree.core_stream(device)
    for i, (name, dt, shape, offset, nbytes) in enumerate(reader.tensors):
        if names is not None and name not in names:
            continue
        dtype = _torch_dtype(dt, file, name)
        itemsize = dtype.itemsize
        if device.type == "cpu":
            buf, own = _host_buffer(nbytes, offset, itemsize)
        else:
            buf, own = torch.empty(nbytes, dtype=torch.uint8, device=device), False
        out[name] = buf.view(dtype).view(shape)
        if nbytes:
            targets.append((i, buf.data_ptr(), nbytes, device.type == "cuda", stream, own))
    reader.read(targets)
    return out


IncompatibleKeys = collections.namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def load(path, device=None, into=None, strict=True):
    if into is not None:
        if device is not None:
            raise ValueError("load_safetensors: give device or into, not both (with into, each tensor is read onto "
                             "its target's device)")
        return _load_into(path, into, strict)
    device = _device(device)
    out = {}
    for reader, names in _shards(path):
        out.update(_read(reader, device, names))
    return out


def _targets_of(into):
    """{name: tensor} to load into: a module's parameters and buffers
    (state_dict(keep_vars=True)) or a dict of tensors."""
    if isinstance(into, torch.nn.Module):
        into = into.state_dict(keep_vars=True)
    if not isinstance(into, dict):
        raise TypeError(f"load_safetensors: into must be a module or a dict of name -> tensor, not "
                        f"{type(into).__name__}")
    out = {}
    for name, t in into.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"load_safetensors: into[{name!r}] is a {type(t).__name__}, not a tensor")
        out[name] = t.detach()
    return out


def _files(path):
    """(index json path or None, [(file, names it is to give or None for
    all)]) of a file, an index json or a directory, the index checked."""
    kind, p = _resolve(path)
    if kind == "file":
        return None, [(p, None)]
    weight_map, _ = read_index(p)
    base = os.path.dirname(p)
    return p, [(os.path.join(base, fname), names) for fname, names in _by_file(weight_map).items()]


def _open(file, names, index):
    """The validator of one safetensors file (Note [One validator] in
    checks.py), for load() and inspect alike: its header checked in C++
    and, for a file of an index, its tensors exactly those mapped to it."""
    try:
        reader = _core.SafetensorsReader(file)
    except check.READER_ERRORS as e:
        raise tag(e, "st.file")
    if names is not None:
        _check_shard(reader, names, index)
    return reader


def _shards(path):
    """[(open SafetensorsReader, names it is to give or None for all)] of a
    file, an index json or a directory; every shard opened and checked."""
    index, files = _files(path)
    return [(_open(f, names, index), names) for f, names in files]


# Note [Loading into existing tensors]
# load_safetensors(path, into=model) reads each tensor of the file straight
# into the parameter or buffer of the same name (a model built on the CPU or
# a GPU, HF's from_config, a resume): no new memory, which on some VMs costs
# more than the read itself (docs/benchmarks.md), and no second copy through
# load_state_dict. Every name, dtype and shape is checked against the targets
# before the first byte is read, so a mismatch changes nothing. A target
# missing from the file is not missing when it shares its memory with one
# that is loaded (tied weights, which save_pretrained stores once).
def _load_into(path, into, strict):
    targets = _targets_of(into)
    shards = _shards(path)
    plan, loaded, unexpected = [], set(), []  # plan: (reader, [(tensor index, target, nbytes)]) per shard
    for reader, names in shards:
        file = reader.path
        items = []
        plan.append((reader, items))
        for i, (name, dt, shape, offset, nbytes) in enumerate(reader.tensors):
            if names is not None and name not in names:
                continue
            t = targets.get(name)
            if t is None:
                unexpected.append(name)
                continue
            dtype = _torch_dtype(dt, file, name)
            if t.dtype != dtype or list(t.shape) != list(shape):
                raise ValueError(f"{file}: tensor {name[:120]!r} is {dt} {list(shape)}, its target {t.dtype} "
                                 f"{list(t.shape)}; nothing was loaded")
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{file}: tensor {name[:120]!r}: its target is on {t.device} (materialize the "
                                 "model on the CPU or a CUDA device first, e.g. with to_empty()); nothing was loaded")
            loaded.add(name)
            items.append((i, t, nbytes))
    held = {}  # storage -> layouts loaded into it
    for n in loaded:
        t = targets[n]
        held.setdefault(t.untyped_storage().data_ptr(), set()).add((t.storage_offset(), t.dtype, tuple(t.shape),
                                                                   t.stride()))

    def tied(t):
        return t.numel() > 0 and (t.storage_offset(), t.dtype, tuple(t.shape), t.stride()) in \
            held.get(t.untyped_storage().data_ptr(), ())
    missing = [n for n, t in targets.items() if n not in loaded and not tied(t)]
    if strict and (missing or unexpected):
        what = []
        if missing:
            what.append(f"missing from the file: {', '.join(map(repr, missing[:5]))}"
                        + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        if unexpected:
            what.append(f"in the file but not in the targets: {', '.join(map(repr, unexpected[:5]))}"
                        + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
        raise ValueError(f"load_safetensors({os.fspath(path)!r}, into=...): {'; '.join(what)}; nothing was loaded "
                         "(strict=False loads the tensors both have)")
    with torch.no_grad():
        for reader, items in plan:
            reads, copies = [], []
            for i, t, nbytes in items:
                if not nbytes:
                    continue
                dst = t
                if not t.is_contiguous() or t.is_conj() or t.is_neg():
                    dst = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                    copies.append((t, dst))
                reads.append((i, dst.data_ptr(), nbytes, dst.device.type == "cuda", tree.core_stream(dst.device),
                              False))
            reader.read(reads)
            for t, dst in copies:
                t.copy_(dst)
            for _, t, _ in items:  # written behind autograd's back: as copy_ would, mark them changed
                if not t.is_inference():
                    torch.autograd.graph.increment_version(t)
    return IncompatibleKeys(missing, unexpected)


def _resolve(path):
    """("file", path) or ("index", path of the index json) for a file, an
    index json or a directory holding model.safetensors(.index.json)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        for name, kind in ((INDEX_NAME, "index"), (SINGLE_NAME, "file")):
            if os.path.lexists(os.path.join(p, name)):
                return kind, os.path.join(p, name)
        found = sorted(f for f in os.listdir(p) if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"))
        if len(found) == 1:
            return ("index" if found[0].endswith(".json") else "file"), os.path.join(p, found[0])
        raise fail("st.directory", p, index=INDEX_NAME, single=SINGLE_NAME,
                   found=f" (it holds {len(found)} safetensors files: name one)" if found else "")
    return ("index" if p.endswith(".json") else "file"), p


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"key {k[:120]!r} appears twice")
        d[k] = v
    return d


def read_index(ip):
    """Reads and checks an HF index json: {"weight_map": {tensor: file}}
    with every file a plain name in the index's directory. Returns
    (weight_map, metadata); ValueError naming the index and the entry."""
    raw = check.read_regular_file(ip, "safetensors index")
    try:
        idx = check.parse_json(raw, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:
        raise fail("st.index.json", ip, error=e) from None
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict):
        raise fail("st.index.weight_map", ip)
    for name, f in wm.items():
        if not isinstance(f, str) or not f or f in (".", "..") or "/" in f or "\\" in f or "\0" in f:
            raise fail("st.index.file", ip, name=name[:120], file=str(f)[:120])
    return wm, idx.get("metadata")


def _by_file(weight_map):
    files = {}
    for name, f in weight_map.items():
        files.setdefault(f, set()).add(name)
    return files


def _check_shard(reader, names, ip):
    """The shard holds exactly the tensors the index maps to it."""
    have = {t[0] for t in reader.tensors}
    missing = sorted(names - have)
    if missing:
        raise fail("st.shard.missing", reader.path, name=missing[0][:120], index=ip,
                   more=f", nor {len(missing) - 1} more" if len(missing) > 1 else "")
    extra = sorted(have - names)
    if extra:
        raise fail("st.shard.extra", reader.path, name=extra[0][:120], index=ip,
                   more=f", nor {len(extra) - 1} more" if len(extra) > 1 else "")


def inspect(path):
    """Describes a safetensors file, an index json or a directory holding one,
    checking it as load() does, with the same code (Note [One validator] in
    checks.py), without reading tensor data. Returns {"path", "index"
    (its path or None), "files": [{"file", "file_bytes", "metadata",
    "tensors": [{"name", "dtype", "shape", "nbytes"}]} or {"file", "error"}],
    "errors": [one line each]}."""
    index, files = _files(path)
    out = {"path": index or files[0][0], "index": index, "files": [], "errors": []}
    for f, names in files:
        try:
            r = _open(f, names, index)
        except check.READER_ERRORS as e:
            out["files"].append({"file": f, "error": str(e)})
            out["errors"].append(str(e))
            continue
        tensors = []
        for name, dt, shape, _offset, nbytes in r.tensors:
            tensors.append({"name": name, "dtype": dt, "shape": shape, "nbytes": nbytes})
            try:
                _torch_dtype(dt, f, name)
            except NotImplementedError as e:
                out["errors"].append(str(e))
        out["files"].append({"file": f, "file_bytes": r.file_bytes, "metadata": dict(r.metadata),
                             "tensors": tensors})
    return out


def looks_like_safetensors(path):
    """True for what `ebbtide ckpt inspect` should read as safetensors: a
    file, an index json, or a directory without an ebbtide index.json that
    holds safetensors files."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        return os.path.lexists(p)
    if os.path.lexists(os.path.join(p, "index.json")):
        return False
    try:
        return any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in os.listdir(p))
    except OSError:
        return False


def save_safetensors(tensors, path, metadata=None):
    """Writes a safetensors file (docs/checkpoints.md, "safetensors") with
    ebbtide's I/O: through pinned buffers, O_DIRECT where the filesystem
    allows it, to a temporary file renamed over `path` once durable.

    Args:
        tensors: dict of name -> dense tensor (CPU or CUDA; non-contiguous
            ones are copied first).
        path: the file to write (replaced atomically when it exists).
        metadata: optional dict of str -> str, stored as "__metadata__".

    Returns:
        {"file_bytes", "data_bytes", "backend"}.

    Raises:
        TypeError: tensors or metadata of the wrong type.
        ValueError: a dtype the format lacks, a reserved or repeated name.
        OSError: the file cannot be written (naming it).

    Example:
        checkpoint.save_safetensors(model.state_dict(), "model.safetensors", {"format": "pt"})
    """
    return save(tensors, path, metadata)


def load_safetensors(path, device=None, *, into=None, strict=True):
    """Reads a safetensors file, or a sharded HF checkpoint (a
    model.safetensors.index.json, or a directory holding it or
    model.safetensors), validating every header as hostile input.

    Args:
        path: a .safetensors file, an index json, or a directory.
        device: where the tensors go (default CPU); CUDA reads go straight
            to device memory by cuFile where it is usable (EBBTIDE_CUFILE),
            else through pinned staging buffers.
        into: a module (its parameters and buffers) or a dict of tensors to
            read into in place, by name, instead of new tensors (Note
            [Loading into existing tensors] in safetensors.py): no new
            memory, no load_state_dict copy; each tensor on its target's
            device.
        strict: with `into`, every target must be in the file and every
            tensor of the file must have a target (tied weights stored once
            count as loaded); else ValueError before anything is read.

    Returns:
        dict of name -> tensor; with `into`, (missing_keys, unexpected_keys)
        like Module.load_state_dict.

    Raises:
        ValueError: an invalid file or index, naming the file and the tensor;
            with `into`, a dtype or shape that differs from its target's, or
            (strict) names that do not match: nothing is loaded then.
        NotImplementedError: a dtype torch has no equivalent for (F4, F6).
        OSError: a missing or unreadable file.

    Example:
        state = checkpoint.load_safetensors("out/llama-tiny")   # save_pretrained's directory
        model.load_state_dict(state)
        checkpoint.load_safetensors("out/llama-tiny", into=model)  # the same, in place
    """
    return load(path, device, into, strict)
