"""torch.distributed.checkpoint with ebbtide's storage plugin (ebbtide.dcp):
FSDP2 on two gloo ranks, resharded loads, FileSystemWriter/Reader cross
loads, async_save, compression, kill -9 during a save. Hostile metadata and data,
inspect, saves without collectives and striping: test_dcp_hostile.py."""
import copy
import errno
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ebbtide import _core
from ebbtide.dcp import EbbtideReader, EbbtideWriter, load_metadata

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
# dcp.load/save wrap a storage layer's error in CheckpointException (a BaseException) holding its text.
FAILS = (Exception, CheckpointException)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 10))


def _train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 24, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _full_state(model, opt):
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def _assert_bitwise(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where  # bitwise
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _sharded(seed, mesh):
    """A model and its AdamW, sharded with FSDP2 over `mesh`."""
    from torch.distributed.fsdp import fully_shard

    m = _model(seed)
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _trained_state(rank, mesh, root):
    """A trained sharded model's DCP state dict; its full state is returned
    and saved by rank 0 to root/ref.pt."""
    model, opt = _sharded(0, mesh)
    for s in range(2):
        _train_step(model, opt, 100 + s)
    msd, osd = get_state_dict(model, opt)
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(root, "ref.pt"))
    return {"model": msd, "optim": osd}, full


