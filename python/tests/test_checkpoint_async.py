"""Async saves (issue 31 §2): what the caller may do once save() returns
(Note [First async save] in cpp/src/ckpt/writer_arena.cpp, Note [Uncopied async
saves] in ebbtide/checkpoint/native_save.py, Notes [Uncopied DCP saves] and
[First DCP async save] in ebbtide/checkpoint/dcp_staging.py), errors of the
background writes, and the benchmark run end to end. Nothing here is timed."""
import errno
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ebbtide import _core
from ebbtide import checkpoint as ckpt
from ebbtide import dcp as edcp
from ebbtide.checkpoint import dcp_format
from ebbtide.dcp import EbbtideReader, EbbtideWriter

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "ckpt_first_save.py")


def make_state():
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(3000, generator=g).bfloat16(),
            "step": 3, "small": torch.arange(7)}


def clone(state):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def mutate(state):
    with torch.no_grad():
        state["w"].add_(1)
        state["b"].zero_()
        state["small"].mul_(5)


def assert_bitwise(got, want):
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
        else:
            assert got[k] == v, k


def test_first_and_later_async_saves_hold_the_state_at_save(tmp_path):
    """The first async save of a writer is written through (its arena is too
    small); later ones snapshot into the arena it then grows. Either way the
    checkpoint is the state at save(), whatever the caller does after."""
    state = make_state()
    w = ckpt.Writer()
    assert w._native.snapshot_capacity == 0
    for i in range(3):
        want = clone(state)
        h = w.save(state, tmp_path / "c", async_=True)
        mutate(state)  # at once, before the writes are done
        info = h.wait()
        assert ("pipelined snapshot" in info["backend"]) == (i == 0), info["backend"]
        w.join()
        if i == 0:  # grown after the first save, for the next one
            assert w._native.snapshot_capacity >= state["w"].nbytes + state["b"].nbytes
        assert_bitwise(ckpt.load(tmp_path / "c"), want)


class HeldWrites:
    """Stands in for a Writer's native half: the handles it returns report the
    save written only after release(), so a test acts while the writes of an
    uncopied save are pending (whatever the disk's speed)."""

    def __init__(self, native):
        self._native = native
        self._go = threading.Event()

    def release(self):
        self._go.set()

    def save(self, *args, **kwargs):
        return HeldHandle(self._native.save(*args, **kwargs), self._go)

    def __getattr__(self, name):
        return getattr(self._native, name)


class HeldHandle:
    def __init__(self, h, go):
        self._h, self._go = h, go

    def wait_written(self):
        assert self._go.wait(30), "test never released the writes"
        self._h.wait_written()

    def __getattr__(self, name):
        return getattr(self._h, name)


def held_writer():
    w = ckpt.Writer()
    held = HeldWrites(w._native)
    w._native = held
    return w, held


def test_uncopied_save_waits_for_the_optimizer_step(tmp_path):
    model = torch.nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    w, held = held_writer()
    h = w.save({"model": model.state_dict()}, tmp_path / "c", async_=True, snapshot="none")
    assert not h.staged() and not h.done()
    model(torch.randn(4, 64)).sum().backward()
    threading.Timer(0.2, held.release).start()
    opt.step()  # the step pre-hook waits until the writes of the tensors' bytes are done
    assert h.staged()
    h.wait()
    got = ckpt.load(tmp_path / "c")["model"]
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(model.weight, want["weight"])


def test_uncopied_save_changed_in_place_is_rejected(tmp_path):
    ckpt.save({"x": torch.ones(4)}, tmp_path / "c")
    x = torch.randn(1 << 16)
    w, held = held_writer()
    h = w.save({"layer": {"x": x}}, tmp_path / "c", async_=True, snapshot="none")
    with torch.no_grad():
        x.add_(1)  # outside torch.optim, before the writes are done: the version counter tells
    held.release()
    with pytest.raises(ckpt.StateError, match=r"tensor 'state\.layer\.x' was changed in place while the save "
                                              r"\(snapshot='none'\)"):
        h.wait()
    w.join()
    assert torch.equal(ckpt.load(tmp_path / "c")["x"], torch.ones(4)), "the previous checkpoint stays"
    assert sorted(os.listdir(tmp_path)) == ["c"], "nothing half-written is left"


