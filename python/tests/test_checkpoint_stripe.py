"""ebbtide.checkpoint striping over several directories: round trips, missing
and corrupted stripe files, crash safety, cleanup of old stripes."""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ebbtide import _core
from ebbtide import checkpoint as ckpt


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(1 << 20, generator=g), "b": torch.randn(300, generator=g),
                      "h": torch.randn(700, 513, generator=g).bfloat16()},
            "opt": {"m": torch.randn(3 << 18, generator=g), "ids": torch.arange(12345)},
            "step": 7, "name": "x"}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dim() else a,
                                                                           b.view(torch.uint8) if b.dim() else b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _dirs(tmp_path, n):
    out = []
    for i in range(n):
        d = tmp_path / f"ssd{i}"
        d.mkdir()
        out.append(d)
    return out


@pytest.mark.parametrize("nstripes", [1, 2])
@pytest.mark.parametrize("compress", [None, "lossless"])
def test_striped_round_trip_bitwise(tmp_path, nstripes, compress):
    dirs = _dirs(tmp_path, nstripes)
    state = _state()
    w = ckpt.Writer(chunk_bytes=64 << 10)  # many chunks: every file gets data
    info = w.save(state, tmp_path / "c", stripe_dirs=dirs, compress=compress)
    assert len(info["files"]) == nstripes + 1 and all(os.path.getsize(f) > 4096 for f in info["files"])
    idx = json.loads((tmp_path / "c" / "index.json").read_text())
    assert idx["format_version"] == 2 and len(idx["stripes"]) == nstripes
    for d, sd in zip(dirs, idx["stripes"]):
        assert os.path.dirname(sd) == str(d) and os.path.exists(os.path.join(sd, "rank0.ebt"))
    assert _same(state, ckpt.load(tmp_path / "c"))
    out = ckpt.inspect(tmp_path / "c")
    assert out["shards"][0]["problems"] == [] and len(out["shards"][0]["stripe_files"]) == nstripes
    # async striped save too, replacing the previous one: its stripe dirs go
    state2 = _state(1)
    w.save(state2, tmp_path / "c", stripe_dirs=dirs, async_=True, compress=compress).wait()
    assert _same(state2, ckpt.load(tmp_path / "c"))
    for d in dirs:
        assert len(os.listdir(d)) == 1
    # back to unstriped: version 1, stripes removed
    ckpt.save(state, tmp_path / "c")
    assert json.loads((tmp_path / "c" / "index.json").read_text())["format_version"] == 1
    assert all(os.listdir(d) == [] for d in dirs)
    assert _same(state, ckpt.load(tmp_path / "c"))


def test_three_directories_spread_data(tmp_path):
    dirs = _dirs(tmp_path, 2)
    state = {"w": torch.randn(3 << 20)}
    info = ckpt.Writer(chunk_bytes=1 << 20).save(state, tmp_path / "c", stripe_dirs=dirs)
    sizes = [os.path.getsize(f) for f in info["files"]]
    assert all(s >= 4 << 20 for s in sizes), sizes  # 12 chunks of 1 MiB over 3 files
    assert torch.equal(ckpt.load(tmp_path / "c")["w"], state["w"])


def _striped(tmp_path):
    dirs = _dirs(tmp_path, 2)
    ckpt.Writer(chunk_bytes=64 << 10).save(_state(), tmp_path / "c", stripe_dirs=dirs)
    idx = json.loads((tmp_path / "c" / "index.json").read_text())
    return [os.path.join(sd, "rank0.ebt") for sd in idx["stripes"]]


def test_missing_stripe_file_names_file_and_tensor(tmp_path, cli):
    files = _striped(tmp_path)
    os.unlink(files[1])
    with pytest.raises(OSError) as ei:
        ckpt.load(tmp_path / "c")
    msg = str(ei.value)
    assert files[1] in msg and "tensor '" in msg, msg
    p = cli("ckpt", "inspect", str(tmp_path / "c"), check=False)
    assert p.returncode == 1 and files[1] in p.stderr


def test_corrupted_stripe_file_names_file_and_tensor(tmp_path, cli):
    files = _striped(tmp_path)
    r = _core.CkptReader(str(tmp_path / "c" / "rank0.ebt"), stripes=files)
    assert r.stripe_count == 3
    blob = next(b for b in r.blobs if 2 in b["stripes"])
    with open(files[1], "r+b") as fh:
        fh.seek(4096 + 10)
        b = fh.read(1)
        fh.seek(4096 + 10)
        fh.write(bytes([b[0] ^ 0x55]))
    with pytest.raises(ckpt.ChecksumError) as ei:
        ckpt.load(tmp_path / "c")
    assert files[1] in str(ei.value) and "tensor '" in str(ei.value)
    p = cli("ckpt", "inspect", str(tmp_path / "c"), check=False)
    assert p.returncode == 1 and files[1] in p.stderr
    del blob


def test_truncated_or_swapped_stripe_file(tmp_path):
    files = _striped(tmp_path)
    os.truncate(files[0], 100)
    with pytest.raises(ValueError, match="truncated stripe file"):
        ckpt.load(tmp_path / "c")
    with pytest.raises(ValueError, match="stripe file paths are needed"):
        _core.CkptReader(str(tmp_path / "c" / "rank0.ebt"))
    with pytest.raises(ValueError, match="not the shard file"):
        _core.CkptReader(files[1])


