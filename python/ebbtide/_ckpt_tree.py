"""State dict <-> (JSON tree, tensor table, storage table) for ebbtide checkpoints.

Only data is stored: tensors, numbers, strings, bools, None, lists, tuples,
dicts (and OrderedDicts), torch.dtype and torch.device values. Loading builds
these back from JSON and raw bytes; no code is executed (no pickle).
See docs/checkpoint-format.md for the tree encoding.
"""
import collections
import math

import torch

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
    except KeyError:
        raise ValueError(f"{where}: dtype {name!r} is not known to this torch build") from None


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


def build(node, tensors):
    """JSON tree -> Python objects; `tensors` is the list of rebuilt tensors.
    The tree is untrusted: a node of the wrong shape, a tensor index that is
    not one of `tensors` (negative, a bool, out of range) or an unhashable
    key raises ValueError."""
    if node is None or isinstance(node, (bool, str)) or type(node) in (int, float):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (kind, v), = node.items()
        if kind == "tensor":
            if type(v) is int and 0 <= v < len(tensors):
                return tensors[v]
            raise ValueError(f"checkpoint: object tree refers to tensor {str(v)[:40]}; "
                             f"the checkpoint has {len(tensors)}")
        if kind in ("dict", "odict") and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
            items = [(_key(build(k, tensors)), build(x, tensors)) for k, x in v]
            return dict(items) if kind == "dict" else collections.OrderedDict(items)
        if kind == "list" and isinstance(v, list):
            return [build(x, tensors) for x in v]
        if kind == "tuple" and isinstance(v, list):
            return tuple(build(x, tensors) for x in v)
        if kind == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if kind == "dtype" and isinstance(v, str):
            return dtype_from_name(v, "checkpoint")
        if kind == "device" and isinstance(v, str):
            try:
                return torch.device(v)
            except (RuntimeError, ValueError):
                pass
    raise ValueError(f"checkpoint: corrupt object tree node {str(node)[:80]!r}")


def _key(k):
    k = _hashable(k)
    try:
        hash(k)
    except TypeError:
        raise ValueError(f"checkpoint: corrupt object tree: a key of type {type(k).__name__}") from None
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
