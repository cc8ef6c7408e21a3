"""ebbtide.checkpoint: round trips, sharing, crash safety, corruption, errors."""
import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ebbtide import _core
from ebbtide import checkpoint as ckpt

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def make(dtype, shape=(37, 53), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        if dtype.itemsize == 1:
            return torch.randn(shape, generator=g).to(dtype)
        return torch.randn(shape, generator=g, dtype=torch.float32 if not dtype.is_complex else torch.complex64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                                                                          b.reshape(-1).contiguous().view(torch.uint8))


@pytest.mark.parametrize("compress", [None, "lossless"])
def test_every_dtype_round_trips_bitwise(tmp_path, compress):
    state = {str(d): make(d, seed=i) for i, d in enumerate(DTYPES)}
    state["nan"] = torch.tensor([float("nan"), -0.0, float("inf")])
    ckpt.save(state, tmp_path / "c", compress=compress)
    out = ckpt.load(tmp_path / "c")
    assert set(out) == set(state)
    for k in state:
        assert same(out[k], state[k]), k


def test_views_share_storage_saved_once(tmp_path):
    big = torch.randn(512, 1024)  # 2 MiB
    state = {"w": big, "t": big.t(), "row": big[3], "col": big[:, 5], "slice": big[10:20, ::3],
             "other": torch.zeros(4)}
    info = ckpt.save(state, tmp_path / "c")
    assert info["raw_bytes"] == big.numel() * 4 + 16          # storage stored once
    assert os.path.getsize(tmp_path / "c" / "rank0.ebt") < big.numel() * 4 + 64 * 1024
    out = ckpt.load(tmp_path / "c")
    ptr = out["w"].untyped_storage().data_ptr()
    for k in ("t", "row", "col", "slice"):
        assert out[k].untyped_storage().data_ptr() == ptr, k
        assert out[k].stride() == state[k].stride() and out[k].storage_offset() == state[k].storage_offset()
        assert torch.equal(out[k], state[k])
    out["w"][3, 0] = 42.0
    assert out["row"][0] == 42.0  # views alias as before


def test_noncontiguous_empty_and_nested(tmp_path):
    x = torch.randn(6, 8, 10)
    state = {"perm": x.permute(2, 0, 1), "strided": x[:, ::2, 1::3], "expand": torch.randn(3, 1).expand(3, 5),
             "empty": torch.empty(0, 7), "scalar": torch.tensor(3.5), "nested": {
                 "list": [1, 2.5, "s", None, True, {"deep": (torch.arange(5), "x")}],
                 "tuple": (1, (2, 3)), 7: "int key", "inf": float("-inf")},
             "dtype": torch.bfloat16, "device": torch.device("cpu"), "param": torch.nn.Parameter(torch.ones(3))}
    ckpt.save(state, tmp_path / "c")
    out = ckpt.load(tmp_path / "c")
    for k in ("perm", "strided", "expand", "empty", "scalar"):
        assert same(out[k], state[k]) and out[k].stride() == state[k].stride(), k
    assert out["nested"]["list"][:5] == [1, 2.5, "s", None, True]
    assert torch.equal(out["nested"]["list"][5]["deep"][0], torch.arange(5))
    assert out["nested"]["tuple"] == (1, (2, 3)) and out["nested"][7] == "int key"
    assert out["nested"]["inf"] == float("-inf")
    assert out["dtype"] is torch.bfloat16 and out["device"] == torch.device("cpu")
    assert isinstance(out["param"], torch.nn.Parameter)


def test_sparse_coo(tmp_path):
    s = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), torch.tensor([3.0, 4.0]), (3, 3))
    ckpt.save({"s": s}, tmp_path / "c")
    assert torch.equal(ckpt.load(tmp_path / "c")["s"].to_dense(), s.to_dense())


def test_replaces_existing_checkpoint_and_leaves_no_temporaries(tmp_path):
    ckpt.save({"v": torch.ones(10)}, tmp_path / "c")
    ckpt.save({"v": torch.full((10,), 2.0)}, tmp_path / "c")
    assert torch.equal(ckpt.load(tmp_path / "c")["v"], torch.full((10,), 2.0))
    ckpt.join()  # the replaced checkpoint is removed after save() returns
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_unsupported_object_names_the_key(tmp_path):
    with pytest.raises(TypeError, match=r"state\.model\.layer.*object"):
        ckpt.save({"model": {"layer": object()}}, tmp_path / "c")
    assert not os.path.exists(tmp_path / "c")
    assert os.listdir(tmp_path) == []