def test_uncopied_save_round_trip(tmp_path):
    state = make_state()
    want = clone(state)
    h = ckpt.save(state, tmp_path / "c", async_=True, snapshot="none")
    h.wait_staged()
    mutate(state)  # allowed once staged
    h.wait()
    assert_bitwise(ckpt.load(tmp_path / "c"), want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(snapshot="none"), "snapshot='none' needs async_=True"),
    (dict(async_=True, snapshot="none", compress="lossless"), "snapshot='none' writes the tensors' own bytes"),
])
def test_bad_uncopied_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ckpt.save({"x": torch.ones(2)}, tmp_path / "c", **kwargs)
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("snapshot", ["blocking", "none"])
def test_async_write_error_names_the_file(tmp_path, first, snapshot):
    w = ckpt.Writer()
    ckpt.save({"x": torch.ones(4)}, tmp_path / "c")
    if not first:  # the arena holds the state: the later saves' path
        w.save({"x": torch.randn(1 << 18)}, tmp_path / "d", async_=True).wait()
        w.join()
    _core.ckpt_inject_write_fault(0, errno.ENOSPC)
    try:
        h = w.save({"x": torch.randn(1 << 18)}, tmp_path / "c", async_=True, snapshot=snapshot)
        with pytest.raises(OSError) as ei:
            h.wait()
    finally:
        _core.ckpt_inject_write_fault(0, 0)
    assert ei.value.errno == errno.ENOSPC
    assert "rank0.ebt" in str(ei.value) and str(tmp_path / "c") in str(ei.value), str(ei.value)
    with pytest.raises(OSError):  # the handle keeps its error
        h.wait()
    w.join()
    assert torch.equal(ckpt.load(tmp_path / "c")["x"], torch.ones(4))


@pytest.mark.parametrize("staging", ["copy", "none"])
def test_dcp_async_save_holds_the_state_at_save(tmp_path, staging):
    state = make_state()
    del state["step"]  # DCP keeps non-tensor values as bytes items; tensors are the point here
    w = EbbtideWriter(tmp_path / "c", staging=staging)
    for i in range(2):
        want = clone(state)
        fut = dcp.async_save(state, storage_writer=w)
        if staging == "copy":
            # The first call was written through (Note [First DCP async save]); once the writer is
            # joined its staging buffer is filled, and the next call copies into it.
            assert (w._views is None) == (i == 0)
            mutate(state)  # at once: the staged copy is what is written
        fut.result()
        w.join()
        if staging == "none":
            mutate(state)  # only after the future: the promise of staging="none"
        got = {k: torch.empty_like(v) for k, v in want.items()}
        dcp.load(got, storage_reader=EbbtideReader(tmp_path / "c"))
        assert_bitwise(got, want)


def test_dcp_uncopied_change_fails_the_save(tmp_path, monkeypatch):
    dcp.save({"x": torch.ones(4)}, storage_writer=EbbtideWriter(tmp_path / "c"))
    x = torch.randn(1 << 16)
    w = EbbtideWriter(tmp_path / "c", staging="none")

    def change():  # on the upload thread, after the bytes were written, before the check
        with torch.no_grad():
            x.add_(1)
    monkeypatch.setitem(dcp_format._test_gates, "uncopied-written", change)
    fut = dcp.async_save({"x": x}, storage_writer=w)
    with pytest.raises(BaseException, match=r"tensor 'x' was changed in place while .*__0_0\.distcp was being "
                                        r"written from it \(staging='none'\)"):
        fut.result()
    got = {"x": torch.empty(4)}
    dcp.load(got, storage_reader=EbbtideReader(tmp_path / "c"))
    assert torch.equal(got["x"], torch.ones(4)), "the previous checkpoint stays"


def test_dcp_async_write_error_names_the_file(tmp_path):
    w = EbbtideWriter(tmp_path / "c")
    _core.ckpt_inject_write_fault(0, errno.ENOSPC)
    try:
        fut = dcp.async_save({"x": torch.randn(1 << 18)}, storage_writer=w)
        with pytest.raises(BaseException) as ei:  # DCP's CheckpointException
            fut.result()
    finally:
        _core.ckpt_inject_write_fault(0, 0)
    assert "__0_0.distcp" in str(ei.value) and "No space left" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(staging="lazy"), "staging='lazy' is not valid"),
    (dict(staging="none", async_staging=True), "staging='none' copies nothing"),
])
def test_dcp_bad_staging(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EbbtideWriter(tmp_path / "c", **kwargs)


def test_async_bench_runs(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, BENCH, "--mode", "async", "--dir", str(tmp_path / "b"), "--size", "0.01",
                        "--saves", "2", "--first-rounds", "2", "--json", str(out)], check=True, capture_output=True,
                       text=True, timeout=600)
    r = json.loads(out.read_text())
    assert [(x["path"], x["copy"]) for x in r["runs"]] == [("native", True), ("native", False), ("dcp", True),
                                                            ("dcp", False), ("dcp-wrapped", True)]
    for x in r["runs"]:  # every call is reported, each later one against a copy of the state timed before it
        assert x["first_blocked_s"] > 0 and len(x["later_blocked_s"]) == 1 and len(x["sync_s"]) == 2
        assert len(x["copy_s"]) == 1 and x["copy_s"][0] > 0 and len(x["later_vs_copy"]) == 1
        assert len(x["later_cpu_vs_copy"]) == 1
        assert x["first_ratio"] > 0 and len(x["later_ratio"]) == 1 and x["later_vs_copy_max"] > 0
        assert x["first_sync_s"] > 0 and x["first_vs_first_sync"] > 0 and x["device"] == "cpu"
    assert "later dcp calls / later native calls" in p.stdout
    assert "later dcp-wrapped calls / later native calls" in p.stdout  # the state under one key
    for path in ("native", "dcp", "dcp-wrapped"):  # the first call again in fresh processes, beside fresh first sync saves
        f = r["first_rounds"][path]
        assert len(f["first_blocked_s"]) == 2 and len(f["first_sync_s"]) == 2 and f["ratio_of_medians"] > 0
        assert len(f["pair_ratios"]) == 2 and f["median_pair_ratio"] > 0


