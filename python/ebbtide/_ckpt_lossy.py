"""Lossy delta compression of checkpoints in the style of ExCP (Li et al.,
2024, "ExCP: Extreme LLM Checkpoint Compression via Weight-Momentum Joint
Shrinking"); see docs/checkpoints.md.

For each floating-point weight W with a tensor of the same path and shape in
the base checkpoint B (the base as *loaded*, so errors do not accumulate):
  1. residual r = W - B;
  2. joint pruning: with its Adam second moment v, an element's score is
     |r| * sqrt(v) (ExCP's threshold alpha / sqrt(v) * median|W| rearranged),
     else |r|; the `density` fraction with the highest scores is kept;
  3. the Adam moments of that weight are pruned with the same mask plus
     ExCP's own rule |m| > beta * mean|m| for the first moment;
  4. what remains is quantised non-uniformly: a codebook of 2**bits centres
     started at quantiles and refined by a few k-means (Lloyd) steps; codes
     are stored as uint8, the mask as packed bits.
Everything else (ints, small tensors, tensors without a base) is stored
losslessly. The error of each lossy tensor against the exact value is
measured after encoding: max abs and relative L2, per tensor and overall.
"""
import dataclasses

import torch

from ebbtide import _ckpt_tree as tree
from ebbtide._ckpt_checks import fail


@dataclasses.dataclass
class LossyOptions:
    density: float = 0.2     # fraction of weight residuals kept
    beta: float = 0.5        # first-moment pruning: keep |m| > beta * mean|m|
    bits: int = 4            # codebook size 2**bits
    kmeans_iters: int = 6
    min_numel: int = 4096    # smaller tensors are stored losslessly


def _opts(lossy):
    if lossy is None:
        return LossyOptions()
    if isinstance(lossy, LossyOptions):
        return lossy
    if isinstance(lossy, dict):
        return LossyOptions(**lossy)
    raise TypeError(f"lossy= must be a dict or LossyOptions, not {type(lossy).__name__}")


def _quantise(values, bits, iters):
    """values: 1-D float32 -> (codes uint8, codebook float32)."""
    k = 1 << bits
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(k, dtype=torch.float32)
    q = torch.linspace(0.5 / k, 1 - 0.5 / k, k)
    sample = values if values.numel() <= 1 << 20 else values[torch.randint(values.numel(), (1 << 20,))]
    centres = torch.quantile(sample, q).contiguous()
    for _ in range(iters):
        centres, _ = torch.sort(centres)
        bounds = (centres[1:] + centres[:-1]) / 2
        idx = torch.bucketize(values, bounds)
        sums = torch.zeros(k).index_add_(0, idx, values)
        counts = torch.zeros(k).index_add_(0, idx, torch.ones_like(values))
        centres = torch.where(counts > 0, sums / counts.clamp(min=1), centres)
    centres, _ = torch.sort(centres)
    idx = torch.bucketize(values, (centres[1:] + centres[:-1]) / 2)
    return idx.to(torch.uint8), centres.float()


def _pack_mask(mask):
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, torch.zeros(pad, dtype=torch.uint8)])
    w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (flat.view(-1, 8) * w).sum(1, dtype=torch.uint8) if flat.numel() else flat


def _unpack_mask(packed, numel):
    w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    bits = (packed.view(-1, 1) & w).ne(0).view(-1)
    return bits[:numel]


def _encode_tensor(x, mask, o, mode):
    vals = x.reshape(-1)[mask.reshape(-1)].float()
    codes, book = _quantise(vals, o.bits, o.kmeans_iters)
    n = codes.numel()
    if o.bits <= 4:  # two codes per byte
        if n % 2:
            codes = torch.cat([codes, torch.zeros(1, dtype=torch.uint8)])
        codes = codes[0::2] | (codes[1::2] << 4)
    return {"__excp__": {"mode": mode, "dtype": tree.dtype_name(x.dtype), "shape": list(x.shape),
                         "mask": _pack_mask(mask), "codes": codes, "codebook": book, "count": n,
                         "bits": o.bits}}


def _codes(enc):
    codes = enc["codes"]
    if enc["bits"] <= 4:
        codes = torch.stack([codes & 15, codes >> 4], 1).reshape(-1)[:enc["count"]]
    return codes


def _decode_values(enc, numel):
    mask = _unpack_mask(enc["mask"], numel)
    out = torch.zeros(numel, dtype=torch.float32, device=enc["codebook"].device)
    out[mask.to(out.device)] = enc["codebook"][_codes(enc).long().to(out.device)]
    return out


