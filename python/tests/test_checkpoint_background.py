"""Background snapshots (Note [Background snapshot] in ebbtide/checkpoint/native_save.py)
and loads straight into existing tensors (Note [Load in place])."""
import errno
import os
import threading
import time

import pytest
import torch

from ebbtide import _core
from ebbtide import checkpoint as ckpt
from ebbtide.checkpoint import native_load, native_save


class HeldSnapshots:
    """Stands in for a Writer's native half: save() (the snapshot, which runs on
    the background thread) waits until release() so a test can act while a
    snapshot is pending."""

    def __init__(self, native):
        self._native = native
        self.started = threading.Event()
        self._go = threading.Event()

    def release(self):
        self._go.set()

    def save(self, *args, **kwargs):
        self.started.set()
        assert self._go.wait(30), "test never released the snapshot"
        return self._native.save(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._native, name)


def held_writer():
    w = ckpt.Writer()
    held = HeldSnapshots(w._native)
    w._native = held
    return w, held


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))


def train_step(model, opt):
    opt.zero_grad(set_to_none=True)
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()


def test_optimizer_step_waits_for_the_snapshot(tmp_path):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, opt)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    w, held = held_writer()
    t0 = time.perf_counter()
    h = w.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c", async_=True,
               snapshot="background")
    assert time.perf_counter() - t0 < 5
    assert held.started.wait(10) and not h.staged() and w.busy
    threading.Timer(1.0, held.release).start()
    t1 = time.perf_counter()
    train_step(model, opt)  # the global step pre-hook waits for the snapshot before changing anything
    waited = time.perf_counter() - t1
    # forward + backward of this model take milliseconds: most of the second is the hook's wait
    assert h.staged() and waited >= 0.95 and h.snapshot_wait_seconds >= 0.5
    info = h.wait()
    assert h.done() and not w.busy and info["raw_bytes"] > 0
    got = ckpt.load(tmp_path / "c")["model"]
    assert all(torch.equal(got[k], want[k]) for k in want), "the checkpoint holds the state at save()"
    assert not torch.equal(model.state_dict()["0.weight"], want["0.weight"]), "the step ran after it"


def test_change_during_snapshot_rejects_the_save(tmp_path):
    x = torch.randn(1 << 16)
    ckpt.save({"x": torch.ones(4)}, tmp_path / "c")
    w, held = held_writer()
    h = w.save({"layer": {"x": x}}, tmp_path / "c", async_=True, snapshot="background")
    assert held.started.wait(10)
    with torch.no_grad():
        x.add_(1)  # not through torch.optim: nothing waits, the version counter tells
    held.release()
    with pytest.raises(ckpt.StateError, match=r"tensor 'state\.layer\.x' was changed in place"):
        h.wait()
    w.join()
    assert torch.equal(ckpt.load(tmp_path / "c")["x"], torch.ones(4)), "the previous checkpoint stays"
    assert sorted(os.listdir(tmp_path)) == ["c"], "nothing half-written is left"
    # The writer is usable again.
    w._native = held._native
    w.save({"x": x}, tmp_path / "c", async_=True, snapshot="background").wait()
    assert torch.equal(ckpt.load(tmp_path / "c")["x"], x)


def test_second_save_while_a_background_snapshot_runs(tmp_path):
    w, held = held_writer()
    x = torch.randn(1 << 16)
    h = w.save({"x": x}, tmp_path / "a", async_=True, snapshot="background")
    assert held.started.wait(10)
    with pytest.raises(ckpt.StateError, match="still in flight"):
        w.save({"x": x}, tmp_path / "b", async_=True)
    assert not os.path.exists(tmp_path / "b")
    threading.Timer(0.2, held.release).start()
    h2 = w.save({"x": x * 2}, tmp_path / "b", async_=True, block=True)  # waits for the first
    assert h.done()
    h2.wait()
    assert torch.equal(ckpt.load(tmp_path / "a")["x"], x) and torch.equal(ckpt.load(tmp_path / "b")["x"], x * 2)


def test_background_save_without_held_snapshot_round_trips(tmp_path):
    state = {"a": torch.randn(3 << 20), "b": torch.arange(10), "n": 3, "s": "text"}
    h = ckpt.save(state, tmp_path / "c", async_=True, snapshot="background")
    ckpt.wait_for_snapshots()
    assert h.staged()
    h.wait()
    out = ckpt.load(tmp_path / "c")
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"])
    assert out["n"] == 3 and out["s"] == "text"


def test_background_snapshot_write_error_propagates(tmp_path):
    ckpt.save({"x": torch.ones(4)}, tmp_path / "c")
    _core.ckpt_inject_write_fault(0, errno.ENOSPC)
    try:
        h = ckpt.save({"x": torch.randn(1 << 20)}, tmp_path / "c", async_=True, snapshot="background")
        with pytest.raises(OSError) as ei:
            h.wait()
        assert ei.value.errno == errno.ENOSPC
    finally:
        _core.ckpt_inject_write_fault(0, 0)
    assert torch.equal(ckpt.load(tmp_path / "c")["x"], torch.ones(4))
    ckpt.join()
    assert sorted(os.listdir(tmp_path)) == ["c"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(snapshot="background"), "needs async_=True"),
    (dict(async_=True, snapshot="lazy"), "snapshot='lazy' is not valid"),
])
def test_bad_snapshot_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ckpt.save({"x": torch.ones(2)}, tmp_path / "c", **kwargs)
    assert not os.path.exists(tmp_path / "c")


def count_fresh_buffers(monkeypatch):
    calls = []
    real = native_load._host_buffer

    def spy(nbytes):
        calls.append(nbytes)
        return real(nbytes)
    monkeypatch.setattr(native_load, "_host_buffer", spy)
    return calls