def _load_sharded(full, mesh, reader):
    """Loads with `reader` on the ranks into a fresh sharded model; True when
    its state is bitwise `full`, else the difference."""
    m2, o2 = _sharded(7, mesh)
    _train_step(m2, o2, 5)  # optimizer state exists, and differs
    msd2, osd2 = get_state_dict(m2, o2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, storage_reader=reader)
    set_state_dict(m2, o2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    try:
        _assert_bitwise(full, _full_state(m2, o2))
    except AssertionError as e:
        return str(e)
    return True


def _load_unsharded(path, where=""):
    """One process, an unsharded model: DCP reshards the ranks' shards of
    `path`; bitwise the state in ref.pt beside it."""
    ref = torch.load(os.path.join(os.path.dirname(path), "ref.pt"), weights_only=True)
    model = _model(9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=EbbtideReader(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_bitwise(ref, _full_state(model, opt), where)


def _fsdp_worker(rank, world, init_file, root, results, save_and_load):
    """Trains a sharded model on this rank; results[rank] =
    save_and_load(state, full state, mesh, root)."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state, full = _trained_state(rank, mesh, root)
        results[rank] = save_and_load(state, full, mesh, root)
    finally:
        dist.destroy_process_group()


def _save_and_load_both_writers(state, full, mesh, root):
    dcp.save(state, storage_writer=EbbtideWriter(os.path.join(root, "ebb")))
    dcp.save(state, storage_writer=FileSystemWriter(os.path.join(root, "fsw")))
    # Load on two ranks into a fresh model: bitwise the saved state.
    ok = True
    for src, reader in (("ebb", EbbtideReader), ("fsw", EbbtideReader), ("ebb", FileSystemReader)):
        res = _load_sharded(full, mesh, reader(os.path.join(root, src)))
        if res is not True:
            ok = f"{src} with {reader.__name__}: {res}"
    return ok


def _on_two_gloo_ranks(worker, tmp_path, *args):
    """Runs worker(rank, world, init_file, root, results, *args) on two gloo
    ranks with root = tmp_path; each must report True in results[rank]."""
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "init"), str(tmp_path), results) + args, nprocs=2, join=True)
    assert results[0] is True and results[1] is True, dict(results)


def test_fsdp2_two_ranks_save_load_on_two_and_one(tmp_path):
    _on_two_gloo_ranks(_fsdp_worker, tmp_path, _save_and_load_both_writers)
    assert sorted(os.listdir(tmp_path / "ebb")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for src in ("ebb", "fsw"):
        _load_unsharded(str(tmp_path / src), src)


def _mixed_state():
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(300, 200, generator=g),
        "bf": torch.randn(64, 33, generator=g).bfloat16(),
        "t": torch.randn(7, 5, generator=g).t(),  # non-contiguous, owns its storage
        "slice": torch.arange(100, dtype=torch.int64)[10:30],  # a view of a larger storage
        "empty": torch.zeros(0, 4),
        "step": 17,
        "cfg": {"name": "ebb", "lr": 0.5},
        "list": [torch.ones(3, dtype=torch.int8), "x"],
    }


def _zeros_like_state(s):
    if isinstance(s, torch.Tensor):
        return torch.zeros_like(s.contiguous())
    if isinstance(s, dict):
        return {k: _zeros_like_state(v) for k, v in s.items()}
    if isinstance(s, list):
        return [_zeros_like_state(v) for v in s]
    return type(s)() if not isinstance(s, str) else ""


def _load(path, reader=EbbtideReader):
    out = _zeros_like_state(_mixed_state())
    dcp.load(out, storage_reader=reader(path))
    return out


def test_plugin_and_filesystem_cross_loads(tmp_path):
    sd = _mixed_state()
    dcp.save(sd, storage_writer=EbbtideWriter(tmp_path / "ebb"))
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "fsw"))
    for path, reader in ((tmp_path / "ebb", EbbtideReader), (tmp_path / "ebb", FileSystemReader),
                         (tmp_path / "fsw", EbbtideReader)):
        _assert_bitwise(sd, _load(path, reader), f"{path.name} with {reader.__name__}")
    # Each tensor item is what torch.save writes, at its recorded range.
    md = load_metadata(tmp_path / "ebb")
    raw = (tmp_path / "ebb" / "__0_0.distcp").read_bytes()
    for idx, si in md.storage_data.items():
        if idx.fqn == "w":
            t = torch.load(__import__("io").BytesIO(raw[si.offset:si.offset + si.length]), weights_only=True)
            assert torch.equal(t, sd["w"])
            assert si.transform_descriptors is None


def test_async_save_snapshots_the_state(tmp_path):
    sd = _mixed_state()
    expect = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    w = EbbtideWriter(tmp_path / "a")
    for step in range(2):  # the second save reuses the staged copy and the writer's buffers
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / f"a{step}")
        sd["w"].add_(1.0)  # training goes on: the save holds the state as it was
        fut.result()
        _assert_bitwise(expect, _load(tmp_path / f"a{step}"))
        expect["w"] = sd["w"].clone()


@pytest.fixture
def staging_gate(monkeypatch):
    """Holds the staging thread at Note [Async staging]'s gate: `entered` is
    set when it gets there, and it waits for `go` (then runs `then`, if set)."""
    import threading

    from ebbtide.checkpoint import dcp_format as edcp
    gate = type("Gate", (), {})()
    gate.entered, gate.go, gate.then = threading.Event(), threading.Event(), None

    def hold():
        gate.entered.set()
        gate.go.wait()
        if gate.then is not None:
            gate.then()
    monkeypatch.setitem(edcp._test_gates, "staging", hold)
    yield gate
    gate.go.set()


# Note [Async staging]: async_save returns before the copy; the optimizer step
# waits for it; the checkpoint is the state at async_save().
def test_async_staging_returns_before_the_copy_and_steps_wait_for_it(tmp_path, staging_gate):
    import threading

    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt, 1)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    expect = copy.deepcopy(sd)  # the state at async_save()
    w = EbbtideWriter(tmp_path / "a", async_staging=True)
    try:
        resp = dcp.async_save(sd, storage_writer=w)
        assert isinstance(resp, AsyncSaveResponse)
        assert staging_gate.entered.wait(60)
        assert not resp.staging_completion.done()  # the copy is held at the gate: async_save did not wait for it
        stepped = threading.Event()

        def train():
            _train_step(model, opt, 2)  # its optimizer step must wait for the staging copy
            stepped.set()
        t = threading.Thread(target=train)
        t.start()
        assert not stepped.wait(0.5), "the optimizer step ran while its state was being staged"
        staging_gate.go.set()
        t.join(60)
        assert stepped.is_set()
        resp.staging_completion.result(timeout=60)
        resp.upload_completion.result(timeout=60)
    finally:
        staging_gate.go.set()
        w.close()
    got = _zeros_like_state(sd)
    dcp.load(got, storage_reader=EbbtideReader(tmp_path / "a"))
    _assert_bitwise(expect, got)
    assert not torch.equal(got["model"]["0.weight"], model.state_dict()["0.weight"])  # the step did run after


def test_async_staging_fails_a_save_whose_tensor_changed_while_staged(tmp_path, staging_gate):
    sd = _mixed_state()
    dcp.save(sd, storage_writer=EbbtideWriter(tmp_path / "a"))
    before = _load(tmp_path / "a")
    w = EbbtideWriter(tmp_path / "a", async_staging=True)
    staging_gate.then = lambda: sd["w"].add_(1.0)  # an in-place change the optimizer hook cannot see
    try:
        resp = dcp.async_save(sd, storage_writer=w)
        staging_gate.go.set()  # only now: see the next test for a staging that fails before async_save returns
        with pytest.raises(FAILS, match=r"tensor 'w' was changed in place while it was being staged"):
            resp.staging_completion.result(timeout=60)
        with pytest.raises(FAILS, match="changed in place"):
            resp.upload_completion.result(timeout=60)
    finally:
        w.close()
    _assert_bitwise(before, _load(tmp_path / "a"))  # the last committed checkpoint is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # nothing was reserved or written


# Note [Async staging]: CUDA tensors are staged after the work queued before
# async_save() on the caller's current streams: async_save records an event
# per device on the caller's thread, and the staging thread waits for each
# before it copies. Fake events stand in on the CPU (test_checkpoint_gpu.py
# runs it on a GPU, with the update queued on a side stream).
def test_async_staging_waits_for_the_callers_streams_before_copying(tmp_path, monkeypatch):
    import threading

    from ebbtide.checkpoint import dcp_staging as edcp
    log = []

    class FakeEvent:
        def synchronize(self):
            log.append(("wait", threading.current_thread().name))

    def record(devices):
        log.append(("record", threading.current_thread().name))
        return [FakeEvent(), FakeEvent()]

    stage_now = EbbtideWriter._stage_now

    def copy(self, state_dict, in_buffer):
        log.append(("copy", threading.current_thread().name))
        return stage_now(self, state_dict, in_buffer)
    monkeypatch.setattr(edcp, "_record_callers_streams", record)
    monkeypatch.setattr(EbbtideWriter, "_stage_now", copy)
    sd = _mixed_state()
    w = EbbtideWriter(tmp_path / "a", async_staging=True)
    try:
        dcp.async_save(sd, storage_writer=w).upload_completion.result(timeout=60)
    finally:
        w.close()
    assert log[0] == ("record", threading.current_thread().name), log
    assert [what for what, _ in log[1:]] == ["wait", "wait", "copy"], log
    assert all(thread.startswith("ebbtide-dcp-staging") for _, thread in log[1:]), log
    _assert_bitwise(sd, _load(tmp_path / "a"))


def test_callers_streams_are_recorded_once_per_device(monkeypatch):
    from ebbtide.checkpoint import dcp_staging as edcp

    class FakeEvent:
        def __init__(self, blocking=False):
            self.blocking, self.stream = blocking, None

        def record(self, stream):
            self.stream = stream
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: f"current stream of {d}")
    events = edcp._record_callers_streams({torch.device("cuda", 1), torch.device("cuda", 0)})
    assert [e.stream for e in events] == ["current stream of cuda:0", "current stream of cuda:1"]
    assert all(e.blocking for e in events), "the staging thread sleeps while it waits"
    assert edcp._record_callers_streams(edcp._cuda_devices(_mixed_state())) == []  # CPU state: no CUDA calls


# Note [Device shards]: a CUDA tensor saved from device memory is framed by
# torch.save's bytes for a CPU tensor of its layout, which must be the frame
# of the host copy the other path makes (Tensor.cpu() keeps the strides of
# a dense tensor and makes others contiguous, as clone() does here), so the
# file is the same either way and FileSystemReader loads it onto the CPU.
def test_device_shards_are_framed_like_their_host_copies():
    from ebbtide.checkpoint import dcp_writer as edcp
    base = torch.randn(6, 8)
    for t in (base, base.t(), base[:, 2:5], base[1], base[2:4], torch.arange(10, dtype=torch.int16),
              torch.zeros((), dtype=torch.bfloat16), torch.randn(3, 4, 5).permute(2, 0, 1)):
        device = edcp._owned_storage(t, on_device=True)  # the device path's tensor, were t on a GPU
        host = edcp._owned_storage(t.clone())  # what the host path saves of t.cpu()
        nbytes = host.untyped_storage().nbytes()
        assert device.untyped_storage().nbytes() == nbytes and device.stride() == host.stride()
        assert edcp._torch_frame(edcp._frame_stand_in(device), nbytes) == edcp._torch_frame(host, nbytes)
    assert edcp._device_source(base) is None  # a CPU tensor takes the host path


# torch's async_save reports a staging future that is already done when it
# checks as a success (staging_completion), even if it failed; the upload
# still waits for it and raises. Staged here by making the upload executor
# wait for the staging future before async_save checks it.
def test_async_staging_failing_before_async_save_returns_still_fails_the_upload(tmp_path, staging_gate, monkeypatch):
    import concurrent.futures

    from torch.distributed.checkpoint import state_dict_saver
    executor = state_dict_saver._ThreadBasedAsyncCheckpointExecutor
    execute_save = executor.execute_save

    def execute_after_staging(self, staged, *args, **kwargs):
        if isinstance(staged, concurrent.futures.Future):
            concurrent.futures.wait([staged])
        return execute_save(self, staged, *args, **kwargs)
    monkeypatch.setattr(executor, "execute_save", execute_after_staging)
    sd = _mixed_state()
    dcp.save(sd, storage_writer=EbbtideWriter(tmp_path / "a"))
    before = _load(tmp_path / "a")
    w = EbbtideWriter(tmp_path / "a", async_staging=True)
    staging_gate.then = lambda: sd["w"].add_(1.0)
    staging_gate.go.set()
    try:
        resp = dcp.async_save(sd, storage_writer=w)
        with pytest.raises(FAILS, match=r"tensor 'w' was changed in place while it was being staged"):
            resp.upload_completion.result(timeout=60)
    finally:
        w.close()
    _assert_bitwise(before, _load(tmp_path / "a"))
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


# Device state through every path: sync save, async_save (blocking staging and
# async_staging) and loads into device targets (the buffer path of Note
# [Reading into the targets]). The CPU case runs everywhere; the CUDA case on a GPU.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_device_state_saves_and_loads_bitwise(tmp_path, device):
    g = torch.Generator().manual_seed(9)
    cpu = {"w": torch.randn(300, 1024, generator=g), "bf": torch.randn(64, 33, generator=g).bfloat16(),
           "t": torch.randn(7, 5, generator=g).t(), "i": torch.arange(10), "step": 3}
    sd = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in cpu.items()}
    writers = {"sync": EbbtideWriter(tmp_path / "s"), "async": EbbtideWriter(tmp_path / "a"),
               "staged": EbbtideWriter(tmp_path / "g", async_staging=True)}
    try:
        dcp.save(sd, storage_writer=writers["sync"])
        dcp.async_save(sd, storage_writer=writers["async"]).result()
        resp = dcp.async_save(sd, storage_writer=writers["staged"])
        resp.staging_completion.result(timeout=60)
        resp.upload_completion.result(timeout=60)
    finally:
        writers["staged"].close()
    for name in ("s", "a", "g"):
        out = {k: (torch.zeros_like(v.contiguous()) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
        dcp.load(out, storage_reader=EbbtideReader(tmp_path / name))
        assert all(out[k].device == sd[k].device for k in ("w", "bf", "t", "i")), name
        _assert_bitwise(cpu, {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}, name)


_PROCESS_SAVE = r"""
import sys, tempfile, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from ebbtide.dcp import EbbtideReader, EbbtideWriter

def main(root):
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(dir=root), rank=0, world_size=1)
    try:
        w = EbbtideWriter(root + "/ckpt")
        for step in range(2):  # the checkpoint process keeps running between saves
            sd = {"w": torch.full((256, 1024), float(step)), "b": torch.arange(7) + step, "step": step}
            dcp.async_save(sd, storage_writer=w, async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
            out = {"w": torch.zeros(256, 1024), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
            dcp.load(out, storage_reader=EbbtideReader(root + "/ckpt"))
            assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == step
        print("ok", flush=True)
    finally:
        dist.destroy_process_group()

if __name__ == "__main__":
    main(sys.argv[1])
"""


# Note [Writer in another process]: async_save's process-based checkpointer pickles the writer.
def test_async_save_in_dcp_checkpoint_process(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(_PROCESS_SAVE)
    p = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]


def test_writer_pickles_its_configuration_only(tmp_path):
    w = EbbtideWriter(tmp_path / "a", chunk_bytes=1 << 20, async_staging=True, stripe_dirs=None)
    w.stage(_mixed_state()).result()  # a staged copy and a staging thread exist now
    try:
        back = pickle.loads(pickle.dumps(w))
        assert back.path == w.path and back._options == w._options and back.async_staging
        assert back.state_dict_cache is None and back._stager is None and back._native is not w._native
        assert pickle.loads(pickle.dumps(w))._native is back._native  # one native writer per options here
        dcp.save(_mixed_state(), storage_writer=back)
        _assert_bitwise(_mixed_state(), _load(tmp_path / "a"))
    finally:
        w.close()


class _RecordCopies:
    """Wraps a writer's native object and records what stage() was given."""

    def __init__(self, native):
        self.native, self.copies = native, []

    def __getattr__(self, name):
        return getattr(self.native, name)

    def stage(self, copies):
        self.copies.extend(copies)
        return self.native.stage(copies)


# Note [Staging copy]: stage() gives exactly what torch's _copy_state_dict
# gives, the large plain host tensors copied by the writer's threads.
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "fresh"])
def test_stage_copies_like_torch(tmp_path, cache):
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    g = torch.Generator().manual_seed(3)
    big = torch.randn(1 << 20, generator=g)  # 4 MiB: the writer copies it
    sd = {
        "model": {"w": big, "tied": big, "bf16": torch.randn(1024, 1024, generator=g).bfloat16(),
                  "small": torch.randn(100, generator=g), "strided": torch.randn(1024, 2048, generator=g).t()},
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(600, 600, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.99), "name": "g0"}]},
        "epoch": 3,
    }
    w = EbbtideWriter(tmp_path / "s", cache_staged_state_dict=cache)
    w._native = rec = _RecordCopies(w._native)
    for step in range(2):
        staged = w.stage(sd)
        ref = _copy_state_dict(sd, _create_cpu_state_dict(sd))
        flat, want = {}, {}
        for out, d in ((flat, staged), (want, ref)):
            stack = [("", d)]
            while stack:
                k, v = stack.pop()
                if isinstance(v, dict):
                    stack.extend((f"{k}.{kk}", vv) for kk, vv in v.items())
                elif isinstance(v, (list, tuple)) and not isinstance(v, str):
                    out[k + ".type"] = type(v)
                    stack.extend((f"{k}.{i}", vv) for i, vv in enumerate(v))
                else:
                    out[k] = v
        assert flat.keys() == want.keys()
        for k in want:
            if isinstance(want[k], torch.Tensor):
                assert torch.equal(flat[k], want[k]) and flat[k].dtype == want[k].dtype, k
                assert flat[k].untyped_storage().data_ptr() not in (t.untyped_storage().data_ptr()
                                                                   for t in (big, sd["model"]["bf16"])), k
            else:
                assert flat[k] == want[k], k
        # The 4 MiB, 2 MiB and 1.4 MiB tensors went through the writer (the tied
        # pair once per staged tensor); the small and strided ones did not.
        srcs = {c[1] for c in rec.copies}
        assert {big.data_ptr(), sd["model"]["bf16"].data_ptr(),
                sd["optim"]["state"][0]["exp_avg"].data_ptr()} <= srcs
        assert sd["model"]["small"].data_ptr() not in srcs and sd["model"]["strided"].data_ptr() not in srcs
        rec.copies.clear()
        big.add_(1.0)  # the next stage() sees the change


