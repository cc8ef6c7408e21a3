"""Loading checkpoints written by an attacker (docs/checkpoints.md, "Threat
model"): crafted tables and metadata with valid checksums, paths leading out
of the checkpoint, special files, malformed index fields, and a seeded
mutation sweep. Each must raise a typed error (ValueError, OSError,
NotImplementedError) naming the file, never crash, hang or return other data."""
import json
import os
import random
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from ebbtide import _core
from ebbtide import checkpoint as ckpt

TYPED = (ValueError, OSError, NotImplementedError)


def _state():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3000, generator=g)
    return {"a": torch.randn(1000, generator=g), "b": torch.arange(5000, dtype=torch.int64),
            "view": base[10:2010:2], "base": base, "step": 7, "names": ["x", ("y", 2.5)]}


def _save(tmp_path, name="c", compress=None):
    state = _state()
    ckpt.save(state, tmp_path / name, compress=compress)
    return state, tmp_path / name


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and
                torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class Shard:
    """A shard file's superblock, tables and metadata, re-encoded with valid
    checksums (docs/checkpoint-format.md)."""

    def __init__(self, path):
        self.path = path
        self.data = bytearray(open(path, "rb").read())
        self.h, hlen = struct.unpack_from("<QQ", self.data, 24)
        hdr = bytes(self.data[self.h:self.h + hlen])
        nb, nc, names_bytes, meta_bytes = struct.unpack_from("<IIQQ", hdr, 8)
        self.blobs = [list(struct.unpack_from("<QIIIIHHI", hdr, 32 + i * 32)) for i in range(nb)]
        self.chunks = [list(struct.unpack_from("<QQIIIIHHI", hdr, 32 + nb * 32 + i * 40)) for i in range(nc)]
        t = 32 + nb * 32 + nc * 40
        self.names = hdr[t:t + names_bytes]
        self.meta = json.loads(hdr[t + names_bytes:])

    def write(self, fix_chunk_crcs=False):
        if fix_chunk_crcs:
            for c in self.chunks:
                off, stored = c[0], c[3]
                if c[7] == 0 and off + stored <= self.h:
                    c[4] = _core.crc32c(bytes(self.data[off:off + stored]))
        meta = json.dumps(self.meta).encode()
        hdr = b"EBBHDR01" + struct.pack("<IIQQ", len(self.blobs), len(self.chunks), len(self.names), len(meta))
        hdr += b"".join(struct.pack("<QIIIIHHI", *b) for b in self.blobs)
        hdr += b"".join(struct.pack("<QQIIIIHHI", *c) for c in self.chunks)
        hdr += self.names + meta
        pad = -len(hdr) % 4096
        data = self.data[:self.h] + hdr + b"\0" * pad
        struct.pack_into("<QQI", data, 32, len(hdr), len(data), _core.crc32c(hdr))
        struct.pack_into("<I", data, 56, _core.crc32c(bytes(data[:56])))
        with open(self.path, "wb") as f:
            f.write(data)


def _edit_index(path, fn):
    ip = path / "index.json"
    idx = json.loads(ip.read_text())
    idx = fn(idx) or idx
    ip.write_text(json.dumps(idx))


def _blob_of(shard, name):
    return next(i for i, b in enumerate(shard.blobs)
                if shard.names[b[3]:b[3] + b[4]].decode() == name)


# --- crafted tables, valid checksums -----------------------------------------------------------

def test_chunk_of_another_blob_is_refused(tmp_path):
    _, c = _save(tmp_path)
    s = Shard(c / "rank0.ebt")
    a, b = _blob_of(s, "state.a"), _blob_of(s, "state.b")
    s.blobs[a][1], s.blobs[b][1] = s.blobs[b][1], s.blobs[a][1]  # swap first_chunk
    s.blobs[a][2], s.blobs[b][2] = s.blobs[b][2], s.blobs[a][2]
    s.write()
    with pytest.raises(ValueError, match="rank0.ebt.*belongs to blob"):
        ckpt.load(c)


@pytest.mark.parametrize("raw_offset", [2**64 - 4096, 2**64 - 1, 2**63])
def test_raw_offset_near_2_to_64_is_refused(tmp_path, raw_offset):
    _, c = _save(tmp_path)
    s = Shard(c / "rank0.ebt")
    s.chunks[0][1] = raw_offset
    s.write()
    with pytest.raises(ValueError, match="rank0.ebt.*covers bytes at"):
        ckpt.load(c)


