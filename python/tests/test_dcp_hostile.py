"""torch.distributed.checkpoint with ebbtide's storage plugin, as hostile
input meets it: hostile metadata, corrupt data and checksums, `ebbtide ckpt
inspect` on both writers' checkpoints, saves without collectives, striping
and tampered stripe records. The save/load basics, async_save and kill -9
during a save are in test_dcp.py, whose helpers these tests share."""
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadItemType

from ebbtide import _core
from ebbtide.dcp import EbbtideReader, EbbtideWriter, load_metadata
from test_dcp import (_KILLED_SAVE, _assert_bitwise, _fsdp_worker, _kill_parked_save, _load, _load_sharded,
                      _load_unsharded, _mixed_state, _on_two_gloo_ranks, _zeros_like_state)

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
# dcp.load/save wrap a storage layer's error in CheckpointException (a BaseException) holding its text.
FAILS = (Exception, CheckpointException)



def _rewrite_metadata(path, fn):
    mp_ = os.path.join(path, ".metadata")
    with open(mp_, "rb") as f:
        md = pickle.load(f)  # the test's own file: trusted here
    fn(md)
    with open(mp_, "wb") as f:
        pickle.dump(md, f)


def _set_item(md, fqn, **kw):
    import dataclasses

    for k, si in md.storage_data.items():
        if k.fqn == fqn:
            md.storage_data[k] = dataclasses.replace(si, **kw)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch EVIL_RAN",))


@pytest.mark.parametrize("writer", ["ebb", "fsw"])
def test_hostile_metadata_gives_clear_errors(tmp_path, writer, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sd = _mixed_state()
    make = (lambda p: EbbtideWriter(p)) if writer == "ebb" else (lambda p: FileSystemWriter(p))
    fresh = iter(range(100))

    def case(mutate, error, match):
        # dcp.load wraps the reader's error (CheckpointException, with its message and type name).
        p = tmp_path / f"c{next(fresh)}"
        dcp.save(sd, storage_writer=make(p))
        mutate(p)
        with pytest.raises(FAILS, match=match) as ei:
            _load(p)
        orig = ei.value.failures[0][0] if isinstance(ei.value, CheckpointException) else ei.value
        if isinstance(orig, AssertionError):  # DCP's planning step rewraps read_metadata's error as text
            with pytest.raises(error, match=match):
                load_metadata(p)
        else:
            assert isinstance(orig, error), repr(orig)
        return p

    def code_in_pickle(p):
        _rewrite_metadata(p, lambda md: md.storage_data.update({"x": _Evil()}))

    p = case(code_in_pickle, ValueError, "posix.system, which is not a DCP metadata type")
    assert not (tmp_path / "EVIL_RAN").exists() and p.exists()
    case(lambda p: _rewrite_metadata(p, lambda md: _set_item(md, "w", relative_path="../../etc/passwd")),
         ValueError, "is not a plain file name inside the checkpoint directory")
    case(lambda p: _rewrite_metadata(p, lambda md: _set_item(md, "w", offset=-5)),
         ValueError, "must be integers >= 0")
    big = "lies outside the file" if writer == "fsw" else "not a blob of this shard"
    case(lambda p: _rewrite_metadata(p, lambda md: _set_item(md, "w", offset=1 << 40)), ValueError, big)
    case(lambda p: _rewrite_metadata(p, lambda md: _set_item(md, "w", length=1 << 40)), ValueError, big)
    case(lambda p: _rewrite_metadata(p, lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "sizes",
                                                           torch.Size([301, 200]))),
         ValueError, "does not lie inside the tensor")
    case(lambda p: (p / ".metadata").write_bytes((p / ".metadata").read_bytes()[:200]),
         ValueError, "corrupt DCP metadata")
    case(lambda p: (p / ".metadata").unlink(), FileNotFoundError, "not a committed checkpoint")

    def symlink_data(p):
        (p / "__0_0.distcp").rename(p / "real")
        os.symlink("real", p / "__0_0.distcp")

    case(symlink_data, ValueError, "symbolic link")

    def fifo_data(p):
        (p / "__0_0.distcp").unlink()
        os.mkfifo(p / "__0_0.distcp")

    case(fifo_data, ValueError, "not a regular file")


