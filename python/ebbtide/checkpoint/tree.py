"""State dict <-> (JSON tree, tensor table, storage table) for ebbtide checkpoints.

Only data is stored: tensors, numbers, strings, bools, None, lists, tuples,
dicts (and OrderedDicts), torch.dtype and torch.device values. Loading builds
these back from JSON and raw bytes; no code is executed (no pickle).
See docs/checkpoint-format.md for the tree encoding.
"""
import collections
import math

import torch

from ebbtide.checkpoint.checks import fail

_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "complex128": torch.complex128, "complex64": torch.complex64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
              "uint16", "uint32", "uint64", "complex32"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_FLOAT_CODEC = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def dtype_name(dtype):
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by ebbtide checkpoints") from None


def dtype_from_name(name, where=""):
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise fail("dtype.unknown", where, name=name) from None


def core_stream(device):
    """The current CUDA stream of `device` as the core takes it (0 for the
    CPU): device copies of a save or load are ordered on it."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def codec_for(dtype, compress):
    """Lossless codec name for a storage whose elements are `dtype`."""
    if not compress:
        return "none"
    if dtype in _FLOAT_CODEC:
        return "float-zstd"
    if dtype.is_complex:
        return "shuffle-zstd"
    return "shuffle-zstd" if dtype.itemsize > 1 else "zstd"


class Flattener:
    """Walks a state dict; collects tensors and storages (each storage once)."""

    def __init__(self, compress):
        self.compress = compress
        self.tensors = []        # JSON entries
        self.storages = []       # JSON entries
        self.blobs = []          # (name, tensor-of-storage (kept alive), nbytes, device, elem, codec)
        self._storage_ids = {}   # (device, data_ptr) -> storage index
        self._keepalive = []
        self.versions = []       # (tensor, _version at flattening, path): Note [Background snapshot]

    def tree(self, obj, path="state"):
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return obj
        if isinstance(obj, float):
            if math.isfinite(obj):
                return obj
            return {"float": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return {"tensor": self.tensor(obj, path)}
        if isinstance(obj, collections.OrderedDict):
            return {"odict": [[self.tree(k, f"{path}<key>"), self.tree(v, _join(path, k))] for k, v in obj.items()]}
        if isinstance(obj, dict):
            return {"dict": [[self.tree(k, f"{path}<key>"), self.tree(v, _join(path, k))] for k, v in obj.items()]}
        if isinstance(obj, list):
            return {"list": [self.tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return {"tuple": [self.tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, torch.dtype):
            return {"dtype": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        if isinstance(obj, torch.Size):
            return {"tuple": list(obj)}
        raise TypeError(f"checkpoint: {path}: object of type {type(obj).__module__}.{type(obj).__qualname__} "
                        "cannot be saved (supported: tensors, numbers, strings, bools, None, lists, "
                        "tuples, dicts, torch.dtype, torch.device); nothing was written")

    def tensor(self, t, path):
        if t.layout == torch.sparse_coo:
            t = t.coalesce()
            entry = {"layout": "sparse_coo", "shape": list(t.shape), "path": path,
                     "indices": self.tensor(t.indices(), path + ".indices"),
                     "values": self.tensor(t.values(), path + ".values")}
            self.tensors.append(entry)
            return len(self.tensors) - 1
        if t.layout != torch.strided:
            raise TypeError(f"checkpoint: {path}: tensor layout {t.layout} is not supported "
                            "(strided and sparse_coo are); nothing was written")
        if t.is_quantized or t.device.type == "meta":
            raise TypeError(f"checkpoint: {path}: {'quantized' if t.is_quantized else 'meta'} tensors "
                            "cannot be saved; nothing was written")
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        param = isinstance(t, torch.nn.Parameter)
        requires_grad = bool(t.requires_grad)
        t = t.detach()  # shares the version counter of the caller's tensor
        self.versions.append((t, t._version, path))
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr()) if st.nbytes() else None
        sid = self._storage_ids.get(key) if key else None
        if sid is None:
            sid = len(self.storages)
            if key:
                self._storage_ids[key] = sid
            self.storages.append({"nbytes": st.nbytes(), "device": str(t.device), "blob": len(self.blobs),
                                  "dtype": dtype_name(t.dtype)})
            codec = codec_for(t.dtype, self.compress)
            self.blobs.append([path, st, st.nbytes(), t.device, max(1, t.element_size()), codec])
            self._keepalive.append(t)
        else:
            s = self.storages[sid]
            if s["dtype"] != dtype_name(t.dtype):  # mixed views: no byte grouping
                self.blobs[s["blob"]][4] = 1
                self.blobs[s["blob"]][5] = "zstd" if self.compress else "none"
        entry = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "stride": list(t.stride()),
                 "offset": t.storage_offset(), "storage": sid, "path": path}
        if param:
            entry["parameter"] = True
            entry["requires_grad"] = requires_grad
        self.tensors.append(entry)
        return len(self.tensors) - 1


def _join(path, key):
    return f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]"


# Containers nested deeper than this are refused, whatever the caller's stack
# depth (a limit set by Python's recursion limit would depend on it, and a
# load called deep in a program could refuse a tree inspect accepted).
MAX_TREE_DEPTH = 100


def build(node, tensors, where=""):
    """JSON tree -> Python objects; `tensors` is the list of rebuilt tensors
    (stand-ins on the meta device when the tree is validated). The tree is
    untrusted: a node of the wrong shape, a tensor index that is not one of
    `tensors` (negative, a bool, out of range), an unknown dtype, an
    unhashable key or containers nested more than MAX_TREE_DEPTH deep raise
    ValueError naming `where` (Note [One validator] in checks.py)."""
    return _build(node, tensors, where, 0)


def _build(node, tensors, where, depth):
    if node is None or isinstance(node, (bool, str)) or type(node) in (int, float):
        return node
    if depth >= MAX_TREE_DEPTH:
        raise fail("ckpt.tree.depth", where, limit=MAX_TREE_DEPTH)
    depth += 1
    if isinstance(node, dict) and len(node) == 1:
        (kind, v), = node.items()
        if kind == "tensor":
            if type(v) is int and 0 <= v < len(tensors):
                return tensors[v]
            raise fail("ckpt.tree.tensor", where, ref=str(v)[:40], n=len(tensors))
        if kind in ("dict", "odict") and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
            items = [(_key(_build(k, tensors, where, depth), where), _build(x, tensors, where, depth)) for k, x in v]
            return dict(items) if kind == "dict" else collections.OrderedDict(items)
        if kind == "list" and isinstance(v, list):
            return [_build(x, tensors, where, depth) for x in v]
        if kind == "tuple" and isinstance(v, list):
            return tuple(_build(x, tensors, where, depth) for x in v)
        if kind == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if kind == "dtype" and isinstance(v, str):
            return dtype_from_name(v, where)
        if kind == "device" and isinstance(v, str):
            try:
                return torch.device(v)
            except (RuntimeError, ValueError):
                pass
    raise fail("ckpt.tree.node", where, node=str(node)[:80])


def _key(k, where):
    k = _hashable(k)
    try:
        hash(k)
    except TypeError:
        raise fail("ckpt.tree.key", where, type=type(k).__name__) from None
    return k


def _hashable(k):
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def walk_tensors(obj, path="state"):
    """Yields (path, tensor) for every tensor in a nested structure, using the
    same path spelling as Flattener."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk_tensors(v, _join(path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from walk_tensors(v, f"{path}[{i}]")