def _find_moments(flat):
    """Pairs weights with Adam moments: torch optimizer state dicts ({'state':
    {i: {'exp_avg', 'exp_avg_sq'}}, 'param_groups': [{'params': [...]}]}) are
    matched to the other floating tensors of the state in order (distinct
    storages), when counts and shapes agree."""
    opt_prefix = None
    for p, _ in flat:
        if p.endswith(".exp_avg_sq"):
            opt_prefix = p.split(".state[")[0]
            break
    if opt_prefix is None:
        return {}
    moments = {}
    for p, t in flat:
        if p.startswith(opt_prefix + ".state[") and (p.endswith(".exp_avg") or p.endswith(".exp_avg_sq")):
            i = int(p[len(opt_prefix) + 7:].split("]")[0])
            moments.setdefault(i, {})["m" if p.endswith(".exp_avg") else "v"] = p
    weights, seen = [], set()
    for p, t in flat:
        if p.startswith(opt_prefix) or not t.is_floating_point():
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        weights.append((p, t))
    ids = sorted(moments)
    tensors = dict(flat)
    if len(ids) != len(weights):
        return {}
    pairs = {}
    for (wp, w), i in zip(weights, ids):
        mv = moments[i]
        if "m" not in mv or "v" not in mv or tuple(tensors[mv["v"]].shape) != tuple(w.shape):
            return {}
        pairs[wp] = (mv["m"], mv["v"])
    return pairs


def encode(state, base_state, lossy):
    """Returns (encoded state, error report)."""
    o = _opts(lossy)
    flat = list(tree.walk_tensors(state))
    base = dict(tree.walk_tensors(base_state))
    tensors = dict(flat)
    pairs = _find_moments(flat)
    replace, report = {}, {}
    sq_err = sq_ref = 0.0
    max_abs = 0.0

    def account(path, exact, approx):
        nonlocal sq_err, sq_ref, max_abs
        d = (approx - exact.float()).abs()
        e2 = float(d.pow(2).sum())
        r2 = float(exact.float().pow(2).sum())
        ma = float(d.max()) if d.numel() else 0.0
        report[path] = {"max_abs": ma, "rel_l2": (e2 ** 0.5) / (r2 ** 0.5) if r2 > 0 else (0.0 if e2 == 0 else 1.0)}
        sq_err += e2
        sq_ref += r2
        max_abs = max(max_abs, ma)

    moment_paths = {p for mv in pairs.values() for p in mv}
    for path, w in flat:
        if path in moment_paths or path in replace:
            continue
        b = base.get(path)
        if (not w.is_floating_point() or w.numel() < o.min_numel or b is None or tuple(b.shape) != tuple(w.shape)
                or not b.is_floating_point()):
            continue
        wf = w.detach().float().cpu()
        r = wf - b.float().cpu()
        mv = pairs.get(path)
        score = r.abs()
        if mv is not None:
            score = score * tensors[mv[1]].detach().float().cpu().sqrt()
        k = max(1, int(o.density * r.numel()))
        thresh = torch.topk(score.reshape(-1), k, sorted=False).values.min()
        mask = score >= thresh
        enc = _encode_tensor(r, mask, o, "delta")
        replace[path] = enc
        approx = b.float().cpu().reshape(-1) + _decode_values(enc["__excp__"], r.numel())
        account(path, wf.reshape(-1), approx.to(w.dtype).float())
        if mv is not None:
            m = tensors[mv[0]].detach().float().cpu()
            mmask = mask & (m.abs() > o.beta * m.abs().mean())
            for mp, mt in ((mv[0], m), (mv[1], tensors[mv[1]].detach().float().cpu())):
                enc = _encode_tensor(mt, mmask, o, "direct")
                replace[mp] = enc
                account(mp, mt.reshape(-1), _decode_values(enc["__excp__"], mt.numel()))
    overall = {"max_abs": max_abs, "rel_l2": (sq_err ** 0.5) / (sq_ref ** 0.5) if sq_ref > 0 else 0.0,
               "tensors": len(report)}
    return _substitute(state, replace, "state"), {"overall": overall, "tensors": report}


_DESCEND = object()


def _map_tree(obj, path, leaf):
    """Rebuilds nested dicts, lists and tuples; `leaf(obj, path)` returns the
    replacement of a node, or _DESCEND to recurse into a container as usual."""
    out = leaf(obj, path)
    if out is not _DESCEND:
        return out
    if isinstance(obj, dict):
        out = {k: _map_tree(v, tree._join(path, k), leaf) for k, v in obj.items()}
        return type(obj)(out) if type(obj) is not dict else out
    if isinstance(obj, list):
        return [_map_tree(v, f"{path}[{i}]", leaf) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_map_tree(v, f"{path}[{i}]", leaf) for i, v in enumerate(obj))
    return obj


def _substitute(obj, replace, path):
    return _map_tree(obj, path, lambda o, p: replace.get(p, o)
                     if isinstance(o, torch.Tensor) else _DESCEND)


def decode(state, base_state, where=""):
    """The state of a delta checkpoint (its lossy tensors still encoded, as
    check() passed them) with each lossy tensor decoded against `base_state`,
    the base as loaded. Codes and masks that do not fit (data) raise
    ValueError naming `where`."""
    base = dict(tree.walk_tensors(base_state))
    return _map_tree(state, "state", lambda o, p: _decode_leaf(o, base, p, where))


def _is_encoded(obj):
    return isinstance(obj, dict) and set(obj) == {"__excp__"}