def _flip_a_byte_of(path, fqn):
    """Flips a byte in the middle of entry `fqn`'s data in checkpoint `path`."""
    md = load_metadata(path)
    (si,) = [s for k, s in md.storage_data.items() if k.fqn == fqn]
    f = path / si.relative_path
    raw = bytearray(f.read_bytes())
    raw[si.offset + si.length // 2] ^= 0xFF
    f.write_bytes(raw)


# Note [Reading into the targets]: whole contiguous tensors are read straight
# into the state being loaded; strided ones and bytes through a buffer of the
# blob. Both bitwise.
def test_load_reads_whole_tensors_into_their_targets(tmp_path, monkeypatch):
    from ebbtide.checkpoint import dcp_format as edcp
    sd = _mixed_state()
    sd["big"] = torch.randn(3, 1 << 20, generator=torch.Generator().manual_seed(4))  # 12 MiB: spans chunks
    dcp.save(sd, storage_writer=EbbtideWriter(tmp_path / "e", chunk_bytes=1 << 20))
    calls = {"parts": [], "whole": []}
    real = edcp._Shard.__init__

    def spying_init(self, *a, **kw):
        real(self, *a, **kw)
        reader = self.reader

        class Spy:
            def __getattr__(self, name):
                return getattr(reader, name)

            def read_parts(self, targets, threads=0):
                calls["parts"].extend(self_.blobs[k]["name"] for k, *_ in targets)
                return reader.read_parts(targets, threads=threads)

            def read(self, targets, threads=0):
                calls["whole"].extend(self_.blobs[k]["name"] for k, *_ in targets)
                return reader.read(targets, threads=threads)
        self_ = self
        self.reader = Spy()
    monkeypatch.setattr(edcp._Shard, "__init__", spying_init)
    out = _zeros_like_state(sd)
    out["big"] = torch.zeros_like(sd["big"])
    targets = {k: out[k].data_ptr() for k in ("w", "bf", "big")}
    dcp.load(out, storage_reader=EbbtideReader(tmp_path / "e"))
    _assert_bitwise(sd, out)
    assert {k: out[k].data_ptr() for k in targets} == targets  # loaded in place
    assert sorted(calls["parts"]) == ["bf", "big", "list.0", "slice", "w"]
    assert "t" in calls["whole"]  # stored transposed: through a buffer
    # A resharded request (rows 1..2 of the stored "big", as a rank of a larger world asks) takes the
    # buffer path.
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
    reader = EbbtideReader(tmp_path / "e")
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    idx = next(k for k in md.storage_data if k.fqn == "big")
    target = torch.zeros(2, 1 << 20)
    req = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("big"), dest_offsets=torch.Size([0, 0]),
                   storage_index=idx, storage_offsets=torch.Size([1, 0]), lengths=torch.Size([2, 1 << 20]))
    committed = []
    planner = type("Planner", (), {"resolve_tensor": lambda self, r: target,
                                   "commit_tensor": lambda self, r, t: committed.append(t)})()
    calls["parts"].clear()
    calls["whole"].clear()
    reader.read_data(LoadPlan([req]), planner).wait()
    assert torch.equal(target, sd["big"][1:3]) and [t.data_ptr() for t in committed] == [target.data_ptr()]
    assert calls == {"parts": [], "whole": ["big"]}


def test_read_parts_refuses_a_range_outside_the_blob(tmp_path):
    sd = _mixed_state()
    dcp.save(sd, storage_writer=EbbtideWriter(tmp_path / "e"))
    r = _core.CkptReader(str(tmp_path / "e" / "__0_0.distcp"))
    k = next(i for i, b in enumerate(r.blobs) if b["name"] == "w")
    n = r.blobs[k]["nbytes"]
    buf = torch.zeros(64, dtype=torch.uint8)
    for off in (n - 63, n, 1 << 62, (1 << 64) - 1):
        with pytest.raises(ValueError, match="its destination asks for 64 at byte"):
            r.read_parts([(k, off, buf.data_ptr(), 64, False, 0)])
    r.read_parts([(k, n - 64, buf.data_ptr(), 64, False, 0)])  # the last 64 bytes: the tail of torch.save's frame
    raw = (tmp_path / "e" / "__0_0.distcp").read_bytes()
    assert bytes(buf.numpy()) in raw


def test_corrupt_plugin_data_fails_its_checksum(tmp_path):
    sd = _mixed_state()
    dcp.save(sd, storage_writer=EbbtideWriter(tmp_path / "c"))
    _flip_a_byte_of(tmp_path / "c", "w")
    with pytest.raises(FAILS, match="crc32c mismatch"):
        _load(tmp_path / "c")


