"""Lossy delta compression of checkpoints after ExCP (Li et al., 2024,
"ExCP: Extreme LLM Checkpoint Compression via Weight-Momentum Joint
Shrinking", arXiv 2406.11257); the method and where it differs from the
paper: docs/checkpoints.md, "Lossy delta checkpoints".

For each floating-point weight W (at least `min_numel` elements) with a
tensor of the same path and shape in the base B, the base *as loaded* (so
pruning and quantisation errors are carried into the next residual instead
of accumulating along the chain), and, when the state holds a torch Adam
state, its moments m and v:
  1. residual r = W - B;
  2. weight-to-momentum pruning: keep r where |r| * sqrt(v) is large (the
     paper's threshold alpha / sqrt(v) * median|W| on |r|, rearranged; the
     per-element v makes it the Fisher-weighted error 1/2 v r^2): the top
     `density` fraction, or with `alpha` set the paper's fixed threshold;
  3. momentum-to-weight pruning: m is kept only where r is kept and
     |m| > beta * mean|m| (the paper's rule; beta=0 keeps m on the whole
     weight mask); unkept m are 0;
  4. v is kept on m's mask; an unkept v is carried from the base (the paper
     zeroes it: on resume those elements then take steps of about lr /
     sqrt(1 - beta2) per unit gradient until v refills; see
     Note [Second moments are carried]);
  5. kept values are quantised non-uniformly: a 2**bits k-means codebook
     (quantile start, Lloyd steps) per tensor; v in the log domain, where
     its orders of magnitude are. Masks are bit-packed (m's and v's masks
     over the weight's kept positions only), codes one per byte, and the
     writer entropy-codes both with zstd.
Steps 1-5 run in the C++ core on the checkpoint writer's threads
(ebbtide._core.CkptWriter.excp_encode_many, Note [ExCP encoding] and
Note [ExCP batches] in cpp/src/ckpt/excp.cpp), which also measures the error of what decodes; this
module pairs weights with moments, lays the result out (Note [Lossy tensor
layout]) and decodes it on load. Everything else (ints, small tensors,
tensors without a base) is stored losslessly. The error of each lossy tensor
against the exact value: max abs and relative L2, per tensor and overall.
"""
import dataclasses

import torch

from ebbtide.checkpoint import tree
from ebbtide.checkpoint.checks import fail


# Note [Density that follows the update] in cpp/src/ckpt/excp.cpp: the
# default share of a residual's Fisher energy a link may drop.
TOLERANCE = 0.1


@dataclasses.dataclass
class LossyOptions:
    """Options of compress="delta" (docs/checkpoints.md, "Lossy delta
    checkpoints").

    Args:
        density: fraction of each weight's residuals kept (top by |r| sqrt(v));
            the floor when `tolerance` > 0.
        tolerance: keep more than `density` where the update needs it: the
            dropped residuals carry at most this fraction of the residual's
            Fisher energy, sum v r^2 (Note [Density that follows the update]
            in cpp/src/ckpt/excp.cpp); 0: the density alone.
        alpha: when set, the paper's fixed threshold instead of `density`
            and `tolerance`: keep |r| sqrt(v) > alpha * median|W| (the kept
            fraction then varies).
        beta: first moments are kept where the residual is and |m| > beta * mean|m|.
        bits: codebook of the weight residuals, 2**bits centres.
        bits_moments: codebook of the kept moments.
        v_unkept: "carry" (an unkept v keeps the base's value) or "zero" (the paper).
        kmeans_iters: Lloyd steps of each codebook.
        min_numel: smaller tensors are stored losslessly.
    """
    density: float = 0.1
    tolerance: float = TOLERANCE
    alpha: float = None
    beta: float = 0.0
    bits: int = 4
    bits_moments: int = 4
    v_unkept: str = "carry"
    kmeans_iters: int = 8
    min_numel: int = 4096