def test_load_into_reads_in_place(tmp_path, monkeypatch):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    train_step(model, opt)
    ckpt.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7}, tmp_path / "c")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    other = small_model()
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    train_step(other, other_opt)  # its moments exist: every saved tensor has a destination
    torch.nn.init.zeros_(other[0].weight)
    dest = {"model": other.state_dict(), "optimizer": other_opt.state_dict(), "step": 0}
    ptrs = {k: v.data_ptr() for k, v in dest["model"].items()}
    fresh = count_fresh_buffers(monkeypatch)
    out = ckpt.load(tmp_path / "c", into=dest)
    assert out is dest and dest["step"] == 7
    assert all(torch.equal(other.state_dict()[k], want[k]) for k in want)
    assert {k: v.data_ptr() for k, v in dest["model"].items()} == ptrs
    assert fresh == [], "every storage was read straight into the destination"
    saved = ckpt.load(tmp_path / "c")["optimizer"]["state"]
    assert all(torch.equal(other_opt.state[p]["exp_avg"], saved[i]["exp_avg"])
               for i, p in enumerate(other.parameters()))


def test_load_into_module_with_tied_weights(tmp_path, monkeypatch):
    def tied():
        m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(300, 64), "head": torch.nn.Linear(64, 300, bias=False)})
        m["head"].weight = m["emb"].weight
        return m
    torch.manual_seed(1)
    a = tied()
    ckpt.save(a.state_dict(), tmp_path / "c")
    b = tied()
    fresh = count_fresh_buffers(monkeypatch)
    ckpt.load(tmp_path / "c", into=b)
    assert fresh == []
    assert torch.equal(b["emb"].weight, a["emb"].weight) and b["head"].weight is b["emb"].weight


# CUDA state, faked on the CPU (test_checkpoint_gpu.py has the real one):
# the storages are reported on two devices. A background snapshot orders
# each device's side stream after the caller's current stream once per save
# (each wait_stream records a CUDA event on the training thread), not once
# per tensor; a snapshot that blocks takes each device's current stream once.
@pytest.mark.parametrize("background", [True, False], ids=["background", "blocking"])
def test_snapshot_streams_are_taken_once_per_device(tmp_path, monkeypatch, background):
    taken = []

    class FakeStream:
        def __init__(self, device):
            taken.append(device)
            self.cuda_stream = 1000 + device.index

    class OnTwoDevices(ckpt.tree.Flattener):
        def tensor(self, t, path):
            n = len(self.blobs)
            out = super().tensor(t, path)
            for b in self.blobs[n:]:
                b[3] = torch.device("cuda", len(self.blobs) % 2)
            return out

    monkeypatch.setattr(native_save.tree, "Flattener", OnTwoDevices)
    monkeypatch.setattr(native_save, "_snapshot_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    state = {f"t{i}": torch.randn(8) for i in range(40)}
    s = native_save._Save(ckpt.Writer(), tmp_path / "c", async_=True, compress=None, block=False, background=background,
                   stripe_dirs=None)
    s.encode(state, None, None)
    assert sorted(d.index for d in taken) == [0, 1]
    assert len(s.blobs) == 40
    for name, ptr, nbytes, on_dev, stream, elem, codec in s.blobs:
        assert on_dev and stream in (1000, 1001), (name, stream)


def test_load_into_other_layouts_falls_back_to_copies(tmp_path, monkeypatch):
    base = torch.randn(64, 32)
    ckpt.save({"w": base, "a": torch.randn(8), "b": torch.randn(8)}, tmp_path / "c")
    shared = torch.zeros(2, 8)
    dest = {"w": torch.zeros(32, 64).t(),  # same shape, other strides
            "a": shared[0], "b": shared[1]}  # two saved storages onto one destination storage
    fresh = count_fresh_buffers(monkeypatch)
    ckpt.load(tmp_path / "c", into=dest)
    assert len(fresh) == 3
    saved = ckpt.load(tmp_path / "c")
    assert torch.equal(dest["w"], base) and torch.equal(shared[0], saved["a"]) and torch.equal(shared[1], saved["b"])


def test_load_into_a_view_leaves_its_neighbours(tmp_path):
    x = torch.arange(20.0)
    ckpt.save({"a": x[:10]}, tmp_path / "c")  # the whole 20-element storage is saved
    buf = torch.full((20,), -1.0)
    ckpt.load(tmp_path / "c", into={"a": buf[:10]})
    assert torch.equal(buf[:10], x[:10])
    assert torch.equal(buf[10:], torch.full((10,), -1.0)), "only the requested view is written"


def test_load_into_errors_before_overwriting(tmp_path):
    m = torch.nn.Linear(4, 3)
    ckpt.save(m.state_dict(), tmp_path / "c")
    dest = {"weight": torch.zeros(3, 4), "bias": torch.zeros(2)}
    with pytest.raises(ValueError, match="bias"):
        ckpt.load(tmp_path / "c", into=dest)
    assert torch.equal(dest["weight"], torch.zeros(3, 4)), "nothing overwritten by a failed load"
    bigger = torch.nn.Sequential(torch.nn.Linear(4, 3))
    before = bigger[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"missing keys \['0.bias', '0.weight'\], unexpected keys \['bias', 'weight'\]"):
        ckpt.load(tmp_path / "c", into=bigger)
    assert torch.equal(bigger[0].weight, before)
    ckpt.save([torch.ones(2)], tmp_path / "list")
    with pytest.raises(ValueError, match="not a state dict"):
        ckpt.load(tmp_path / "list", into=m)