def _inspect(capsys, *args):
    from ebbtide import cli
    rc = cli.main(["ckpt", "inspect", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_inspect_lists_both_writers_and_reports_damage(tmp_path, capsys):
    sd = _mixed_state()
    dcp.save(sd, storage_writer=EbbtideWriter(tmp_path / "ebb"))
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "fsw"))
    for name, writer in (("ebb", "ebbtide"), ("fsw", "FileSystemWriter")):
        rc, out, err = _inspect(capsys, tmp_path / name)
        assert rc == 0, err
        assert "torch.distributed.checkpoint" in out and writer in out and " w " in out, out
        assert "all chunk checksums and ranges OK" in out
    # A flipped byte in ebbtide's file fails its chunk's checksum.
    _flip_a_byte_of(tmp_path / "ebb", "w")
    rc, out, err = _inspect(capsys, tmp_path / "ebb")
    assert rc == 1 and "BAD FILE:" in err and "__0_0.distcp" in err, err
    # A FileSystemWriter file cut short: its ranges lie past the end.
    g = tmp_path / "fsw" / "__0_0.distcp"
    g.write_bytes(g.read_bytes()[:64])
    rc, out, err = _inspect(capsys, tmp_path / "fsw")
    assert rc == 1 and "lies outside the file" in err, err
    # No usable metadata: one line, exit 2.
    (tmp_path / "fsw" / ".metadata").write_bytes(b"\x80\x04junk")
    rc, out, err = _inspect(capsys, tmp_path / "fsw")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err


# Note [DCP without collectives]
def _rank_state(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g).bfloat16(), "step": rank}


def _no_collectives_worker(rank, world, init_file, root, results):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        path = os.path.join(root, "nc")
        ok = True
        for round_ in range(2):  # the second save replaces each rank's first
            sd = _rank_state(rank + 10 * round_)
            dcp.save(sd, storage_writer=EbbtideWriter(path), use_collectives=False)
            dist.barrier()
            for reader in (EbbtideReader, FileSystemReader):
                out = {"w": torch.zeros(64, 32), "b": torch.zeros(7, dtype=torch.bfloat16), "step": -1}
                dcp.load(out, storage_reader=reader(path))
                try:
                    _assert_bitwise(sd, out, f"round {round_} with {reader.__name__}")
                except AssertionError as e:
                    ok = str(e)
            dist.barrier()
        results[rank] = ok
    finally:
        dist.destroy_process_group()


def test_two_ranks_save_and_load_without_collectives(tmp_path):
    _on_two_gloo_ranks(_no_collectives_worker, tmp_path)
    names = sorted(os.listdir(tmp_path / "nc"))
    # One metadata and one data file per rank: the first round's data files are gone.
    assert [n for n in names if n.endswith(".metadata")] == ["__0.metadata", "__1.metadata"], names
    data = [n for n in names if n.endswith(".distcp")]
    assert len(data) == 2 and data[0].startswith("__0_") and data[1].startswith("__1_"), names


def test_one_process_without_collectives_replaces_only_its_own_files(tmp_path):
    path = tmp_path / "nc"
    first = _rank_state(0)
    dcp.save(first, storage_writer=EbbtideWriter(path), use_collectives=False)
    md = load_metadata(path, rank=0)
    (old_data,) = {si.relative_path for si in md.storage_data.values()}
    # Leftovers of a save killed before its commit, and another rank's file.
    (path / "__0_deadbeef_0.distcp").write_bytes(b"partial")
    (path / "__0.metadata.tmp-deadbeef").write_bytes(b"partial")
    (path / "__1.metadata").write_bytes(b"not ours")
    out = {"w": torch.zeros(64, 32), "b": torch.zeros(7, dtype=torch.bfloat16), "step": -1}
    dcp.load(out, storage_reader=EbbtideReader(path))
    _assert_bitwise(first, out, "first save")
    second = _rank_state(5)
    dcp.save(second, storage_writer=EbbtideWriter(path), use_collectives=False)
    names = set(os.listdir(path))
    assert old_data not in names and "__0_deadbeef_0.distcp" not in names, names
    assert "__0.metadata.tmp-deadbeef" not in names and "__1.metadata" in names, names
    for reader in (EbbtideReader, FileSystemReader):
        out = {"w": torch.zeros(64, 32), "b": torch.zeros(7, dtype=torch.bfloat16), "step": -1}
        dcp.load(out, storage_reader=reader(path))
        _assert_bitwise(second, out, reader.__name__)