def _opts(lossy):
    if lossy is None:
        o = LossyOptions()
    elif isinstance(lossy, LossyOptions):
        o = lossy
    elif isinstance(lossy, dict):
        names = {f.name for f in dataclasses.fields(LossyOptions)}
        bad = sorted(set(lossy) - names)
        if bad:
            raise ValueError(f"lossy=: unknown option {bad[0]!r} (valid: {', '.join(sorted(names))})")
        o = LossyOptions(**lossy)
    else:
        raise TypeError(f"lossy= must be a dict or LossyOptions, not {type(lossy).__name__}")
    if not 0 < o.density <= 1:
        raise ValueError(f"lossy=: density {o.density!r} is not in (0, 1]")
    if not 0 <= o.tolerance < 1:
        raise ValueError(f"lossy=: tolerance {o.tolerance!r} is not in [0, 1)")
    if o.alpha is not None and not o.alpha >= 0:
        raise ValueError(f"lossy=: alpha {o.alpha!r} is not >= 0")
    if not o.beta >= 0:
        raise ValueError(f"lossy=: beta {o.beta!r} is not >= 0")
    for k in ("bits", "bits_moments"):
        if type(getattr(o, k)) is not int or not 1 <= getattr(o, k) <= 8:
            raise ValueError(f"lossy=: {k} {getattr(o, k)!r} is not an integer in [1, 8]")
    if o.v_unkept not in ("carry", "zero"):
        raise ValueError(f"lossy=: v_unkept {o.v_unkept!r} is not 'carry' or 'zero'")
    return o


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _unpack_mask(packed, n):
    return (packed.view(-1, 1) & _BIT_WEIGHTS).ne(0).view(-1)[:n]


def _entry(x, coded, bits, mode, ref=None, log=False):
    """The encoding of tensor `x` (Note [Lossy tensor layout]) from the
    core's result `coded`; with `ref`, the path of the weight whose kept
    positions its mask is over."""
    e = {"mode": mode, "dtype": tree.dtype_name(x.dtype), "shape": list(x.shape), "mask": coded["mask"],
         "codes": coded["codes"], "codebook": coded["codebook"], "count": int(coded["count"]), "bits": bits}
    if ref is not None:
        e["mask_ref"] = ref
    if log:
        e["log"] = True
    return {"__excp__": e}


def _kept(e, numel, encs):
    """The boolean mask of encoding `e` over its tensor's `numel` elements
    (an encoding with a mask_ref holds its mask over the ref's kept ones)."""
    if "mask_ref" not in e:
        return _unpack_mask(e["mask"], numel)
    ref = _unpack_mask(encs[e["mask_ref"]]["mask"], numel)
    full = torch.zeros(numel, dtype=torch.bool)
    full[ref] = _unpack_mask(e["mask"], int(encs[e["mask_ref"]]["count"]))
    return full


def _decode_dense(e, kept):
    book = e["codebook"].float()
    if e.get("log"):
        book = book.exp()
    out = torch.zeros(kept.numel(), dtype=torch.float32, device=book.device)
    out[kept.to(out.device)] = book[e["codes"].long().to(out.device)]
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
        if "m" not in mv or "v" not in mv or tuple(tensors[mv["v"]].shape) != tuple(w.shape) \
                or tuple(tensors[mv["m"]].shape) != tuple(w.shape):
            return {}
        pairs[wp] = (mv["m"], mv["v"])
    return pairs


def _fp32(t):
    """`t` as a contiguous float32 CPU tensor (itself when it is one)."""
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous()


# Bytes of float32 copies (of bf16/fp16 or device tensors) a batch of
# encodings may hold at once.
_BATCH_COPY_BYTES = 512 << 20


