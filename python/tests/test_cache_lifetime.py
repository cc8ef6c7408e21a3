"""The tensor cache on CPU, continued from test_cache.py (whose model and
helpers these tests share): the ssd target's files (unwritable paths, nothing
left after close or SIGKILL, a full disk), the cache's lifetime around
ebbtide.offload() blocks, argument errors, pooled stores, and the C++
saved-tensor hooks (Note [Hooks in C++])."""
import gc
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ebbtide
from ebbtide import _core
from test_cache import TARGETS, Net, grads_of, make_cache, same, ssd_available, step  # noqa: F401 (make_cache: a fixture)

# --------------------------------------------------------------- ssd target

needs_ssd = pytest.mark.skipif(not ssd_available(), reason="storage engine not in this build")


@needs_ssd
def test_unwritable_path_fails_at_construction(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad in [afile, "/proc/self"]:  # /proc refuses files even for root
        with pytest.raises(OSError):
            ebbtide.TensorCache(target="ssd", path=str(bad))
    # A missing folder is made, as `mkdir -p` would (issue 41's first minute).
    with ebbtide.TensorCache(target="ssd", path=str(tmp_path / "missing" / "deeper")):
        assert (tmp_path / "missing" / "deeper").is_dir()
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if not os.access(ro, os.W_OK):
            with pytest.raises(OSError):
                ebbtide.TensorCache(target="ssd", path=str(ro))
    finally:
        os.chmod(ro, 0o700)


@needs_ssd
def test_no_files_left_after_close(tmp_path):
    torch.manual_seed(0)
    model = Net(layers=3)
    x = torch.randn(8, 32, requires_grad=True)
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    ref = step(model, x)
    with ebbtide.offload(model, target="ssd", path=[str(d) for d in dirs], min_bytes=0) as c:
        got = step(model, x)
        assert c.stats()["tensors_saved"] > 0
    assert same(ref[1], got[1])
    for d in dirs:  # striped over two directories; nothing left in either
        assert list(d.iterdir()) == []


@needs_ssd
def test_no_files_left_after_sigkill(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch, ebbtide
        cache = ebbtide.TensorCache(target="ssd", path={str(tmp_path)!r}, min_bytes=0)
        x = torch.randn(1 << 16, requires_grad=True)
        with cache.step():
            ys = [x.exp() * i for i in range(8)]
            cache.drain()
            print("ready", flush=True)
            sys.stdin.readline()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=env, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert list(tmp_path.iterdir()) == []


@needs_ssd
def test_disk_full_mid_step_keeps_tensors_resident(tmp_path):
    torch.manual_seed(0)
    model = Net(layers=4, d=64)
    x = torch.randn(32, 64, requires_grad=True)
    ref = step(model, x)
    cache = ebbtide.TensorCache(target="ssd", path=str(tmp_path), min_bytes=0, keep_last_modules=0)
    cache.attach(model)
    import errno
    _core.cache_inject_write_fault(str(tmp_path), 16384, errno.ENOSPC, 1000)
    try:
        with pytest.warns(RuntimeWarning, match="stay in memory"):
            got = step(model, x, cache.step(), drain=cache)
    finally:
        _core.cache_clear_faults()
    assert same(ref[1], got[1])
    assert cache.stats()["store_failures"] >= 1
    got = step(model, x, cache.step())  # the disk has room again
    assert same(ref[1], got[1])
    cache.close()


def test_tensors_off_the_training_device_pass_through():
    cache = ebbtide.TensorCache(target="cpu", min_bytes=0, device="meta")
    x = torch.randn(100, requires_grad=True)
    with cache.step():
        x.exp().sum().backward()
    assert cache.stats()["tensors_saved"] == 0
    cache.close()


def test_hints_and_errors_before_any_step():
    cache = ebbtide.TensorCache(target="cpu")
    with pytest.raises(ValueError, match="forward"):
        cache.phase("sideways")
    cache.microbatch(3)
    cache.close()
    cache.close()  # idempotent
    assert cache.stats()["steps"] == 0  # still readable after close
    with pytest.raises(RuntimeError, match="closed"):
        cache.phase("backward")


def test_unpack_after_an_aborted_step_fails_clearly(make_cache):
    cache = make_cache()
    x = torch.randn(100, requires_grad=True)
    kept = {}
    with pytest.raises(KeyError):
        with cache.step():
            kept["y"] = x.exp().sin()
            raise KeyError("stop")
    with pytest.raises(RuntimeError, match="aborted"):
        kept["y"].sum().backward()


# Note [Lifetime after the block]: like torch's save_on_cpu (whose own tests
# run backward after the context exits) and torchtune's OffloadActivations,
# backward may come after `with ebbtide.offload(...)`; the cache closes when
# the graph holding its entries is gone.
@pytest.mark.parametrize("target", TARGETS)
def test_backward_after_the_offload_block(target, tmp_path):
    torch.manual_seed(0)
    model = Net(layers=4, d=64)
    x = torch.randn(16, 64, requires_grad=True)
    model(x).backward()
    ref = grads_of(model, x)
    model.zero_grad()
    x.grad = None
    path = str(tmp_path / "eb") if target == "ssd" else None
    if path:
        os.makedirs(path)
    with ebbtide.offload(model, target=target, path=path, min_bytes=0, keep_last_modules=0) as c:
        loss = model(x)
    assert not c.closed, "closed while the graph still holds its entries"
    assert c.stats()["tensors_saved"] > 0
    c.drain()  # every store done: backward must reload (no timing in the test)
    loss.backward()
    assert same(grads_of(model, x), ref)
    del loss
    gc.collect()
    assert c.closed, "the cache outlived its graph"
    s = c.stats()
    assert s["bytes_reloaded"] + s["bytes_reused"] >= s["bytes_offloaded"] > 0
    assert s["bytes_reloaded"] > 0
    if path:
        assert os.listdir(path) == [], "the slab file is gone"
    # The model has no hooks left: a plain step runs as without ebbtide.
    model.zero_grad()
    x.grad = None
    model(x).backward()
    assert same(grads_of(model, x), ref)


def test_offload_block_with_nothing_saved_closes_at_once():
    with ebbtide.offload(target="cpu") as c:
        pass
    assert c.closed
    # save_on_cpu's pattern without a model: plain tensors, backward later.
    a = torch.randn(256, 256, requires_grad=True)
    b = torch.randn(256, 256, requires_grad=True)
    with ebbtide.offload(target="cpu", min_bytes=0) as c:
        y = (a * b).sin()
    assert not c.closed
    y.sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    (a * b).sin().sum().backward()
    assert torch.equal(ga, a.grad) and torch.equal(gb, b.grad)
    del y
    gc.collect()
    assert c.closed


def test_graph_dropped_without_backward_after_the_block_closes_the_cache():
    model = Net(layers=3, d=32)
    x = torch.randn(8, 32)
    with ebbtide.offload(model, target="cpu", min_bytes=0) as c:
        loss = model(x)
    assert not c.closed
    del loss
    gc.collect()
    assert c.closed


def _threads_and_fds():
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("target", TARGETS)
def test_close_releases_files_and_threads_at_once(target, tmp_path):
    # Note [Close releases]: nothing waits for garbage collection, even while
    # a reference to the cache lives on.
    before = _threads_and_fds()
    c = ebbtide.TensorCache(target=target, path=str(tmp_path) if target == "ssd" else None, min_bytes=0)
    during = _threads_and_fds()
    assert during[0] > before[0], "the cache runs worker threads"
    keep = c  # noqa: F841  a live reference, as a traceback would hold
    c.close()
    after = _threads_and_fds()
    # <=, not ==: a thread of an earlier test may end meanwhile; none may be left over.
    assert after[0] <= before[0] and after[1] <= before[1], (before, during, after)
    assert c.stats is not None and c.closed
    with pytest.raises(RuntimeError, match="closed"):
        c.describe()


@pytest.mark.parametrize("kw,name", [(dict(workers=-1), "workers"), (dict(workers=0), "workers"),
                                     (dict(capacity_bytes=-5), "capacity_bytes"),
                                     (dict(prefetch_window_bytes=-1), "prefetch_window_bytes"),
                                     (dict(max_inflight_bytes=-1), "max_inflight_bytes"),
                                     (dict(host_budget_bytes=-1), "host_budget_bytes"),
                                     (dict(capacity_bytes=1.5), "capacity_bytes")])
def test_bad_arguments_name_the_argument_and_value(kw, name):
    with pytest.raises(ValueError, match=name):
        ebbtide.TensorCache(target="cpu", **kw)


def test_bad_worker_count_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("EBBTIDE_CACHE_WORKERS", "-3")
    with pytest.raises(ValueError, match="EBBTIDE_CACHE_WORKERS"):
        ebbtide.TensorCache(target="cpu")


@pytest.mark.skipif(not ssd_available(), reason="storage engine not in this build")
def test_default_path_leaves_no_directory_even_when_killed(tmp_path):
    # path=None: the slab lives, unlinked, in the temporary directory itself.
    code = textwrap.dedent('''
        import os, signal, torch, ebbtide
        c = ebbtide.TensorCache(target="ssd", min_bytes=0)
        x = torch.randn(256, 256, requires_grad=True)
        with c.step():
            y = (x * x).sin().sum()
            c.drain()
            print("ready", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    ''')
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert "ready" in p.stdout
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not ssd_available(), reason="storage engine not in this build")
def test_offload_per_step_reuses_a_pooled_store(tmp_path):
    # Note [Store pool]: the second offload() with the same settings borrows
    # the first one's store (its engine threads), and a direct TensorCache
    # still releases its own at close.
    ebbtide.release_pooled_stores()
    model = Net(layers=3, d=64)
    x = torch.randn(32, 64)
    model(x).backward()
    ref = grads_of(model)
    model.zero_grad()
    with ebbtide.offload(model, target="ssd", path=str(tmp_path), min_bytes=0) as c:
        model(x).backward()
    gc.collect()  # a graph in a reference cycle goes (and closes its cache) at a collection
    assert c.closed
    after_first = _threads_and_fds()
    for _ in range(3):
        model.zero_grad()
        with ebbtide.offload(model, target="ssd", path=str(tmp_path), min_bytes=0):
            model(x).backward()
        assert same(grads_of(model), ref)
        gc.collect()
        assert _threads_and_fds()[1] == after_first[1], "a slab file was opened again"
    # One store served every step: a rebuilt one would have been returned too.
    assert ebbtide.release_pooled_stores() == 1
    assert _threads_and_fds()[0] < after_first[0], "dropping the pool joins the store's threads"


def test_a_handle_released_twice_frees_nothing_another_handle_needs():
    # Note [Interrupted release]: releasing a handle is idempotent; a second
    # release of one handle must not count as another's.
    cache = ebbtide.TensorCache(target="cpu", min_bytes=0)
    t = torch.randn(128, 128)
    with cache.step():
        h1 = cache._native.pack(t)  # the device is learnt here (the glue's Python path)
        h2 = cache._native.pack(t)  # the same storage and version: one entry, two handles
        assert type(h1) is type(h2) and h1.eid == h2.eid and h1.hid != h2.hid
        cache._core.release_handle(h1.hid, h1.eid)
        cache._core.release_handle(h1.hid, h1.eid)
        assert cache._core.contains(h2.eid), "the second release of one handle freed the entry"
        del h1  # the handle's own release, the third
        assert cache._core.contains(h2.eid), "the third release of one handle freed the entry"
        assert torch.equal(cache._native.unpack(h2), t)
        eid = h2.eid
        del h2
        assert not cache._core.contains(eid)
    cache.close()


@pytest.mark.skipif(not ssd_available(), reason="storage engine not in this build")
def test_overlong_path_is_named_as_such():
    with pytest.raises(OSError, match="too long"):
        ebbtide.TensorCache(target="ssd", path="/tmp/" + "a" * 4096)


def test_kept_tensors_take_no_core_entry_and_keep_the_inplace_check():
    # Note [Kept tensors]: identity hooks lose autograd's in-place check (a
    # silently wrong gradient); the kept handle keeps it, without an entry.
    a = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        b = a * 2
        c = b.sin()
        b.add_(1)
    c.sum().backward()  # what identity hooks allow
    cache = ebbtide.TensorCache(target="cpu", min_bytes=1 << 30)
    with cache.step():
        b = a * 2
        c = b.sin()
        assert cache._core.stats()["entries"] == 0
        s = cache.stats()
        assert s["tensors_kept"] >= 1 and s["resident_bytes"] >= b.numel() * 4
        b.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            c.sum().backward()
    cache.close()


# ---------------------------------------------------------------- Note [Hooks in C++]
def test_views_of_a_parameter_not_attached_are_never_offloaded():
    # The C++ pack hook walks the view's bases to the Parameter itself.
    cache = ebbtide.TensorCache(target="cpu", min_bytes=0, device="cpu", adaptive=False)
    p = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    with cache.step():
        (x @ p.t()).sum().backward()  # saves x and p.t(), a view of the parameter
    s = cache.stats()
    assert s["tensors_saved"] == 1 and s["saved_bytes_total"] == 8 * 64 * 4, s
    cache.close()


def test_packing_makes_nothing_the_garbage_collector_tracks():
    # Handles hold a weak reference to the TensorImpl, not a Python weakref:
    # a forward of many saves does not drive the collector.
    import gc
    cache = ebbtide.TensorCache(target="cpu", min_bytes=0, device="cpu", adaptive=False)
    ts = [torch.randn(256) for _ in range(200)]
    hs = [None] * len(ts)
    kept = [None] * len(ts)
    with cache.step():
        gc.disable()
        try:
            before = gc.get_count()[0]
            for i in range(len(ts)):
                hs[i] = cache._native.pack(ts[i])
            cache.min_bytes = 1 << 30
            for i in range(len(ts)):
                kept[i] = cache._native.pack(ts[i] * 2)
            after = gc.get_count()[0]
        finally:
            gc.enable()
        assert type(hs[0]).__name__ == "Handle" and type(kept[0]).__name__ == "KeptHandle"
        # The kept loop makes one tensor per save (ts[i] * 2), held by its handle.
        assert after - before <= len(ts) + 5, (before, after)
        assert all(torch.equal(cache._native.unpack(h), t) for h, t in zip(hs, ts))
        del hs, kept
    cache.close()


def test_the_first_save_learns_the_device_and_both_paths_share_the_books():
    # The glue's Python path takes the first save of a cache that does not
    # know its device; the C++ hooks take the rest, and stats() counts both.
    cache = ebbtide.TensorCache(target="cpu", min_bytes=4096, adaptive=False)
    assert cache._native.device == -2
    x = torch.randn(32, 64, requires_grad=True)
    v = torch.randn(16, requires_grad=True)
    with cache.step():
        y = x.exp()              # saves its output (8 KiB): the Python path
        assert cache._native.device == -1
        z = (y.sin() * 2).sum()  # y again (dedup) through the C++ path
        small = (v * v).sum()    # a 64-byte storage: kept, through C++
        (z + small).backward()
    s = cache.stats()
    assert s["tensors_offloaded"] >= 1 and s["tensors_kept"] >= 1 and s["tensors_deduped"] >= 1, s
    assert s["entries"] == 0 and s["resident_bytes"] == 0, s
    cache.close()


def test_a_build_without_the_torch_hooks_says_how_to_rebuild(monkeypatch):
    import ebbtide.cache.tensor_cache as cache_mod
    monkeypatch.setattr(cache_mod, "_torch", None)
    monkeypatch.setattr(cache_mod, "_TORCH_MISSING", "No module named 'ebbtide._torch'", raising=False)
    with pytest.raises(RuntimeError, match="no-build-isolation"):
        ebbtide.TensorCache(target="cpu")