def test_cli_inspect_reads_a_save_without_collectives(tmp_path, capsys):
    from ebbtide import cli
    path = tmp_path / "nc"
    dcp.save(_rank_state(0), storage_writer=EbbtideWriter(path), use_collectives=False)
    assert cli.main(["ckpt", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0's, saved without collectives" in out and "all chunk checksums and ranges OK" in out, out


# -- striping (Note [DCP striping] in ebbtide/checkpoint/dcp_format.py) ------------------------------------------
def _ssds(root, n=2):
    out = []
    for i in range(n):
        d = os.path.join(root, f"ssd{i}")
        os.makedirs(d, exist_ok=True)
        out.append(d)
    return out


def _striped_save_and_load(state, full, mesh, root):
    path = os.path.join(root, "ebb")
    # Small blobs, a chunk each: every file gets some.
    dcp.save(state, storage_writer=EbbtideWriter(path, stripe_dirs=_ssds(root), chunk_bytes=64 << 10))
    ok = _load_sharded(full, mesh, EbbtideReader(path))
    try:
        _load_sharded(full, mesh, FileSystemReader(path))
        ok = "FileSystemReader read a striped checkpoint"
    except FAILS as e:
        if "Unknown extension name='ebbtide-stripe'" not in str(e):
            ok = f"FileSystemReader failed unclearly: {e}"
    return ok


def test_striped_save_on_two_ranks_loads_on_two_and_one(tmp_path):
    root = str(tmp_path)
    _on_two_gloo_ranks(_fsdp_worker, tmp_path, _striped_save_and_load)
    assert sorted(os.listdir(tmp_path / "ebb")) == [".ebbtide-stripes.json", ".metadata", "__0_0.distcp",
                                                    "__1_0.distcp"]
    for d in _ssds(root):
        (sd,) = os.listdir(d)
        assert sd.startswith(f"ebb.stripe-{_core.ckpt_stripe_path_tag(str(tmp_path / 'ebb'))}-"), sd
        files = sorted(os.listdir(os.path.join(d, sd)))
        assert files == ["__0_0.distcp", "__1_0.distcp", "owner.json"], files
        assert all(os.path.getsize(os.path.join(d, sd, f)) > 4096 for f in files[:2])  # data beyond the superblock
    _load_unsharded(str(tmp_path / "ebb"))


def _plant(path, owner=None):
    os.makedirs(path)
    with open(os.path.join(path, "keep.txt"), "w") as f:
        f.write("mine")
    if owner is not None:
        with open(os.path.join(path, "owner.json"), "w") as f:
            f.write(owner)
    return path


def _intact(path):
    with open(os.path.join(path, "keep.txt")) as f:
        return f.read() == "mine"


def test_striped_overwrite_leaves_no_stale_stripes_and_spares_foreign_dirs(tmp_path):
    path, ssds = tmp_path / "ck", _ssds(str(tmp_path))
    tag = _core.ckpt_stripe_path_tag(str(path))
    sd = _mixed_state()
    dcp.save(sd, storage_writer=EbbtideWriter(path, stripe_dirs=ssds, chunk_bytes=64 << 10))
    first = [os.listdir(d) for d in ssds]
    foreign = [_plant(os.path.join(ssds[0], "precious")),
               _plant(os.path.join(ssds[0], "ck.stripe-0123abcd-cafe")),  # another path's tag
               _plant(os.path.join(ssds[1], f"ck.stripe-{tag}-0ther"),    # a tag collision: another owner
                      '{"checkpoint": "/elsewhere/ck", "id": "0ther"}')]
    stale = _plant(os.path.join(ssds[1], f"ck.stripe-{tag}-dead"))  # a killed save's, before its owner.json
    sd["w"].add_(1.0)
    dcp.save(sd, storage_writer=EbbtideWriter(path, stripe_dirs=ssds, chunk_bytes=64 << 10))
    assert all(_intact(f) for f in foreign) and not os.path.exists(stale)
    for d, old in zip(ssds, first):
        ours = [n for n in os.listdir(d) if n.startswith(f"ck.stripe-{tag}-") and n != f"ck.stripe-{tag}-0ther"]
        assert len(ours) == 1 and ours != old, os.listdir(d)
    _assert_bitwise(sd, _load(path))
    # Unstriped again: our stripe directories go, the checkpoint loads with both readers.
    dcp.save(sd, storage_writer=EbbtideWriter(path))
    assert sorted(os.listdir(ssds[0])) == ["ck.stripe-0123abcd-cafe", "precious"]
    assert os.listdir(ssds[1]) == [f"ck.stripe-{tag}-0ther"]
    assert all(_intact(f) for f in foreign)
    for reader in (EbbtideReader, FileSystemReader):
        _assert_bitwise(sd, _load(path, reader), reader.__name__)
    with pytest.raises(FAILS, match="stripe_dirs needs a save with collectives"):
        dcp.save(sd, storage_writer=EbbtideWriter(path, stripe_dirs=ssds), use_collectives=False)


@pytest.mark.parametrize("collectives", [True, False])
def test_one_writer_and_one_reader_serve_many_saves_and_loads(tmp_path, collectives):
    """A training loop's habit: one EbbtideWriter and one EbbtideReader kept
    for the run, dcp.save/load without checkpoint_id (so DCP never calls
    reset): every save gets a new id and new stripe directories, and every
    load reads the checkpoint as it is now, not the stripes of an earlier one."""
    path, ssds = tmp_path / "ck", _ssds(str(tmp_path))
    writer = EbbtideWriter(path, stripe_dirs=ssds if collectives else None, chunk_bytes=64 << 10)
    reader = EbbtideReader(path)
    sd = _mixed_state()
    for step in range(3):
        sd["w"].add_(1.0)
        dcp.save(sd, storage_writer=writer, use_collectives=collectives)
        out = _zeros_like_state(_mixed_state())
        dcp.load(out, storage_reader=reader)
        _assert_bitwise(sd, out, f"save {step}")
    if collectives:
        assert all(len(os.listdir(d)) == 1 for d in ssds), [os.listdir(d) for d in ssds]
    else:
        assert len([n for n in os.listdir(path) if n.endswith(".distcp")]) == 1, os.listdir(path)


@pytest.mark.parametrize("stage", ["data", "before-commit"])
def test_kill_9_during_striped_save_keeps_previous_checkpoint(tmp_path, stage):
    path, ssds = tmp_path / "ck", _ssds(str(tmp_path))
    _kill_parked_save(_KILLED_SAVE, tmp_path, stage, [str(path), stage] + ssds)
    assert len([d for d in os.listdir(tmp_path) if d.startswith("ck.tmp-")]) == 1
    assert all(len(os.listdir(d)) == 2 for d in ssds)  # the committed stripes and the killed save's
    out = {"w": torch.zeros(512, 512)}
    dcp.load(out, storage_reader=EbbtideReader(path))
    assert torch.equal(out["w"], torch.full((512, 512), 1.0))
    # The next save commits and removes the killed save's directories and the replaced stripes.
    dcp.save({"w": torch.full((512, 512), 3.0)}, storage_writer=EbbtideWriter(path, stripe_dirs=ssds))
    out = {"w": torch.zeros(512, 512)}
    dcp.load(out, storage_reader=EbbtideReader(path))
    assert torch.equal(out["w"], torch.full((512, 512), 3.0))
    assert not [d for d in os.listdir(tmp_path) if d.startswith("ck.tmp-")]
    assert all(len(os.listdir(d)) == 1 for d in ssds)


@pytest.mark.parametrize("how", ["outside", "symlink", "no-owner"])
def test_tampered_stripe_path_is_refused_naming_it(tmp_path, how, capsys):
    import json
    import shutil

    from ebbtide import cli
    path, ssds = tmp_path / "ck", _ssds(str(tmp_path))
    sd = _mixed_state()
    dcp.save(sd, storage_writer=EbbtideWriter(path, stripe_dirs=ssds, chunk_bytes=64 << 10))
    rp = path / ".ebbtide-stripes.json"
    rec = json.loads(rp.read_text())
    real = rec["stripes"][1]
    assert cli.main(["ckpt", "inspect", str(path)]) == 0  # every chunk verified, in the stripe files too
    out = capsys.readouterr().out
    assert f"stripe file {os.path.join(real, '__0_0.distcp')}" in out and "checksums and ranges OK" in out, out
    name = os.path.basename(real)
    if how == "outside":  # a copy of the stripe files in a directory of another name
        bad = str(tmp_path / "precious")
        shutil.copytree(real, bad)
    elif how == "symlink":  # the right name, a link to the real stripe directory
        os.makedirs(tmp_path / "links")
        bad = str(tmp_path / "links" / name)
        os.symlink(real, bad)
    else:  # the right name and files, no owner.json
        os.makedirs(tmp_path / "copy")
        bad = str(tmp_path / "copy" / name)
        shutil.copytree(real, bad)
        os.unlink(os.path.join(bad, "owner.json"))
    rec["stripes"][1] = bad
    rp.write_text(json.dumps(rec))
    with pytest.raises(FAILS, match=f"stripes entry '{bad}' is not a stripe directory"):
        _load(path)
    assert cli.main(["ckpt", "inspect", str(path)]) == 1
    assert bad in capsys.readouterr().err
    # The next save removes what it owns only: the real stripe directory, now unreferenced, not the planted one.
    kept = sorted(os.listdir(bad))
    dcp.save(sd, storage_writer=EbbtideWriter(path, stripe_dirs=ssds))
    assert os.path.lexists(bad) and not os.path.exists(real)
    if how != "symlink":
        assert sorted(os.listdir(bad)) == kept