def test_blob_without_chunks_is_refused(tmp_path):
    _, c = _save(tmp_path)
    s = Shard(c / "rank0.ebt")
    b = _blob_of(s, "state.b")
    s.blobs[b][2] = 0  # no chunks: the storage would come back uninitialised
    del s.chunks[s.blobs[b][1]]
    for other in s.blobs:
        if other[1] > s.blobs[b][1]:
            other[1] -= 1
    s.write()
    with pytest.raises(ValueError, match="cover 0 of its 40000 bytes"):
        ckpt.load(c)


def test_shape_larger_than_storage_is_refused(tmp_path):
    _, c = _save(tmp_path)
    s = Shard(c / "rank0.ebt")
    t = next(t for t in s.meta["tensors"] if t["path"] == "state.a")
    t["shape"] = [1 << 31]  # 8 GiB of float32 over a 4000-byte storage
    s.write()
    with pytest.raises(ValueError, match="state.a.*reach byte 8589934592 of storage"):
        ckpt.load(c)
    with pytest.raises(ValueError, match="reach byte"):
        ckpt.load(c, into={"a": torch.zeros(1000)}, strict=False)


@pytest.mark.parametrize("ref", [-1, True, 99, "0", 1.0, None])
def test_tree_refers_only_to_existing_tensors(tmp_path, ref):
    _, c = _save(tmp_path)
    s = Shard(c / "rank0.ebt")
    s.meta["tree"] = {"dict": [["a", {"tensor": ref}]]}
    s.write()
    with pytest.raises(ValueError, match="rank0.ebt.*(refers to tensor|corrupt object tree)"):
        ckpt.load(c)


@pytest.mark.parametrize("edit", [
    lambda m: m["storages"][0].update(nbytes=10**30),
    lambda m: m["storages"][0].update(blob=-1),
    lambda m: m["storages"][0].update(device="meta"),
    lambda m: m["tensors"][0].update(stride=[-1]),
    lambda m: m["tensors"][0].update(offset=2**70),
    lambda m: m["tensors"][0].update(storage=True),
    lambda m: m["tensors"][0].update(dtype="pickle"),
    lambda m: m["tensors"].append({"layout": "sparse_coo", "shape": [3], "indices": 99, "values": 0, "path": "p"}),
    lambda m: m.update(tree={"dict": [[{"dict": []}, 1]]}),
    lambda m: m.update(tree={"dict": "no"}),
    lambda m: m.update(storages="no"),
    lambda m: m.pop("tree"),
], ids=["nbytes", "blob", "device", "stride", "offset", "storage-bool", "dtype", "sparse", "unhashable-key",
        "dict-not-list", "storages-type", "no-tree"])
def test_malformed_metadata_is_a_value_error(tmp_path, edit):
    _, c = _save(tmp_path)
    s = Shard(c / "rank0.ebt")
    edit(s.meta)
    s.write()
    with pytest.raises(ValueError, match="rank0.ebt"):
        ckpt.load(c)


def test_sparse_indices_outside_the_shape_are_refused(tmp_path):
    sp = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True)
    ckpt.save({"s": sp}, tmp_path / "c")
    s = Shard(tmp_path / "c" / "rank0.ebt")
    next(t for t in s.meta["tensors"] if t.get("layout") == "sparse_coo")["shape"] = [2]
    s.write()
    with pytest.raises(ValueError, match="sparse tensor"):
        ckpt.load(tmp_path / "c")


# --- paths named by metadata ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../outside/rank0.ebt", "/etc/passwd", "..", ".", "", "sub/rank0.ebt", 0])
def test_shard_paths_are_confined_to_the_checkpoint(tmp_path, name):
    _, c = _save(tmp_path)
    (tmp_path / "outside").mkdir()
    os.link(c / "rank0.ebt", tmp_path / "outside" / "rank0.ebt")
    _edit_index(c, lambda i: i.update(shards=[name]))
    with pytest.raises(ValueError, match="not a file name inside the checkpoint directory"):
        ckpt.load(c)


def test_shard_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    _, c = _save(tmp_path)
    _save(tmp_path, "other")
    os.unlink(c / "rank0.ebt")
    os.symlink(tmp_path / "other" / "rank0.ebt", c / "rank0.ebt")
    with pytest.raises(ValueError, match="symbolic link"):
        ckpt.load(c)