def encode(state, base_state, lossy, writer):
    """Returns (encoded state, error report); the encoding runs on
    `writer`'s threads (an ebbtide._core.CkptWriter)."""
    o = _opts(lossy)
    flat = list(tree.walk_tensors(state))
    base = dict(tree.walk_tensors(base_state))
    tensors = dict(flat)
    pairs = _find_moments(flat)
    replace, report, exact = {}, {}, {}

    def account(path, coded):
        r2, e2 = coded["sq_ref"], coded["sq_err"]
        report[path] = {"max_abs": coded["max_abs"], "sq_err": e2, "sq_ref": r2, "kept": coded["kept"]}

    def usable_base(path, t):
        b = base.get(path)
        return b is not None and tuple(b.shape) == tuple(t.shape) and b.is_floating_point()

    moment_paths = {p for mv in pairs.values() for p in mv}
    jobs, copied = [], 0

    def fp32(t):
        # fp32 copies of other dtypes are held until their batch is encoded: bounded.
        nonlocal copied
        x = _fp32(t)
        if x.data_ptr() != t.data_ptr():
            copied += x.numel() * 4
        return x

    def flush():
        # Whole weights side by side on the writer's threads (Note [ExCP batches]).
        results = writer.excp_encode_many(
            [j[-1] for j in jobs], density=o.density, tolerance=o.tolerance if o.alpha is None else 0.0,
            alpha=-1.0 if o.alpha is None else float(o.alpha), beta=o.beta, bits=o.bits,
            bits_moments=o.bits_moments, kmeans_iters=o.kmeans_iters)
        for (path, w, mv, carry, _keep, _args), coded in zip(jobs, results):
            replace[path] = _entry(w, coded["w"], o.bits, "delta")
            account(path, coded["w"])
            exact[path] = w
            if mv is None:
                continue
            replace[mv[0]] = _entry(tensors[mv[0]], coded["m"], o.bits_moments, "direct", ref=path)
            account(mv[0], coded["m"])
            # Note [Second moments are carried]
            # The paper zeroes an unkept v. On resume such an element's step is
            # m / sqrt(v) ~ (1 - b1) g / (sqrt(1 - b2) |g|): ~3x the learning rate
            # per unit gradient for b2 = 0.999 until v refills, against ~0.1-0.3x
            # for a trained element, on most of each tensor at once. The base's v
            # (one link old, b2^K of it still in the exact v) only misjudges the
            # step by the ratio of square roots, and costs no bits.
            replace[mv[1]] = _entry(tensors[mv[1]], coded["v"], o.bits_moments, "carry" if carry else "direct",
                                    ref=path, log=True)
            account(mv[1], coded["v"])
            exact[mv[0]], exact[mv[1]] = tensors[mv[0]], tensors[mv[1]]
        jobs.clear()

    for path, w in flat:
        if path in moment_paths:
            continue
        if not w.is_floating_point() or w.numel() < o.min_numel or not usable_base(path, w):
            continue
        wf, bw = fp32(w), fp32(base[path])
        mv = pairs.get(path)
        m = v = bv = None
        carry = False
        if mv is not None:
            m, v = fp32(tensors[mv[0]]), fp32(tensors[mv[1]])
            carry = o.v_unkept == "carry" and usable_base(mv[1], v)
            bv = fp32(base[mv[1]]) if carry else None
        keep = [x for x in (wf, bw, m, v, bv) if x is not None]
        jobs.append((path, w, mv, carry, keep,
                     (wf.data_ptr(), bw.data_ptr(), wf.numel(), m.data_ptr() if m is not None else 0,
                      v.data_ptr() if v is not None else 0, bv.data_ptr() if bv is not None else 0, carry)))
        if copied > _BATCH_COPY_BYTES:
            flush()
            copied = 0
    if jobs:
        flush()
    # The core measured each error in float32; a tensor stored in another
    # dtype decodes rounded to it, so its error is measured on what decodes.
    encs = {p: r["__excp__"] for p, r in replace.items()}
    for p, t in exact.items():
        if t.dtype != torch.float32:
            approx = _decode_leaf(replace[p], base, encs, p, "ebbtide.checkpoint.lossy").float().reshape(-1)
            d = (approx - t.detach().float().cpu().reshape(-1)).abs()
            report[p].update(max_abs=float(d.max()) if d.numel() else 0.0, sq_err=float(d.pow(2).sum()),
                             sq_ref=float(t.detach().float().pow(2).sum()))
    sq_err = sq_ref = max_abs = 0.0
    for r in report.values():
        e2, r2 = r.pop("sq_err"), r.pop("sq_ref")
        r["rel_l2"] = (e2 ** 0.5) / (r2 ** 0.5) if r2 > 0 else (0.0 if e2 == 0 else 1.0)
        sq_err, sq_ref, max_abs = sq_err + e2, sq_ref + r2, max(max_abs, r["max_abs"])
    overall = {"max_abs": max_abs, "rel_l2": (sq_err ** 0.5) / (sq_ref ** 0.5) if sq_ref > 0 else 0.0,
               "tensors": len(report)}
    small = {p: {"t": t} for p, t in flat if p not in replace and _packable(t, o)}
    _share_storage([r["__excp__"] for r in replace.values()] + list(small.values()))
    replace.update({p: d["t"] for p, d in small.items()})
    return _substitute(state, replace, "state"), {"overall": overall, "tensors": report}