def test_load_into_module_checks_shapes(tmp_path):
    m = torch.nn.Linear(4, 3)
    ckpt.save(m.state_dict(), tmp_path / "c")
    m2 = torch.nn.Linear(4, 3)
    ckpt.load(tmp_path / "c", into=m2)
    assert torch.equal(m2.weight, m.weight)
    with pytest.raises(ValueError, match=r"'weight'.*\(3, 4\).*\(5, 4\)"):
        ckpt.load(tmp_path / "c", into=torch.nn.Linear(4, 5))
    target = {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}
    ckpt.load(tmp_path / "c", into=target)
    assert torch.equal(target["bias"], m.bias.detach())
    with pytest.raises(ValueError, match="bias"):
        ckpt.load(tmp_path / "c", into={"weight": torch.zeros(3, 4), "bias": torch.zeros(2)})


def test_async_save_handle_and_second_save_in_flight(tmp_path):
    w = ckpt.Writer()
    x = torch.randn(1 << 20)
    h = w.save({"x": x}, tmp_path / "a", async_=True)
    x.zero_()  # after the snapshot: must not change what is written
    try:
        w.save({"x": x}, tmp_path / "b", async_=True)
        second = "accepted"  # the first finished already (fast disk): allowed
    except ckpt.StateError as e:
        assert "in flight" in str(e)
        second = "raised"
        assert not os.path.exists(tmp_path / "b")
    info = h.wait()
    assert h.done() and info["raw_bytes"] == x.numel() * 4
    assert not torch.equal(ckpt.load(tmp_path / "a")["x"], x)
    h2 = w.save({"x": x}, tmp_path / "b", async_=True, block=True)
    h2.wait()
    assert torch.equal(ckpt.load(tmp_path / "b")["x"], x)
    assert second in ("accepted", "raised")


def test_second_async_save_raises_while_in_flight(tmp_path):
    # The shard's writes are held (ckpt_hold_writes), so the first save is in
    # flight whatever the disk's speed; it used to rely on a slow compressed
    # save and skip when the first had finished. Compressed, because a fresh
    # writer's first uncompressed async save is written through while its
    # caller waits (Note [First async save]).
    w = ckpt.Writer(threads=1)
    x = torch.randn(2 << 20)
    # Should a save wait for its own held writes, the guard lets them go after
    # a minute and the test fails instead of hanging.
    guard = threading.Timer(60, _core.ckpt_hold_writes, (False,))
    _core.ckpt_hold_writes(True)
    guard.start()
    try:
        h = w.save({"x": x}, tmp_path / "a", async_=True, compress="lossless")
        assert not h.done()
        with pytest.raises(ckpt.StateError, match="still in flight"):
            w.save({"x": x}, tmp_path / "b", async_=True)
        assert not h.done()
    finally:
        guard.cancel()
        _core.ckpt_hold_writes(False)
    h.wait()
    assert torch.equal(ckpt.load(tmp_path / "a")["x"], x)
    assert not os.path.exists(tmp_path / "b")


def test_writer_error_propagates_and_nothing_visible(tmp_path):
    ckpt.save({"x": torch.ones(4)}, tmp_path / "c")
    _core.ckpt_inject_write_fault(0, errno.ENOSPC)
    try:
        h = ckpt.save({"x": torch.randn(1 << 20)}, tmp_path / "c", async_=True)
        with pytest.raises(OSError) as ei:
            h.wait()
        assert ei.value.errno == errno.ENOSPC and "rank0.ebt" in str(ei.value)
    finally:
        _core.ckpt_inject_write_fault(0, 0)
    assert torch.equal(ckpt.load(tmp_path / "c")["x"], torch.ones(4))
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_save_over_a_file_fails_before_writing(tmp_path):
    (tmp_path / "c").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="the path exists and is not a directory") as ei:
        ckpt.save({"x": torch.randn(1 << 20)}, tmp_path / "c")
    assert ei.value.filename == str(tmp_path / "c")
    assert sorted(os.listdir(tmp_path)) == ["c"] and (tmp_path / "c").read_text() == "not a checkpoint"