def test_async_ab_bench_runs(tmp_path):
    # The in-process A/B of the copying paths: every later call is reported, in
    # a rotating order, with the ratios to the native path.
    out = tmp_path / "ab.json"
    p = subprocess.run([sys.executable, BENCH, "--mode", "async-ab", "--dir", str(tmp_path / "b"), "--size", "0.01",
                        "--saves", "3", "--json", str(out)], check=True, capture_output=True, text=True, timeout=600)
    r = json.loads(out.read_text())
    assert set(r["blocked_s"]) == {"native", "dcp", "dcp-wrapped"} and r["rounds"] == 3 and len(r["copy_s"]) == 3
    for path, times in r["blocked_s"].items():
        assert len(times) == 3 and all(t > 0 for t in times) and len(r["cpu_s"][path]) == 3
        assert r["vs_native"][path] > 0 and r["cpu_vs_native"][path] > 0
    assert r["vs_native"]["native"] == 1.0
    assert "target: DCP <= 1.1x native" in p.stdout


def test_dcp_async_save_never_waits_for_the_staging_fill(tmp_path, monkeypatch):
    """Note [First DCP async save] (dcp_staging.py), the staging order: the
    first async_save writes the state through and then has a thread fill the
    writer's staging buffer. While that fill is held at its gate, another
    async_save does not wait for it (it writes through too); once the fill
    has ended, the next one copies into the buffer. Every save holds the
    state as it was at its call."""
    at_gate, go = threading.Event(), threading.Event()

    def hold():
        at_gate.set()
        go.wait(120)
    monkeypatch.setitem(dcp_format._test_gates, "staging-fill", hold)
    state = make_state()
    del state["step"]
    w = EbbtideWriter(tmp_path / "c")

    def save_and_check(writer):
        want, out = clone(state), {}
        t = threading.Thread(target=lambda: out.update(fut=dcp.async_save(state, storage_writer=writer)), daemon=True)
        t.start()
        t.join(120)
        assert not t.is_alive(), "async_save waited for the staging buffer's fill"
        mutate(state)  # the caller goes on at once
        out["fut"].result()
        got = {k: torch.empty_like(v) for k, v in want.items()}
        dcp.load(got, storage_reader=EbbtideReader(tmp_path / "c"))
        assert_bitwise(got, want)
    try:
        for _ in range(2):
            save_and_check(w)
            assert at_gate.wait(120), "no fill was started after a written-through save"
            assert w._native.staging_buffer is None and w._views is None  # written through: nothing staged
        go.set()
        w.join()  # waits for the fill
        buf = w._native.staging_buffer
        assert buf is not None and buf.numel() >= sum(v.nbytes for v in state.values())
        save_and_check(w)
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
        staged = [t for t in w._views[2].values() if t.numel() > 0]
        assert staged and all(lo <= t.data_ptr() < hi for t in staged), "the staged copy is in the writer's buffer"
    finally:
        go.set()


def _writer_with_staging_buffer(path, state):
    """An EbbtideWriter whose next async_save copies into its staging buffer
    (the first one writes through and fills it: Note [First DCP async save])."""
    w = EbbtideWriter(path)
    dcp.async_save(state, storage_writer=w).result()
    w.join()
    assert w._native.staging_buffer is not None
    return w