def _decode_leaf(obj, base, path, where):
    if not _is_encoded(obj):
        return _DESCEND
    e = obj["__excp__"]
    vals = decode_values(e, path, where)
    if e["mode"] == "delta":
        vals = base[path].float().reshape(-1).to(vals.device) + vals
    return vals.reshape(e["shape"]).to(tree.dtype_from_name(e["dtype"], where))


def decode_values(e, path, where):
    """The values of encoded tensor `e` (at `path`, its layout checked by
    check()): ValueError naming `where` when its data do not fit (the mask
    keeps another number of values than `count`, a code lies past the
    codebook), found before indexing with them (on a GPU an index out of
    range is a device-side assert, not an error)."""
    numel = 1
    for s in e["shape"]:
        numel *= s
    kept = int(_unpack_mask(e["mask"], numel).sum())
    if kept != e["count"]:
        raise fail("ckpt.delta.values", where, path=path, error=f"its mask keeps {kept} values, its count is "
                                                               f"{e['count']}")
    codes = _codes(e)
    top = int(codes.max()) if codes.numel() else 0
    if top >= e["codebook"].numel():
        raise fail("ckpt.delta.values", where, path=path, error=f"code {top} lies past its codebook of "
                                                               f"{e['codebook'].numel()}")
    return _decode_values(e, numel)


def encoded_tensors(state):
    """(path, encoding) of every lossy tensor of a state built from a delta
    checkpoint's tree."""
    out = []

    def leaf(o, p):
        if _is_encoded(o):
            out.append((p, o["__excp__"]))
            return o
        return _DESCEND
    _map_tree(state, "state", leaf)
    return out


# Note [Lossy tensor layout]
# An encoded tensor holds its dtype, shape and mode ("delta" adds the base's
# tensor at its path, "direct" stands alone), `bits` (codebook of 2**bits
# float32 centres), `count` kept values, `mask` (uint8, one bit per element,
# ceil(numel / 8) bytes) and `codes` (uint8, two 4-bit codes per byte when
# bits <= 4: ceil(count / 2) bytes; else one per byte). check() holds an
# encoding to that from the metadata alone (the tensors are stand-ins then);
# what only the data can tell (the mask has `count` bits set, every code
# indexes the codebook) decode_values finds while decoding.
def check(state, base_state, where):
    """Checks every lossy tensor of `state`, a delta checkpoint's state built
    on the meta device (Note [Lossy tensor layout]), against `base_state`,
    its base as it decodes. Returns the state as it decodes: a meta tensor of
    each encoded tensor's dtype and shape in its place. ValueError naming
    `where` and the tensor."""
    base = dict(tree.walk_tensors(base_state))

    def leaf(o, p):
        if not _is_encoded(o):
            return _DESCEND
        dtype, shape = _check_encoding(o["__excp__"], base, p, where)
        return torch.empty(shape, dtype=dtype, device="meta")
    return _map_tree(state, "state", leaf)


def _check_encoding(e, base, path, where):
    def bad(what):
        return fail("ckpt.delta.tensor", where, path=path, what=what)
    keys = {"mode", "dtype", "shape", "mask", "codes", "codebook", "count", "bits"}
    if not isinstance(e, dict) or not keys <= set(e):
        raise bad(f"needs {', '.join(sorted(keys))}")
    if not isinstance(e["mode"], str) or e["mode"] not in ("delta", "direct"):
        raise bad(f"mode {str(e['mode'])[:40]!r} is not delta or direct")
    shape = e["shape"]
    if (not isinstance(shape, list) or len(shape) > 64
            or not all(type(n) is int and 0 <= n <= 1 << 62 for n in shape)):
        raise bad(f"shape {str(shape)[:80]} is not a list of sizes")
    numel = 1
    for n in shape:
        numel *= n
    if numel > 1 << 62:
        raise bad(f"shape {shape} has more than 2^62 elements")
    dtype = tree.dtype_from_name(e["dtype"], where) if isinstance(e["dtype"], str) else None
    if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
        raise bad(f"dtype {str(e['dtype'])[:40]!r} is not a floating dtype")
    bits, count = e["bits"], e["count"]
    if type(bits) is not int or not 0 <= bits <= 16:
        raise bad(f"bits {str(bits)[:40]!r} is not an integer in [0, 16]")
    if type(count) is not int or not 0 <= count <= numel:
        raise bad(f"count {str(count)[:40]!r} is not an integer in [0, {numel}]")
    want = {"mask": (torch.uint8, (numel + 7) // 8), "codes": (torch.uint8, (count + 1) // 2 if bits <= 4 else count),
            "codebook": (torch.float32, 1 << bits)}
    for k, (dt, n) in want.items():
        t = e[k]
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != dt or t.dim() != 1 or \
                t.numel() != n:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise bad(f"{k} is {got}, not {str(dt).replace('torch.', '')} [{n}]")
    if e["mode"] == "delta":
        b = base.get(path)
        if b is None or list(b.shape) != shape:
            raise fail("ckpt.delta.base_tensor", where, path=path, shape=shape)
    return dtype, shape