def test_read_only_directory(tmp_path):
    # Root ignores directory permissions (CI runs as root): there the directory
    # is a read-only tmpfs instead, which refuses root's writes too.
    if os.geteuid() != 0:
        os.chmod(tmp_path, 0o500)
        try:
            with pytest.raises(OSError, match="temporary directory"):
                ckpt.save({"x": torch.ones(4)}, tmp_path / "c")
        finally:
            os.chmod(tmp_path, 0o700)
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"root ignores directory permissions, and no read-only tmpfs: {r.stderr.decode().strip()}")
    try:
        with pytest.raises(OSError, match="temporary directory") as ei:
            ckpt.save({"x": torch.ones(4)}, ro / "c")
        assert ei.value.errno == errno.EROFS, ei.value
        assert os.listdir(ro) == []
    finally:
        subprocess.run(["umount", str(ro)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_full_filesystem(small_tmpfs):
    ckpt.save({"x": torch.ones(1000)}, small_tmpfs / "c")
    with pytest.raises(OSError) as ei:
        ckpt.save({"x": torch.randn(1 << 20)}, small_tmpfs / "c")  # 4 MiB > 2 MiB
    assert ei.value.errno == errno.ENOSPC
    assert torch.equal(ckpt.load(small_tmpfs / "c")["x"], torch.ones(1000))
    assert sorted(os.listdir(small_tmpfs)) == ["c"]


def test_read_only_filesystem(small_tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(OSError, match="read-only"):
        ckpt.save({"x": torch.ones(4)}, small_tmpfs / "c")


def _save_small(tmp_path, **kw):
    state = {"a": torch.randn(300, 1000), "b": torch.arange(100)}
    ckpt.save(state, tmp_path / "c", **kw)
    return state, tmp_path / "c" / "rank0.ebt"


def _chunk_offset(file, name):
    r = _core.CkptReader(str(file))
    return next(b["offset"] for b in r.blobs if b["name"] == name)


@pytest.mark.parametrize("compress", [None, "lossless"])
def test_corrupted_chunk_names_tensor_and_offset(tmp_path, compress, cli):
    state, f = _save_small(tmp_path, compress=compress)
    off = _chunk_offset(f, "state.a")
    with open(f, "r+b") as fh:
        fh.seek(off + 100)
        b = fh.read(1)
        fh.seek(off + 100)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ckpt.ChecksumError) as ei:
        ckpt.load(tmp_path / "c")
    assert "state.a" in str(ei.value) and ei.value.offset == off
    p = cli("ckpt", "inspect", str(tmp_path / "c"), check=False)
    assert p.returncode == 1
    assert "state.a" in p.stderr and str(off) in p.stderr


def test_truncated_file(tmp_path):
    state, f = _save_small(tmp_path)
    size = os.path.getsize(f)
    os.truncate(f, size - 8192)
    with pytest.raises(ValueError, match="truncated"):
        ckpt.load(tmp_path / "c")
    os.truncate(f, 10)
    with pytest.raises(ValueError, match="truncated"):
        ckpt.load(tmp_path / "c")


def test_truncated_data_names_tensor(tmp_path):
    state, f = _save_small(tmp_path)
    # Keep the header and superblock but cut data: rewrite a file whose tail was zeroed is not
    # truncation; instead shrink the file and move the header is impossible, so corrupt the
    # chunk table's offset via the reader's view: a chunk past the end.
    off = _chunk_offset(f, "state.b")
    with open(f, "r+b") as fh:
        fh.seek(off)
        fh.write(b"\0" * 16)
    with pytest.raises(ckpt.ChecksumError, match="state.b"):
        ckpt.load(tmp_path / "c")


def test_future_format_version(tmp_path):
    _save_small(tmp_path)
    f = tmp_path / "c" / "rank0.ebt"
    import struct
    with open(f, "r+b") as fh:
        sb = bytearray(fh.read(64))
        sb[16:20] = struct.pack("<I", 99)
        sb[56:60] = struct.pack("<I", _core.crc32c(bytes(sb[:56])))
        fh.seek(0)
        fh.write(sb)
    with pytest.raises(NotImplementedError, match="version 99"):
        ckpt.load(tmp_path / "c")
    idx = json.loads((tmp_path / "c" / "index.json").read_text())
    idx["format_version"] = 99
    (tmp_path / "c" / "index.json").write_text(json.dumps(idx))
    with pytest.raises(NotImplementedError, match="version 99"):
        ckpt.load(tmp_path / "c")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "c").mkdir()
    with pytest.raises(FileNotFoundError, match="index.json"):
        ckpt.load(tmp_path / "c")


KILL_CHILD = textwrap.dedent("""
    import sys, torch
    from ebbtide import checkpoint
    path, gen = sys.argv[1], int(sys.argv[2])
    state = {"gen": gen, "w": torch.full((3 << 20,), float(gen)), "b": torch.arange(1000) + gen}
    print("ready", flush=True)
    for i in range(1000):
        state["gen"] = gen + i
        state["w"].fill_(float(gen + i))
        state["b"] = torch.arange(1000) + gen + i
        checkpoint.save(state, path, compress="lossless" if i % 2 else None)
""")


def test_kill_during_save_leaves_a_complete_checkpoint(tmp_path):
    path = tmp_path / "c"
    ckpt.save({"gen": -1, "w": torch.full((3 << 20,), -1.0), "b": torch.arange(1000) - 1}, path)
    rng = random.Random(1234)
    env = dict(os.environ)
    for trial in range(5):
        p = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(path), str(trial * 10000)],
                             stdout=subprocess.PIPE, env=env)
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.6))
        p.send_signal(signal.SIGKILL)
        p.wait()
        out = ckpt.load(path)
        g = out["gen"]
        assert torch.equal(out["w"], torch.full((3 << 20,), float(g)))
        assert torch.equal(out["b"], torch.arange(1000) + g)
        assert not _core.CkptReader(str(path / "rank0.ebt")).verify()
        for name in os.listdir(tmp_path):
            assert name == "c" or name.startswith("c.tmp-"), name
    ckpt.save({"x": torch.ones(1)}, path)  # the next save removes stale temporaries
    ckpt.join()
    assert os.listdir(tmp_path) == ["c"]