def test_stripes_entry_outside_is_not_read_or_deleted(tmp_path):
    _, c = _save(tmp_path)
    victims = [tmp_path / "precious", tmp_path / f"c.stripe-{_core.ckpt_stripe_path_tag(str(c))}-00"]
    for v in victims:
        v.mkdir()
        (v / "keep.txt").write_text("mine")
    idx = json.loads((c / "index.json").read_text())
    victims.append(tmp_path / f"c.stripe-{_core.ckpt_stripe_path_tag(str(c))}-{idx['id']}")  # right name, no owner.json
    victims[-1].mkdir()
    (victims[-1] / "keep.txt").write_text("mine")
    _edit_index(c, lambda i: i.update(stripes=[str(v) for v in victims], format_version=2))
    with pytest.raises(ValueError, match="stripes entry"):
        ckpt.load(c)
    ckpt.save({"x": torch.ones(3)}, c)  # the next save of the path removes only what it owns
    ckpt.join()
    for v in victims:
        assert (v / "keep.txt").read_text() == "mine", v


def test_owned_stripe_dirs_are_still_removed(tmp_path):
    d = tmp_path / "fast"
    d.mkdir()
    ckpt.save({"x": torch.ones(1 << 16)}, tmp_path / "c", stripe_dirs=[d])
    first = os.listdir(d)
    ckpt.save({"x": torch.ones(1 << 16)}, tmp_path / "c", stripe_dirs=[d])
    ckpt.join()
    assert len(os.listdir(d)) == 1 and os.listdir(d) != first
    assert torch.equal(ckpt.load(tmp_path / "c")["x"], torch.ones(1 << 16))


# --- special files ----------------------------------------------------------------------------

LOAD_CHILD = textwrap.dedent("""
    import sys
    from ebbtide import checkpoint
    try:
        checkpoint.load(sys.argv[1])
    except ValueError as e:
        print("ValueError:", e)
""")


@pytest.mark.parametrize("which", ["rank0.ebt", "index.json"])
def test_fifo_is_refused_without_blocking(tmp_path, which, cli):
    _, c = _save(tmp_path)
    os.unlink(c / which)
    os.mkfifo(c / which)
    # A blocked open() would hold the GIL: only a subprocess with a timeout can guard the test.
    p = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(c)], capture_output=True, text=True, timeout=120)
    assert "ValueError:" in p.stdout and "not a regular file" in p.stdout, p.stdout + p.stderr
    q = cli("ckpt", "inspect", str(c), check=False, timeout=120)
    assert q.returncode != 0 and "not a regular file" in q.stderr
    assert "Traceback" not in q.stderr


# --- the index ------------------------------------------------------------------------------

def _set(**kw):
    return lambda i: json.dumps(dict(i, **kw))


INDEX_EDITS = {
    "world_size-str": _set(world_size="1"),
    "world_size-0": _set(world_size=0),
    "shards-str": _set(shards="rank0.ebt"),
    "shards-int": _set(shards=[1]),
    "shards-missing": lambda i: json.dumps({k: v for k, v in i.items() if k != "shards"}),
    "shards-short": _set(world_size=2),
    "id-int": _set(id=5),
    "stripes-str": _set(stripes="x"),
    "stripes-int": _set(stripes=[3]),
    "delta-str": _set(delta="x"),
    "format-str": _set(format_version="1"),
    "list": lambda i: json.dumps([i]),
    "null": lambda i: "null",
    "deep": lambda i: "[" * 100000 + "]" * 100000,
}


@pytest.mark.parametrize("edit", list(INDEX_EDITS), ids=list(INDEX_EDITS))
def test_malformed_index_is_a_typed_error(tmp_path, edit, cli):
    _, c = _save(tmp_path)
    ip = c / "index.json"
    ip.write_text(INDEX_EDITS[edit](json.loads(ip.read_text())))
    with pytest.raises((ValueError, NotImplementedError), match="index.json"):
        ckpt.load(c)
    p = cli("ckpt", "inspect", str(c), check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "index.json" in p.stderr


def test_inspect_agrees_with_load(tmp_path, cli):
    _, c = _save(tmp_path)
    s = Shard(c / "rank0.ebt")
    next(t for t in s.meta["tensors"] if t["path"] == "state.a")["shape"] = [1 << 31]
    s.write()
    with pytest.raises(ValueError):
        ckpt.load(c)
    p = cli("ckpt", "inspect", str(c), check=False)
    assert p.returncode == 1 and "checksums OK" not in p.stdout and "Traceback" not in p.stderr
    bad = [ln for ln in p.stderr.splitlines() if ln.startswith("BAD SHARD:")]
    assert len(bad) == 1 and "state.a" in bad[0] and "rank0.ebt" in bad[0]
    info = ckpt.inspect(c)
    assert "reach byte" in info["shards"][0]["error"]


# --- mutation sweep ---------------------------------------------------------------------------

MUTATIONS = 200
VALUES = [-1, 0, 1, 2, 7, 4096, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 2**70, 1.5, "x", "", None, True, [], {}, [1, 2]]
BLOB_LIMITS = [2**64 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**16 - 1, 2**16 - 1]
CHUNK_LIMITS = [2**64 - 1, 2**64 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**16 - 1, 2**16 - 1]


def _mutate_json(obj, rng):
    """Replaces one randomly chosen value somewhere in `obj` (a dict or list)."""
    path = []
    node = obj
    while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.7):
        k = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, k))
        node = node[k]
    if path:
        parent, k = path[-1]
        parent[k] = rng.choice(VALUES + [rng.randrange(-10, 10**6)])