@pytest.mark.skipif(not _core.ckpt_have_zstd(), reason="this build has no zstd")
def test_compression_round_trip_and_filesystem_reader_refuses(tmp_path):
    sd = _mixed_state()
    sd["zeros"] = torch.zeros(512, 512)
    dcp.save(sd, storage_writer=EbbtideWriter(tmp_path / "z", compress="lossless"))
    dcp.save(sd, storage_writer=EbbtideWriter(tmp_path / "r"))
    z, r = (os.path.getsize(tmp_path / d / "__0_0.distcp") for d in ("z", "r"))
    assert z < r * 0.6
    out = _zeros_like_state(sd)
    dcp.load(out, storage_reader=EbbtideReader(tmp_path / "z"))
    _assert_bitwise(sd, out)
    with pytest.raises(FAILS, match="Unknown extension name='ebbtide-zstd'"):
        dcp.load(_zeros_like_state(sd), storage_reader=FileSystemReader(tmp_path / "z"))


@pytest.mark.parametrize("collectives", [True, False])
def test_a_failing_write_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path, collectives):
    """A write failing part-way (disk full, after several chunks went round
    the save ring): the save raises with the errno's text and the file's
    name, the previous checkpoint loads, the failed save's files are gone at
    once (Note [Failed DCP saves]: this process is the only writer), and the
    same writer saves again."""
    path = tmp_path / "ck"
    w = EbbtideWriter(path, chunk_bytes=64 << 10)

    def save(value):
        dcp.save({"w": torch.full((512, 512), value)}, storage_writer=w, use_collectives=collectives)

    def load():
        out = {"w": torch.zeros(512, 512)}
        dcp.load(out, storage_reader=EbbtideReader(path))
        return out["w"]
    save(1.0)
    files = sorted(os.listdir(path))
    _core.ckpt_inject_write_fault(256 << 10, errno.ENOSPC)
    try:
        with pytest.raises(FAILS) as ei:
            save(2.0)
    finally:
        _core.ckpt_inject_write_fault(0, 0)
    assert os.strerror(errno.ENOSPC) in str(ei.value) and "0.distcp" in str(ei.value), str(ei.value)
    assert torch.equal(load(), torch.full((512, 512), 1.0))
    assert sorted(os.listdir(tmp_path)) == ["ck"] and sorted(os.listdir(path)) == files
    save(3.0)
    assert torch.equal(load(), torch.full((512, 512), 3.0))