def view_tensors(file, meta, storages, in_place=None, dests=None):
    """The shard's tensors (checked metadata `meta`) as views of `storages`,
    one uint8 tensor per storage: its bytes when loading, a stand-in on the
    meta device when validating (Note [One validator]), so both build them
    with this same code. Storages in `in_place` were read into `dests` (by
    checkpoint path) and those tensors are returned. Sparse tensors' indices
    are checked against their shape when they hold data."""
    tensors = []
    for t in meta["tensors"]:
        if t.get("layout") == "sparse_coo":
            indices, values = tensors[t["indices"]], tensors[t["values"]]
            stand_in = indices.is_meta
            try:  # indices out of the shape would make later kernels write out of bounds
                tensors.append(torch.sparse_coo_tensor(indices, values, t["shape"], check_invariants=not stand_in))
            except (RuntimeError, TypeError, ValueError, IndexError) as e:
                raise fail("ckpt.sparse.layout" if stand_in else "ckpt.sparse.indices", file, path=t["path"][:80],
                           error=e) from None
            continue
        if in_place and t["storage"] in in_place:
            tensors.append(dests[t["path"]])
            continue
        dtype = dtype_from_name(t["dtype"], file)
        st = storages[t["storage"]]
        if st.is_meta:  # a stand-in: its layout is all there is (and cheaper to make than a view)
            x = torch.empty_strided(t["shape"], t["stride"], dtype=dtype, device="meta")
        else:
            x = torch.empty(0, dtype=dtype, device=st.device)
            x.set_(st.untyped_storage(), t["offset"], t["shape"], t["stride"])
        if t.get("parameter"):
            try:
                x = torch.nn.Parameter(x, requires_grad=t.get("requires_grad", True))
            except RuntimeError as e:  # requires_grad on an integer tensor
                raise fail("ckpt.tensor.requires_grad", file, path=t["path"][:80], error=e) from None
        tensors.append(x)
    return tensors