def _check_outcome(kind, load, saved, declared_bytes):
    try:
        got = load()
    except TYPED as e:
        return " ".join((e.strerror if isinstance(e, OSError) and e.strerror else str(e)).split())
    except Exception as e:  # noqa: BLE001 - the assertion names it
        pytest.fail(f"{kind}: load raised {type(e).__name__} (not a typed error): {e}")
    if kind == "corrupt":  # checksums not repaired: the data must be exactly what was saved
        assert _same(saved, got), f"{kind}: load returned different data"
    else:  # a crafted file may hold any state, but no tensor may reach past the declared bytes
        stack = [got]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor) and x.is_sparse:
                stack.extend([x._indices(), x._values()])
            elif isinstance(x, torch.Tensor):
                assert x.untyped_storage().nbytes() <= declared_bytes, f"{kind}: a tensor outgrew the file"
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
    return "loaded"


def test_seeded_mutations_load_exactly_or_raise_typed_errors(tmp_path, capsys):
    """...and `ebbtide ckpt inspect` agrees with each outcome (Note [One
    validator] in ebbtide/checkpoint/checks.py): exit 0 for what loaded, load()'s
    message and a non-zero exit for what it refused."""
    from ebbtide import cli
    rng = random.Random(1234)
    originals = {}
    for compress in (None, "lossless"):
        saved, c = _save(tmp_path, f"orig-{compress}", compress=compress)
        originals[compress] = (saved, {n: (c / n).read_bytes() for n in os.listdir(c)})
    work = tmp_path / "w"
    work.mkdir()
    outcomes = {}
    for i in range(MUTATIONS):
        compress = rng.choice([None, "lossless"])
        saved, files = originals[compress]
        for n, data in files.items():
            (work / n).write_bytes(data)
        shard = work / "rank0.ebt"
        kind = rng.choice(["corrupt", "corrupt", "tables", "meta", "index"])
        if kind == "corrupt":  # flip bytes anywhere in the shard or the index; checksums left alone
            target = work / rng.choice(["rank0.ebt", "rank0.ebt", "index.json"])
            data = bytearray(target.read_bytes())
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            target.write_bytes(data)
        elif kind == "tables":  # one field of the binary tables, checksums repaired
            s = Shard(shard)
            rows, limits = (s.blobs, BLOB_LIMITS) if rng.random() < 0.4 else (s.chunks, CHUNK_LIMITS)
            row = rng.choice(rows)
            f = rng.randrange(len(limits))
            v = rng.choice([0, 1, row[f] + 1, row[f] - 1, row[f] + 4096, limits[f], rng.randrange(limits[f] + 1)])
            row[f] = min(max(v, 0), limits[f])
            s.write(fix_chunk_crcs=rng.random() < 0.5)
        elif kind == "meta":  # one value of the JSON metadata, checksums repaired
            s = Shard(shard)
            _mutate_json(s.meta, rng)
            s.write()
        else:
            idx = json.loads((work / "index.json").read_text())
            _mutate_json(idx, rng)
            (work / "index.json").write_text(json.dumps(idx))
        declared = sum(b[0] for b in Shard(work / "rank0.ebt").blobs) if kind != "corrupt" else 0
        r = _check_outcome(kind, lambda: ckpt.load(work, device="cpu"), saved, max(declared, 1 << 20))
        capsys.readouterr()
        rc = cli.main(["ckpt", "inspect", str(work)])
        err = " ".join(capsys.readouterr().err.split())
        if r == "loaded":
            assert rc == 0, f"mutation {i} ({kind}): load() loaded it, inspect exited {rc}: {err}"
        else:
            assert rc != 0 and r in err, f"mutation {i} ({kind}): load() said {r!r}, inspect exited {rc}: {err}"
            r = "error"
        outcomes[(kind, r)] = outcomes.get((kind, r), 0) + 1
    # The sweep exercised both outcomes (a mutation that is ignored, one that is refused).
    assert any(r == "error" for _, r in outcomes) and any(r == "loaded" for _, r in outcomes), outcomes