def _packable(t, o):
    """A small dense CPU tensor stored exactly, but packed with the lossy
    tensors' data (norms, biases, optimizer step counters)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu"
            and t.numel() < o.min_numel and not t.is_quantized and not t.is_complex())


def _share_storage(groups):
    """Moves the masks, codes and codebooks of the encodings in `groups`, and
    the small tensors ({"t": tensor}), into views of one uint8 storage, so the
    writer stores them as one blob: one zstd stream and one aligned extent
    instead of one per tensor (Note [Lossy tensor layout]). Each view starts
    at a multiple of its element size."""
    pieces, size = [], 0
    for e in groups:
        for k in [k for k in ("codebook", "mask", "codes", "t") if k in e]:
            align = e[k].element_size()
            size = (size + align - 1) // align * align
            pieces.append((e, k, size))
            size += e[k].numel() * e[k].element_size()
    buf = torch.empty(size, dtype=torch.uint8)
    for e, k, off in pieces:
        t = e[k].detach().contiguous()
        n = t.numel() * t.element_size()
        buf[off:off + n] = t.reshape(-1).view(torch.uint8)
        e[k] = buf[off:off + n].view(t.dtype).view(t.shape)


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
    encs = dict(encoded_tensors(state))
    return _map_tree(state, "state", lambda o, p: _decode_leaf(o, base, encs, p, where))


def _is_encoded(obj):
    return isinstance(obj, dict) and set(obj) == {"__excp__"}


def _decode_leaf(obj, base, encs, path, where):
    if not _is_encoded(obj):
        return _DESCEND
    e = obj["__excp__"]
    kept, vals = _checked_values(e, encs, path, where)
    if e["mode"] == "delta":
        vals = base[path].float().reshape(-1).to(vals.device) + vals
    elif e["mode"] == "carry":
        vals = torch.where(kept.to(vals.device), vals, base[path].float().reshape(-1).to(vals.device))
    return vals.reshape(e["shape"]).to(tree.dtype_from_name(e["dtype"], where))


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _checked_values(e, encs, path, where):
    """(kept mask, dense values with 0 where not kept) of encoded tensor `e`
    at `path` (its layout checked by check()): ValueError naming `where` when
    its data do not fit (the mask keeps another number of values than
    `count`, a code lies past the codebook), found before indexing with them
    (on a GPU an index out of range is a device-side assert, not an error)."""
    numel = _numel(e["shape"])
    if "mask_ref" in e:
        ref = encs[e["mask_ref"]]
        ref_kept = int(_unpack_mask(ref["mask"], numel).sum())
        if ref_kept != ref["count"]:
            raise fail("ckpt.delta.values", where, path=path, error=f"the mask of {e['mask_ref']} keeps {ref_kept} "
                                                                   f"values, its count is {ref['count']}")
    kept = _kept(e, numel, encs)
    n = int(kept.sum())
    if n != e["count"]:
        raise fail("ckpt.delta.values", where, path=path, error=f"its mask keeps {n} values, its count is "
                                                               f"{e['count']}")
    codes = e["codes"]
    top = int(codes.max()) if codes.numel() else 0
    if top >= e["codebook"].numel():
        raise fail("ckpt.delta.values", where, path=path, error=f"code {top} lies past its codebook of "
                                                               f"{e['codebook'].numel()}")
    return kept, _decode_dense(e, kept)


def verify(state, where):
    """The data checks decode() makes, on every lossy tensor of `state` (a
    delta checkpoint's state, its lossy tensors encoded), without a base."""
    encs = dict(encoded_tensors(state))
    for p, e in encs.items():
        _checked_values(e, encs, p, where)


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
# An encoded tensor holds its dtype, shape and mode ("delta": the base's
# tensor at its path plus the decoded values; "direct": the decoded values,
# 0 where not kept; "carry": the decoded values where kept, the base's
# tensor elsewhere), `bits` (codebook of 2**bits float32 centres, sorted;
# with "log": true the centres are logarithms of the values), `count` kept
# values, `codes` (uint8, one per kept value, each < 2**bits: entropy coding
# is left to the writer's zstd, which codes bytes) and `mask` (uint8, one bit
# per element, ceil(numel / 8) bytes; with "mask_ref": PATH, one bit per
# value kept by the encoded tensor at PATH, which has the same shape, mode
# "delta" and no mask_ref of its own). check() holds an encoding to that from
# the metadata alone (the tensors are stand-ins then); what only the data can
# tell (the mask has `count` bits set, every code indexes the codebook)
# _checked_values finds while decoding.
def check(state, base_state, where):
    """Checks every lossy tensor of `state`, a delta checkpoint's state built
    on the meta device (Note [Lossy tensor layout]), against `base_state`,
    its base as it decodes. Returns the state as it decodes: a meta tensor of
    each encoded tensor's dtype and shape in its place. ValueError naming
    `where` and the tensor."""
    base = dict(tree.walk_tensors(base_state))
    encs = dict(encoded_tensors(state))

    def leaf(o, p):
        if not _is_encoded(o):
            return _DESCEND
        dtype, shape = _check_encoding(o["__excp__"], base, encs, p, where)
        return torch.empty(shape, dtype=dtype, device="meta")
    return _map_tree(state, "state", leaf)


def _check_shape(shape, bad):
    if (not isinstance(shape, list) or len(shape) > 64
            or not all(type(n) is int and 0 <= n <= 1 << 62 for n in shape)):
        raise bad(f"shape {str(shape)[:80]} is not a list of sizes")
    numel = _numel(shape)
    if numel > 1 << 62:
        raise bad(f"shape {shape} has more than 2^62 elements")
    return numel


def _check_encoding(e, base, encs, path, where):
    def bad(what):
        return fail("ckpt.delta.tensor", where, path=path, what=what)
    keys = {"mode", "dtype", "shape", "mask", "codes", "codebook", "count", "bits"}
    if not isinstance(e, dict) or not keys <= set(e):
        raise bad(f"needs {', '.join(sorted(keys))}")
    extra = set(e) - keys - {"mask_ref", "log"}
    if extra:
        raise bad(f"has unknown key {sorted(extra)[0][:40]!r}")
    if not isinstance(e["mode"], str) or e["mode"] not in ("delta", "direct", "carry"):
        raise bad(f"mode {str(e['mode'])[:40]!r} is not delta, direct or carry")
    shape = e["shape"]
    numel = _check_shape(shape, bad)
    dtype = tree.dtype_from_name(e["dtype"], where) if isinstance(e["dtype"], str) else None
    if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
        raise bad(f"dtype {str(e['dtype'])[:40]!r} is not a floating dtype")
    bits, count = e["bits"], e["count"]
    if type(bits) is not int or not 0 <= bits <= 8:
        raise bad(f"bits {str(bits)[:40]!r} is not an integer in [0, 8]")
    if "log" in e and e["log"] is not True:
        raise bad(f"log {str(e['log'])[:40]!r} is not true")
    mask_bits = numel
    if "mask_ref" in e:
        ref = encs.get(e["mask_ref"]) if isinstance(e["mask_ref"], str) else None
        if (not isinstance(ref, dict) or ref.get("mode") != "delta" or "mask_ref" in ref
                or ref.get("shape") != shape or type(ref.get("count")) is not int or not 0 <= ref["count"] <= numel):
            raise bad(f"mask_ref {str(e['mask_ref'])[:80]!r} is not a delta-encoded tensor of its shape")
        mask_bits = ref["count"]
    if type(count) is not int or not 0 <= count <= mask_bits:
        raise bad(f"count {str(count)[:40]!r} is not an integer in [0, {mask_bits}]")
    want = {"mask": (torch.uint8, (mask_bits + 7) // 8), "codes": (torch.uint8, count),
            "codebook": (torch.float32, 1 << bits)}
    for k, (dt, n) in want.items():
        t = e[k]
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != dt or t.dim() != 1 or \
                t.numel() != n:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise bad(f"{k} is {got}, not {str(dt).replace('torch.', '')} [{n}]")
    if e["mode"] in ("delta", "carry"):
        b = base.get(path)
        if b is None or list(b.shape) != shape:
            raise fail("ckpt.delta.base_tensor", where, path=path, shape=shape)
    return dtype, shape