def test_cli_inspect_lists_tensors(tmp_path, cli):
    _save_small(tmp_path, compress="lossless")
    p = cli("ckpt", "inspect", str(tmp_path / "c"))
    assert "state.a" in p.stdout and "float-zstd" in p.stdout and "all chunk checksums OK" in p.stdout
    j = json.loads(cli("ckpt", "inspect", "--json", str(tmp_path / "c")).stdout)
    assert j["shards"][0]["problems"] == []


def test_lossless_ratio_on_bf16_weights(tmp_path):
    x = (torch.randn(1 << 20) * 0.02).bfloat16()
    info = ckpt.save({"w": x}, tmp_path / "c", compress="lossless")
    assert info["ratio"] >= 1.4, info["ratio"]
    assert same(ckpt.load(tmp_path / "c")["w"], x)


def test_lossy_delta_error_reported_and_bounded(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def steps(n):
        for _ in range(n):
            m(torch.randn(16, 128)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    steps(3)
    ckpt.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "base", compress="lossless")
    steps(3)
    exact = {"model": {k: v.clone() for k, v in m.state_dict().items()}}
    base = ckpt.load(tmp_path / "base")
    info = ckpt.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "d",
                     compress="delta", base=tmp_path / "base")
    err = info["error"]
    assert err["overall"]["tensors"] >= 4 and info["ratio"] > 3
    out = ckpt.load(tmp_path / "d")
    for k, w in exact["model"].items():
        got = out["model"][k]
        e = err["tensors"].get(f"state.model.{k}")
        if e is None:
            assert torch.equal(got, w), k
            continue
        d = (got - w).abs()
        assert abs(float(d.max()) - e["max_abs"]) <= 1e-6
        # bounded: the error never exceeds the residual it approximates
        resid = (w - base["model"][k]).norm()
        assert float(d.norm()) <= float(resid) + 1e-6
        assert e["rel_l2"] < 0.05
    assert json.loads(_core.CkptReader(str(tmp_path / "d" / "rank0.ebt")).meta)["lossy_error"] == err
    with pytest.raises(ValueError, match="base"):
        ckpt.save({"x": torch.ones(3)}, tmp_path / "e", compress="delta")