def test_dcp_async_save_returns_with_the_overlapped_copy_whole(tmp_path, monkeypatch):
    """Note [Overlapped staging copy]: the writer's staging copy runs beside
    torch's set-up. While it is held at its gate, async_save has not
    returned, and the upload, having reached write_data, writes nothing
    (the staging buffer still holds the previous save's bytes); once it
    ends, the checkpoint is the state at the call."""
    state = make_state()
    del state["step"]
    w = _writer_with_staging_buffer(tmp_path / "c", state)
    mutate(state)  # the buffer now holds other bytes than the state's
    want, out = clone(state), {}
    copy_held, go, upload_waits = threading.Event(), threading.Event(), threading.Event()
    saves = []

    def hold():
        copy_held.set()
        go.wait(120)
    monkeypatch.setitem(dcp_format._test_gates, "staging-copy", hold)
    monkeypatch.setitem(dcp_format._test_gates, "staging-copy-wait", upload_waits.set)
    real_save = w._native.save

    class Native:  # the C++ writer, its saves recorded
        def __getattr__(self, name):
            return getattr(real, name)

        def save(self, *a, **k):
            saves.append(a[0])
            return real_save(*a, **k)
    real = w._native
    w._native = Native()
    try:
        t = threading.Thread(target=lambda: out.update(fut=dcp.async_save(state, storage_writer=w)), daemon=True)
        t.start()
        assert copy_held.wait(120) and upload_waits.wait(120)
        t.join(1.0)  # a call that does not wait for the copy returns meanwhile; one that waits cannot
        assert t.is_alive(), "async_save returned before its staging copy ended"
        assert saves == [], "the upload wrote before the staging copy ended"
    finally:
        go.set()
    t.join(120)
    assert not t.is_alive()
    mutate(state)  # the caller goes on once async_save has returned
    out["fut"].result()
    assert len(saves) == 1
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=EbbtideReader(tmp_path / "c"))
    assert_bitwise(got, want)


def _writer_whose_copies_fail(tmp_path):
    """(state, writer with a staging buffer whose writer's copies raise EIO,
    the state it last saved, its real C++ writer)."""
    state = make_state()
    del state["step"]
    w = _writer_with_staging_buffer(tmp_path / "c", state)
    real = w._native

    class Native:
        def __getattr__(self, name):
            return getattr(real, name)

        def stage(self, copies):
            raise OSError(errno.EIO, "staging copy failed (test)")
    w._native = Native()
    return state, w, clone(state), real


def test_dcp_async_save_with_a_failed_staging_copy_raises_and_commits_nothing(tmp_path):
    """Note [Overlapped staging copy]: a staging copy that fails makes
    async_save raise its error, and the upload writes nothing; the last
    checkpoint stays, and the next save works."""
    state, w, want, real = _writer_whose_copies_fail(tmp_path)
    before = set(threading.enumerate())
    mutate(state)
    with pytest.raises(OSError, match="staging copy failed"):
        dcp.async_save(state, storage_writer=w)
    for t in set(threading.enumerate()) - before:
        if t.name.startswith("AsyncCheckpointExecutor"):
            t.join(120)
            assert not t.is_alive()
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=EbbtideReader(tmp_path / "c"))
    assert_bitwise(got, want)  # the previous checkpoint
    w._native = real
    dcp.async_save(state, storage_writer=w).result()
    dcp.load(got, storage_reader=EbbtideReader(tmp_path / "c"))
    assert_bitwise(got, state)


def test_dcp_async_save_with_a_failed_copy_raises_once_its_upload_has_failed(tmp_path, monkeypatch):
    """Note [Overlapped staging copy]: async_save raises a failed copy's
    error only once the upload it started has failed too, so that nothing
    the caller does next (close(), another save) can let that upload commit
    what the copy left in the buffer. The upload is held at its gate: the
    call has not raised; released, it fails, and then the call raises."""
    state, w, want, real = _writer_whose_copies_fail(tmp_path)
    at_gate, go = threading.Event(), threading.Event()

    def hold():
        at_gate.set()
        go.wait(120)
    monkeypatch.setitem(dcp_format._test_gates, "staging-copy-wait", hold)
    mutate(state)
    out = {}

    def call():
        try:
            dcp.async_save(state, storage_writer=w)
        except OSError as e:
            out["error"] = e
    t = threading.Thread(target=call, daemon=True)
    try:
        t.start()
        assert at_gate.wait(120)
        t.join(1.0)  # a call that does not wait for the upload raises meanwhile
        assert t.is_alive(), "async_save raised while its upload could still commit"
    finally:
        go.set()
    t.join(120)
    assert not t.is_alive() and "staging copy failed" in str(out.get("error"))
    w._native = real
    w.close()
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=EbbtideReader(tmp_path / "c"))
    assert_bitwise(got, want)  # the previous checkpoint


def test_dcp_first_async_save_failing_before_the_writes_returns(tmp_path):
    """The first async_save waits for write_data (Note [First DCP async save]);
    an upload that fails in planning (a stripe directory that does not exist)
    never gets there, and async_save must return all the same."""
    w = EbbtideWriter(tmp_path / "c", stripe_dirs=[tmp_path / "missing"])
    out = {}

    def call():
        out["fut"] = dcp.async_save({"x": torch.randn(1 << 16)}, storage_writer=w)
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "async_save did not return after its upload failed"
    with pytest.raises(BaseException, match="missing"):  # DCP's CheckpointException
        out["fut"].result()