_KILLED_SAVE = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from ebbtide import _core
from ebbtide.dcp import EbbtideWriter
path, stage, stripe_dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
w = EbbtideWriter(path, chunk_bytes=64 << 10, queue_depth=1, stripe_dirs=stripe_dirs)
dcp.save({"w": torch.full((512, 512), 1.0)}, storage_writer=w)
if stage == "data":
    _core.ckpt_inject_write_fault(256 << 10, -1)  # park the writer after 256 KiB of the new save
else:
    os.environ["EBBTIDE_DCP_TEST_PARK"] = "before-commit"
print("saving B", flush=True)
dcp.save({"w": torch.full((512, 512), 2.0)}, storage_writer=w)
print("not parked", flush=True)
"""


def _kill_parked_save(script, tmp_path, stage, args):
    """Runs `script` (args: its argv), which parks its second save at `stage`,
    and kills it with SIGKILL there."""
    marker = tmp_path / "parked"
    env = dict(os.environ, EBBTIDE_DCP_TEST_PARK_MARKER=str(marker), EBBTIDE_LOG="warn")
    p = subprocess.Popen([sys.executable, "-c", script] + args, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "saving B"
        if stage == "data":  # the C++ hook says so on stderr once the writer is parked
            while "parked by the test hook" not in (line := p.stderr.readline()):
                assert line, "the save ended without reaching the hook"
        else:
            while not marker.exists():
                assert p.poll() is None, p.stderr.read()
                time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("stage", ["data", "before-commit"])
def test_kill_9_during_save_keeps_previous_checkpoint(tmp_path, stage):
    path = tmp_path / "ck"
    _kill_parked_save(_KILLED_SAVE, tmp_path, stage, [str(path), stage])
    tmps = [d for d in os.listdir(tmp_path) if d.startswith("ck.tmp-")]
    assert len(tmps) == 1  # the killed save's files, never committed
    if stage == "before-commit":
        assert (tmp_path / tmps[0] / ".metadata").exists()
    for reader in (EbbtideReader, FileSystemReader):
        out = {"w": torch.zeros(512, 512)}
        dcp.load(out, storage_reader=reader(path))
        assert torch.equal(out["w"], torch.full((512, 512), 1.0))
    if stage == "data":
        with pytest.raises(FileNotFoundError, match="not a committed checkpoint"):
            load_metadata(tmp_path / tmps[0])
    # The next save of the same path commits and removes the leftovers, and
    # the checkpoint it replaced once join() returns.
    w = EbbtideWriter(path)
    dcp.save({"w": torch.full((512, 512), 3.0)}, storage_writer=w)
    out = {"w": torch.zeros(512, 512)}
    dcp.load(out, storage_reader=EbbtideReader(path))
    assert torch.equal(out["w"], torch.full((512, 512), 3.0))
    w.join()
    assert not [d for d in os.listdir(tmp_path) if d.startswith("ck.tmp-")]