def test_bad_stripe_dirs(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ckpt.save({"x": torch.ones(3)}, tmp_path / "c", stripe_dirs=[tmp_path / "nope"])
    with pytest.raises(ValueError, match="list of directories"):
        ckpt.save({"x": torch.ones(3)}, tmp_path / "c", stripe_dirs=str(tmp_path))
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="twice"):
        ckpt.save({"x": torch.ones(3)}, tmp_path / "c", stripe_dirs=[tmp_path / "d", tmp_path / "d"])
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_writer_error_removes_new_stripes(tmp_path):
    dirs = _dirs(tmp_path, 2)
    ckpt.save({"x": torch.ones(10)}, tmp_path / "c", stripe_dirs=dirs)
    before = [sorted(os.listdir(d)) for d in dirs]
    _core.ckpt_inject_write_fault(1 << 16, 28)  # ENOSPC
    try:
        with pytest.raises(OSError):
            ckpt.Writer(chunk_bytes=64 << 10).save({"x": torch.randn(1 << 20)}, tmp_path / "c", stripe_dirs=dirs)
    finally:
        _core.ckpt_inject_write_fault(0, 0)
    assert [sorted(os.listdir(d)) for d in dirs] == before
    assert torch.equal(ckpt.load(tmp_path / "c")["x"], torch.ones(10))


KILL_CHILD = textwrap.dedent("""
    import sys, torch
    from ebbtide import checkpoint
    path, gen, dirs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    w = checkpoint.Writer(chunk_bytes=256 << 10)
    state = {"gen": gen, "w": torch.full((3 << 20,), float(gen)), "b": torch.arange(1000) + gen}
    print("ready", flush=True)
    for i in range(1000):
        state["gen"] = gen + i
        state["w"].fill_(float(gen + i))
        state["b"] = torch.arange(1000) + gen + i
        w.save(state, path, stripe_dirs=dirs, async_=bool(i % 2)).wait() if i % 2 else w.save(state, path, stripe_dirs=dirs)
""")


def test_kill_during_striped_save_leaves_a_complete_checkpoint(tmp_path):
    path = tmp_path / "c"
    dirs = [str(d) for d in _dirs(tmp_path, 2)]
    ckpt.save({"gen": -1, "w": torch.full((3 << 20,), -1.0), "b": torch.arange(1000) - 1}, path, stripe_dirs=dirs)
    rng = random.Random(99)
    for trial in range(5):
        p = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(path), str(trial * 10000)] + dirs,
                             stdout=subprocess.PIPE, env=dict(os.environ))
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.6))
        p.send_signal(signal.SIGKILL)
        p.wait()
        out = ckpt.load(path)
        g = out["gen"]
        assert torch.equal(out["w"], torch.full((3 << 20,), float(g)))
        assert torch.equal(out["b"], torch.arange(1000) + g)
        assert ckpt.inspect(path)["shards"][0]["problems"] == []
    ckpt.save({"x": torch.ones(1)}, path, stripe_dirs=dirs)  # the next save removes stale stripes
    ckpt.join()
    idx = json.loads((path / "index.json").read_text())
    for d, sd in zip(dirs, idx["stripes"]):
        assert os.listdir(d) == [os.path.basename(sd)]
    assert sorted(os.listdir(tmp_path)) == ["c", "ssd0", "ssd1"]


def test_next_save_removes_a_stripe_directory_killed_before_its_owner_file(tmp_path):
    # Note [Stripe ownership]: a save killed between creating its stripe
    # directory and writing owner.json leaves a directory named for the path.
    path = tmp_path / "c"
    dirs = [str(d) for d in _dirs(tmp_path, 2)]
    ckpt.save({"x": torch.ones(8)}, path, stripe_dirs=dirs)
    tag = _core.ckpt_stripe_path_tag(str(path))
    orphan = os.path.join(dirs[0], f"c.stripe-{tag}-deadbeef")
    os.mkdir(orphan)  # no owner.json
    half = os.path.join(dirs[1], f"c.stripe-{tag}-feedface")
    os.mkdir(half)
    with open(os.path.join(half, "owner.json"), "w") as f:
        f.write('{"checkpoint": ')  # cut short
    foreign = os.path.join(dirs[0], "c.stripe-0123abcd-cafe")  # another path's tag, no owner: not ours
    os.mkdir(foreign)
    other = os.path.join(dirs[1], f"c.stripe-{tag}-0ther")  # a tag collision: owner.json names another path
    os.mkdir(other)
    with open(os.path.join(other, "owner.json"), "w") as f:
        json.dump({"checkpoint": str(tmp_path / "elsewhere" / "c"), "id": "0ther"}, f)
    ckpt.save({"x": torch.zeros(8)}, path, stripe_dirs=dirs)
    assert not os.path.exists(orphan) and not os.path.exists(half)
    assert os.path.exists(foreign) and os.path.exists(other)
    assert torch.equal(ckpt.load(path)["x"], torch.zeros(8))
