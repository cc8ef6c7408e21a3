"""Mechanisms of the tensor cache on CPU (target cpu, and ssd where the storage
engine is built): dedup, views, forwarding, errors, statistics. The ssd
target's files, lifetime and the C++ hooks: test_cache_lifetime.py."""
import contextlib

import pytest
import torch
import torch.utils.checkpoint as cp

import ebbtide
from ebbtide import _core


def ssd_available():
    return _core.build_info.get("cache_ssd", False)


TARGETS = ["cpu", pytest.param("ssd", marks=pytest.mark.skipif(not ssd_available(),
                                                                 reason="storage engine not in this build"))]


@pytest.fixture(params=TARGETS)
def make_cache(request, tmp_path):
    caches = []

    def make(**kw):
        kw.setdefault("min_bytes", 0)
        c = ebbtide.TensorCache(target=request.param, path=str(tmp_path) if request.param == "ssd" else None, **kw)
        caches.append(c)
        return c

    make.target = request.param
    make.path = tmp_path
    yield make
    for c in caches:
        c.close()


class Block(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(torch.nn.functional.gelu(self.lin(x))) + x


class Net(torch.nn.Module):
    def __init__(self, layers=4, d=32, fail_at=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, 1)
        self.fail_at = fail_at

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if self.fail_at == i:
                raise ValueError("boom in block %d" % i)
            x = b(x)
        return self.head(x).pow(2).mean()


def grads_of(model, x=None):
    out = [p.grad.clone() for p in model.parameters()]
    if x is not None:
        out.append(x.grad.clone())
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def step(model, x, ctx=None, drain=None):
    """One step; `drain`: a cache whose stores finish before backward (no forwarding)."""
    model.zero_grad(set_to_none=True)
    if x.grad is not None:
        x.grad = None
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = model(x)
        if drain is not None:
            drain.drain()
        loss.backward()
    return loss.detach(), grads_of(model, x)


def fn_grads(fn, inputs, ctx=None, **bw):
    for t in inputs:
        t.grad = None
    with ctx if ctx is not None else contextlib.nullcontext():
        out = fn(*inputs)
        out.backward(**bw)
    return [t.grad.clone() for t in inputs]


# ---------------------------------------------------------------- the basics

def test_model_round_trip_reloads_and_releases(make_cache):
    torch.manual_seed(0)
    model = Net(layers=4)
    x = torch.randn(16, 32, requires_grad=True)
    ref = step(model, x)
    cache = make_cache(keep_last_modules=1)
    cache.attach(model)
    got = step(model, x, cache.step(), drain=cache)
    assert torch.equal(ref[0], got[0]) and same(ref[1], got[1])
    s = cache.stats()
    assert s["tensors_offloaded"] > 0
    assert s["tensors_reused"] == 1  # x, still alive here
    assert s["tensors_reloaded"] + s["tensors_reused"] == s["tensors_offloaded"] and s["tensors_forwarded"] == 0
    got = step(model, x, cache.step())  # no drain: some may be forwarded, same gradients
    assert same(ref[1], got[1])
    assert s["entries"] == 0 and s["store_bytes_held"] == 0
    plan = cache.plan()
    assert [p["decision"] for p in plan if p["scope"] >= 0][-1] == "keep"
    assert any(p["decision"] == "offload" for p in plan)


def test_forwarding_when_stores_have_not_run(make_cache):
    torch.manual_seed(0)
    model = Net(layers=3)
    x = torch.randn(8, 32, requires_grad=True)
    ref = step(model, x)
    cache = make_cache(keep_last_modules=0)
    cache.attach(model)
    cache._core.set_inline_copy_bytes(0)  # every store through the (paused) workers
    cache._core.pause_stores(True)
    got = step(model, x, cache.step())
    cache._core.pause_stores(False)
    cache.drain()
    assert torch.equal(ref[0], got[0]) and same(ref[1], got[1])
    s = cache.stats()
    assert s["tensors_forwarded"] > 0
    assert s["tensors_offloaded"] == 0 and s["bytes_offloaded"] == 0
    assert s["store_bytes_held"] == 0


def test_views_transposes_and_dedup(make_cache):
    cache = make_cache()
    a = torch.randn(6, 8, requires_grad=True)
    b = torch.randn(8, 6, requires_grad=True)

    def fn(a, b):
        h = a * 2  # one storage, saved as several views below
        v1 = h.t()            # transpose
        v2 = h[1:4, 2:]       # strided view with an offset
        v3 = h.view(-1)       # reshape view
        y = (v1 * b).sum() + (v2.exp() * v2).sum() + (v3 * v3).sum() + (h @ b).sum()
        return y

    ref = fn_grads(fn, [a, b])
    cache._core.pause_stores(False)
    with cache.step():
        h = None
        got_out = fn(a, b)
        cache.drain()  # every store done: backward must reload
        a.grad = b.grad = None
        got_out.backward()
    got = [a.grad.clone(), b.grad.clone()]
    assert same(ref, got)
    s = cache.stats()
    assert s["tensors_deduped"] > 0
    assert s["tensors_reloaded"] > 0
    assert s["tensors_saved"] == s["tensors_deduped"] + s["tensors_offloaded"] + s["tensors_kept"] \
        + s["tensors_forwarded"]


def test_tensor_saved_twice_is_stored_once(make_cache):
    cache = make_cache()
    x = torch.randn(64, 64, requires_grad=True)
    with cache.step():
        h = x.sin()
        y = h * h  # mul saves self and other: the same tensor twice
        cache.drain()
        y.sum().backward()
    s = cache.stats()
    assert s["tensors_deduped"] >= 1
    # sin saves x, mul saves h once after dedup.
    assert s["saved_bytes_total"] == 2 * 64 * 64 * 4
    assert torch.equal(x.grad, (2 * x.sin() * x.cos()).detach())


def test_unpack_keeps_dtype_shape_strides_offset(make_cache):
    cache = make_cache()
    seen = []
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            v = t.detach()[1:, ::2].t()
            ctx.save_for_backward(v)
            ctx.meta = (v.dtype, v.shape, v.stride(), v.storage_offset(), v.clone())
            return t * 1

        @staticmethod
        def backward(ctx, g):
            (v,) = ctx.saved_tensors
            seen.append((v.dtype, v.shape, v.stride(), v.storage_offset(), v.clone(), ctx.meta))
            return g

    with cache.step():
        y = Probe.apply(x * 3)
        cache.drain()
        y.sum().backward()
    dtype, shape, stride, off, val, meta = seen[0]
    assert (dtype, shape, stride, off) == meta[:4]
    assert torch.equal(val, meta[4])


def test_requires_grad_semantics_match_vanilla(make_cache):
    cache = make_cache()
    out = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            out.setdefault("rg", []).append((a.requires_grad, b.requires_grad, a.grad_fn is None))
            return g * b, g * a

    def go(ctx):
        a = torch.randn(10, requires_grad=True)
        b = torch.randn(10)
        with ctx:
            y = Probe.apply(a * 1, b)
            if hasattr(ctx, "__self__"):
                pass
            y.sum().backward()

    go(contextlib.nullcontext())
    go(cache.step())
    assert out["rg"][0] == out["rg"][1]


def test_retain_graph_then_second_backward(make_cache):
    torch.manual_seed(0)
    model = Net(layers=3)
    x = torch.randn(8, 32, requires_grad=True)
    model.zero_grad()
    loss = model(x)
    loss.backward(retain_graph=True)
    loss.backward()
    ref = grads_of(model, x)
    cache = make_cache(keep_last_modules=0)
    cache.attach(model)
    model.zero_grad()
    x.grad = None
    with cache.step():
        loss = model(x)
        cache.drain()
        loss.backward(retain_graph=True)
        loss.backward()
    assert same(ref, grads_of(model, x))
    assert cache.stats()["tensors_reloaded"] >= 2


def test_double_backward(make_cache):
    def fn(x):
        y = (x.tanh() * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return (g * g).sum()

    x = torch.randn(32, 32, requires_grad=True)
    ref = fn_grads(fn, [x])
    cache = make_cache()
    with cache.step():
        x.grad = None
        out = fn(x)
        out.backward()
    assert same(ref, [x.grad.clone()])


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing(make_cache, reentrant):
    torch.manual_seed(0)

    class CkptNet(Net):
        def forward(self, x):
            for b in self.blocks:
                x = cp.checkpoint(b, x, use_reentrant=reentrant)
            return self.head(x).pow(2).mean()

    model = CkptNet(layers=3)
    x = torch.randn(8, 32, requires_grad=True)
    ref = step(model, x)
    cache = make_cache(keep_last_modules=0)
    cache.attach(model)
    got = step(model, x, cache.step())
    assert torch.equal(ref[0], got[0]) and same(ref[1], got[1])
    assert cache.stats()["entries"] == 0


def test_inplace_change_after_store_is_reported(make_cache):
    cache = make_cache()
    x = torch.randn(100, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y = x.exp()  # vanilla first, for the same kind of error
        y.add_(1)
        y.sum().backward()
    with cache.step():
        y = x.exp()  # exp saves its result
        cache.drain()  # stored, live reference dropped
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_inplace_change_while_storing_is_reported(make_cache):
    cache = make_cache()
    x = torch.randn(100, requires_grad=True)
    with cache.step():
        cache._core.set_inline_copy_bytes(0)  # every store through the (paused) workers
        cache._core.pause_stores(True)
        y = x.exp()
        y.mul_(2)  # written before (or while) the store copies it
        cache._core.pause_stores(False)
        cache.drain()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_exception_mid_forward_leaves_nothing_and_next_step_works(make_cache):
    torch.manual_seed(0)
    model = Net(layers=4, fail_at=2)
    x = torch.randn(8, 32, requires_grad=True)
    cache = make_cache(keep_last_modules=1)
    cache.attach(model)
    with pytest.raises(ValueError, match="boom"):
        step(model, x, cache.step())
    s = cache._core.stats()
    assert s["entries"] == 0 and s["store_blobs"] == 0 and s["resident_bytes"] == 0
    if make_cache.target == "ssd":
        assert list(make_cache.path.iterdir()) == []
    model.fail_at = None
    ref = step(model, x)
    got = step(model, x, cache.step())
    assert same(ref[1], got[1])


def test_exception_mid_backward_releases_everything(make_cache):
    x = torch.randn(64, requires_grad=True)

    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 1

        @staticmethod
        def backward(ctx, g):
            raise ArithmeticError("boom in backward")

    cache = make_cache()
    with pytest.raises(ArithmeticError):
        with cache.step():
            y = Bad.apply(x.exp()).sin().sum()
            y.backward()
    s = cache._core.stats()
    assert s["entries"] == 0 and s["store_blobs"] == 0
    with cache.step():
        x.grad = None
        x.exp().sin().sum().backward()
    assert torch.allclose(x.grad, (x.exp().cos() * x.exp()).detach())


def test_microbatches_two_forwards_then_two_backwards(make_cache):
    torch.manual_seed(0)
    model = Net(layers=4)
    xs = [torch.randn(8, 32) for _ in range(2)]
    model.zero_grad()
    losses = [model(x) for x in xs]
    for loss in losses:
        loss.backward()
    ref = grads_of(model)
    model.zero_grad()
    cache = make_cache(keep_last_modules=1, prefetch_window_bytes=4096)
    cache.attach(model)
    with cache.step():
        losses = []
        for i, x in enumerate(xs):
            cache.microbatch(i)
            cache.phase("forward")
            losses.append(model(x))
        cache.drain()
        for i, loss in enumerate(losses):
            cache.microbatch(i)
            cache.phase("backward")
            loss.backward()
    assert same(ref, grads_of(model))
    s = cache.stats()
    assert s["tensors_reloaded"] > 0 and s["entries"] == 0


def test_stats_are_consistent(make_cache):
    torch.manual_seed(0)
    model = Net(layers=6, d=64)
    x = torch.randn(64, 64, requires_grad=True)
    cache = make_cache(keep_last_modules=1, min_bytes=1024)
    cache.attach(model)
    with cache.step():
        loss = model(x)
        cache.drain()  # every store finished: nothing is forwarded
        mid = cache.stats()
        loss.backward()
    s = cache.stats()
    plan = cache.plan()
    assert s["bytes_offloaded"] == sum(p["bytes_offloaded"] for p in plan)
    assert s["saved_bytes_total"] == sum(p["bytes"] for p in plan)
    # x (the model's input, alive in this frame) is answered from itself: the
    # one offloaded tensor that needs no reload, whatever the prefetch timing.
    assert s["tensors_reused"] == 1 and s["bytes_reused"] == x.numel() * x.element_size()
    assert s["bytes_reloaded"] + s["bytes_reused"] == s["bytes_offloaded"]
    assert s["tensors_reloaded"] + s["tensors_reused"] == s["tensors_offloaded"]
    assert s["tensors_forwarded"] == 0
    assert 0 < s["peak_resident_bytes"] <= s["saved_bytes_total"]
    kept = sum(p["bytes"] - p["bytes_offloaded"] for p in plan)
    assert mid["resident_bytes"] == kept
    assert s["stall_seconds"] >= 0
    assert s["total"]["bytes_offloaded"] == s["bytes_offloaded"] and s["steps"] == 1


@pytest.mark.parametrize("window", [1, None])
def test_original_still_alive_is_neither_prefetched_nor_reloaded(make_cache, window):
    # A saved tensor the caller still holds (here the input) never left
    # memory: unpack answers from it whether or not the prefetch window would
    # have reached it, and no load is spent on it.
    torch.manual_seed(0)
    model = Net(layers=4, d=64)
    x = torch.randn(64, 64, requires_grad=True)
    ref = step(model, x)
    cache = make_cache(keep_last_modules=0, min_bytes=1024, prefetch_window_bytes=window)
    cache.attach(model)
    got = step(model, x, cache.step(), drain=cache)
    assert same(ref[1], got[1])
    s = cache.stats()
    assert s["tensors_reused"] == 1 and s["bytes_reused"] == 64 * 64 * 4
    assert s["bytes_reloaded"] + s["bytes_reused"] == s["bytes_offloaded"]


def test_kept_blocks_count_in_the_prefetch_distance_on_cpu(make_cache):
    # Note [Prefetch distance] (tensor_cache_load.cpp): the bytes of the kept
    # tail count on the worker path too, so the last offloaded block (2) is
    # not reloaded while kept blocks 3..5 are still resident: not when the
    # backward of 5, 4 or 3 begins (the window is one block's bytes). Without
    # them in the distance block 2 was loading from the backward's start.
    torch.manual_seed(0)
    model = Net(layers=6, d=128)  # 32 KiB tensors, three offloaded per block
    x = torch.randn(64, 128, requires_grad=True)
    ref = step(model, x)
    cache = make_cache(keep_last_modules=3, min_bytes=1024)
    cache.attach(model)
    cache._core.set_inline_copy_bytes(0)  # every store and load through the workers
    step(model, x, cache.step(), drain=cache)  # learns the blocks: the next step keeps the last three
    window_at = {}
    prefetch = cache._prefetch_scope

    def recorded(mb, scope):
        prefetch(mb, scope)
        window_at.setdefault(scope, cache._core.stats()["window_bytes"])  # loading or loaded now

    cache._prefetch_scope = recorded
    got = step(model, x, cache.step(), drain=cache)
    assert same(ref[1], got[1])
    assert sorted(window_at) == list(range(6))
    assert [window_at[s] for s in (5, 4, 3)] == [0, 0, 0], window_at
    s = cache.stats()
    assert s["tensors_reloaded"] > 0 and s["tensors_forwarded"] == 0


def test_core_takes_a_lead_per_save_and_release_points_by_bytes():
    # The arguments the glue passes for a plan: a save's reload lead (Note
    # [Prefetch distance] in tensor_cache_load.cpp: 0 is the window) and a
    # release point's offloaded bytes (Note [Release by bytes]; -1: no limit).
    core = _core.CacheCore("cpu", [], 0, 1 << 20, 1, False, 0)
    try:
        core.set_inline_copy_bytes(0)  # through the workers: prefetched, not copied at unpack
        ts = [torch.full((4096,), i, dtype=torch.uint8) for i in range(3)]
        ids = []
        for i, t in enumerate(ts):
            st = t.untyped_storage()
            ids.append(core.save(st._cdata, 0, st.data_ptr(), st.nbytes(), -1, 0, 0, True,
                                 lead_bytes=4096 if i == 0 else 0)[0])
            core.scope_end(0, i)
        core.drain()
        core.poll()
        core.release_copies(0, 2, 0, max_bytes=8192)  # host entries: nothing held, nothing to release
        core.release_copies(0, 2, 0, max_bytes=8192, device=0)  # the compute stream's device, named
        with pytest.raises(ValueError, match="max_bytes"):
            core.release_copies(0, 2, 0, max_bytes=-2)
        # From the end: the first entry is 12 KiB away, beyond its 4 KiB lead.
        assert [c[0] for c in core.prefetch_scope(0, 2)] == [ids[2], ids[1]]
        s = core.stats()["step"]
        assert s["device_wait_seconds"] == s["copy_wait_seconds"] == s["load_wait_seconds"] == 0
    finally:
        core.close()


def ssd_bytes_written(stats):
    return sum(t["bytes_written"] for t in stats["tiers"] if t["tier"] == "ssd")


@pytest.mark.skipif(not ssd_available(), reason="storage engine not in this build")
def test_stores_forwarded_while_writing_are_counted_as_discarded(tmp_path):
    # A slow disk (a 20 MB/s cap): backward reaches tensors whose store is
    # still writing. They are forwarded, the finished copy is freed, and the
    # bytes it wrote show in bytes_discarded, so that what the step's stores
    # wrote is accounted for exactly: bytes_offloaded + bytes_discarded,
    # whichever stores the timing of a step left mid-write (none, some or
    # all: the identity must hold in every case; the C++ test with a gated
    # store stages the mid-write case itself).
    torch.manual_seed(0)
    model = Net(layers=4, d=256)
    x = torch.randn(512, 256, requires_grad=True)  # 512 KiB activations
    ref = step(model, x)
    with ebbtide.TensorCache(target="ssd", path=str(tmp_path), min_bytes=4096, keep_last_modules=0) as cache:
        cache.max_write_mbps = 20
        cache.attach(model)
        written = 0
        discarded = 0
        for _ in range(2):
            got = step(model, x, cache.step())
            assert same(ref[1], got[1])
            s = cache.stats()
            step_written = ssd_bytes_written(s) - written
            written += step_written
            assert s["bytes_offloaded"] + s["bytes_discarded"] == step_written, s
            assert (s["tensors_forwarded"] > 0) or s["bytes_discarded"] == 0, s
            discarded += s["bytes_discarded"]
            assert s["store_bytes_held"] == 0 and s["entries"] == 0
        assert s["total"]["bytes_discarded"] == discarded


@pytest.mark.skipif(not ssd_available(), reason="storage engine not in this build")
def test_backward_cancels_stores_not_yet_started(tmp_path):
    # Note [Late stores]: once backward has begun, the stores that have not
    # started are cancelled, not written and read back. Staged: the stores are
    # held through the forward, so none has started when backward begins
    # (a disk slower than the forward, deterministically).
    torch.manual_seed(0)
    model = Net(layers=4, d=256)
    x = torch.randn(512, 256, requires_grad=True)  # 512 KiB activations
    ref = step(model, x)
    with ebbtide.TensorCache(target="ssd", path=str(tmp_path), min_bytes=4096, keep_last_modules=0) as cache:
        cache.attach(model)
        model.zero_grad(set_to_none=True)
        x.grad = None
        with cache.step():
            cache._core.pause_stores(True)
            loss = model(x)
            s0 = cache.stats()
            loss.backward()
            cache._core.pause_stores(False)
        cache.drain()
        got = grads_of(model, x)
        assert same(ref[1], got)
        s = cache.stats()
        queued = s0["saved_bytes_total"] - s0["bytes_offloaded"]
        assert s0["bytes_offloaded"] == 0 and queued >= 4 * 512 * 256 * 4, s0
        assert ssd_bytes_written(s) == ssd_bytes_written(s0) == 0, s
        assert s["tensors_forwarded"] == s["tensors_saved"] - s["tensors_deduped"] - s["tensors_kept"], s
        assert s["bytes_reloaded"] + s["bytes_reused"] == s["bytes_offloaded"] == 0
        assert s["store_bytes_held"] == 0 and s["entries"] == 0


def test_ssd_moves_cpu_activations_in_place(tmp_path):
    # Note [Slot phase]: slots follow each storage's address, reload buffers
    # the slot, so O_DIRECT moves all but a head and tail block of each tensor
    # without a staging copy (torch's CPU tensors are only 64-byte aligned).
    torch.manual_seed(0)
    model = Net(layers=4, d=256)
    x = torch.randn(512, 256, requires_grad=True)
    ref = step(model, x)
    cache = ebbtide.TensorCache(target="ssd", path=str(tmp_path), min_bytes=4096, keep_last_modules=0)
    try:
        if cache._core.io_alignment <= 1:
            pytest.skip("no O_DIRECT on this filesystem")
        cache.attach(model)
        got = step(model, x, cache.step(), drain=cache)
        assert same(ref[1], got[1])
        s = cache.stats()
        moved = s["bytes_offloaded"] + s["bytes_reloaded"]
        assert moved > 0
        per_tensor = 2 * cache._core.io_alignment * (s["tensors_offloaded"] + s["tensors_reloaded"])
        assert s["store_bytes_staged"] <= per_tensor, s
    finally:
        cache.close()


def test_peak_resident_well_below_no_offload(make_cache):
    torch.manual_seed(0)
    model = Net(layers=6, d=128)
    x = torch.randn(256, 128, requires_grad=True)
    # The pack waits while more than 256 KiB is waiting to be stored, so the
    # bound does not depend on how fast this machine's workers are.
    cache = make_cache(keep_last_modules=1, min_bytes=4096, max_inflight_bytes=256 << 10)
    cache.attach(model)
    ref = step(model, x)
    got = step(model, x, cache.step())
    assert same(ref[1], got[1])
    s = cache.stats()
    assert s["peak_resident_bytes"] <= 0.5 * s["saved_bytes_total"], s


def test_parameters_and_their_views_are_never_offloaded(make_cache):
    cache = make_cache()
    lin = torch.nn.Linear(64, 64)
    cache.attach(lin)
    w = lin.weight
    x = torch.randn(8, 64, requires_grad=True)
    with cache.step():
        y = x @ w.t()          # saves x and a view of the weight
        z = (y * w[0]).sum()   # another view of the weight
        cache.drain()
        z.backward()
    s = cache.stats()
    # Only activations reached the cache: x and y.
    assert s["tensors_saved"] == 2
    assert s["saved_bytes_total"] == 2 * 8 * 64 * 4


def test_small_tensors_stay_and_a_model_without_saved_tensors_works(make_cache):
    cache = make_cache(min_bytes=1 << 20)
    x = torch.randn(100, requires_grad=True)
    with cache.step():
        (x.exp()).sum().backward()
    s = cache.stats()
    assert s["tensors_kept"] == 1 and s["tensors_offloaded"] == 0
    with cache.step():
        (x * 2).sum().backward()  # mul by a scalar saves nothing
    assert cache.stats()["tensors_saved"] == 0


def test_nested_step_closed_cache_and_coexisting_caches(make_cache):
    a = make_cache()
    b = make_cache()
    x = torch.randn(100, requires_grad=True)
    with a.step():
        with pytest.raises(RuntimeError, match="inside step"):
            with a.step():
                pass
        with b.step():  # another cache may nest: its hooks take the inner saves
            y = x.exp()
        z = y.sin()
        (z.sum()).backward()
    assert a.stats()["tensors_saved"] == 1 and b.stats()["tensors_saved"] == 1
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        with a.step():
            pass
    with pytest.raises(RuntimeError, match="closed"):
        a.attach(torch.nn.Linear(2, 2))
    a.stats()  # the last numbers stay readable


def test_bad_arguments():
    with pytest.raises(ValueError, match="target"):
        ebbtide.TensorCache(target="gpu")
    with pytest.raises(ValueError):
        ebbtide.TensorCache(target="cpu", keep_last_modules=-1)


def test_store_full_keeps_tensors_resident_with_one_warning():
    torch.manual_seed(0)
    model = Net(layers=4, d=64)
    x = torch.randn(32, 64, requires_grad=True)
    ref = step(model, x)
    cache = ebbtide.TensorCache(target="cpu", min_bytes=0, keep_last_modules=0, capacity_bytes=20000)
    cache.attach(model)
    with pytest.warns(RuntimeWarning, match="stay in memory"):
        got = step(model, x, cache.step(), drain=cache)
    assert same(ref[1], got[1])
    s = cache.stats()
    assert s["store_failures"] >= 1 and s["entries"] == 0
    cache.close()
