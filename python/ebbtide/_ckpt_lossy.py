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


def _decode_values(enc, numel):
    mask = _unpack_mask(enc["mask"], numel)
    out = torch.zeros(numel, dtype=torch.float32, device=enc["codebook"].device)
    codes = enc["codes"]
    if enc["bits"] <= 4:
        codes = torch.stack([codes & 15, codes >> 4], 1).reshape(-1)[:enc["count"]]
    out[mask.to(out.device)] = enc["codebook"][codes.long().to(out.device)]
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


def decode(state, base_state):
    base = dict(tree.walk_tensors(base_state))
    return _decode(state, base, "state")


def _decode(obj, base, path):
    return _map_tree(obj, path, lambda o, p: _decode_leaf(o, base, p))


def _decode_leaf(obj, base, path):
    if not (isinstance(obj, dict) and set(obj) == {"__excp__"}):
        return _DESCEND
    e = obj["__excp__"]
    shape = e["shape"]
    numel = 1
    for s in shape:
        numel *= s
    vals = _decode_values(e, numel)
    dtype = tree.dtype_from_name(e["dtype"], path)
    if e["mode"] == "delta":
        b = base.get(path)
        if b is None or list(b.shape) != shape:
            raise ValueError(f"checkpoint: {path}: delta-compressed tensor has no matching tensor in the base")
        vals = b.float().reshape(-1).to(vals.device) + vals
    return vals.reshape(shape).to(dtype)
