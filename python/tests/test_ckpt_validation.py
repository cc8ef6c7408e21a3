"""`ebbtide ckpt inspect` says exactly what load() will do (Note [One
validator] in ebbtide/checkpoint/checks.py).

test_every_check_refuses_alike walks _ckpt_checks.CHECKS, the table the
validators raise from: for each check it crafts a file breaking it (checksums
recomputed, as an attacker would), and asserts that load() raises that check
and that inspect exits non-zero printing load()'s message, with and without
--no-verify (a check on the data only when verifying: without it no tensor
data is read). A check added to the table without a crafted file here fails.
The seeded sweeps mutate state trees (and DCP metadata) at random and assert
load() and inspect agree on every outcome."""
import dataclasses
import json
import os
import pickle
import random
import shutil
import struct
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ebbtide import _core, cli
from ebbtide import checkpoint as ckpt
from ebbtide.checkpoint.checks import CHECKS, check_of
from ebbtide.dcp import EbbtideReader, EbbtideWriter, load_metadata
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import metadata as md_types
from torch.distributed.checkpoint.api import CheckpointException

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint_hostile import Shard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _one_line(text):
    return " ".join(str(text).split())


def _message(e):
    """What inspect must print of load()'s error `e` (an OSError's str adds
    its errno and file around the message)."""
    return _one_line(e.strerror if isinstance(e, OSError) and e.strerror else e)


def _original(e):
    """The validator's error inside DCP's CheckpointException."""
    if isinstance(e, CheckpointException):
        exc = next(iter(e.failures.values()))
        return exc[0] if isinstance(exc, tuple) else exc
    return e


def _inspect(capsys, path, *flags):
    capsys.readouterr()  # what the load printed (torch's DCP logs) is not inspect's
    rc = cli.main(["ckpt", "inspect", *flags, str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


# -- originals, saved once and copied per test ------------------------------------------------

def _native_state():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3000, generator=g)
    return {"a": torch.randn(1000, generator=g), "b": torch.arange(5000, dtype=torch.int64),
            "view": base[10:2010:2], "base": base, "step": 7, "names": ["x", ("y", 2.5)]}


def _dcp_state():
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(64, 32, generator=g), "bf": torch.randn(9, 5, generator=g).bfloat16(), "step": 3,
            "cfg": {"name": "ebb"}}


def _zeros_like(state):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else
            (dict(v) if isinstance(v, dict) else v) for k, v in state.items()}


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("originals")
    ckpt.save(_native_state(), root / "c")
    sp = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True)
    ckpt.save({"s": sp}, root / "sparse")
    torch.manual_seed(0)
    m = torch.nn.Linear(128, 64)
    ckpt.save({"model": m.state_dict()}, root / "dbase", compress="lossless")
    with torch.no_grad():
        m.weight.add_(torch.randn_like(m.weight) * 0.01)
    ckpt.save({"model": m.state_dict()}, root / "delta", compress="delta", base=root / "dbase")
    (root / "ssd").mkdir()
    ckpt.Writer(chunk_bytes=64 << 10).save({"w": torch.randn(1 << 16)}, root / "striped", stripe_dirs=[root / "ssd"])
    dcp.save(_dcp_state(), storage_writer=EbbtideWriter(root / "ebb"))
    dcp.save(_dcp_state(), storage_writer=FileSystemWriter(root / "fsw"))
    ckpt.save_safetensors({"emb": torch.randn(10, 4), "step": torch.tensor(3)}, root / "m.safetensors")
    st = root / "st"
    st.mkdir()
    ckpt.save_safetensors({"a": torch.randn(8)}, st / "p1.safetensors")
    ckpt.save_safetensors({"b": torch.arange(6)}, st / "p2.safetensors")
    (st / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "p1.safetensors", "b": "p2.safetensors"}}))
    ckpt.join()
    return root


class Case:
    """A crafted file: `load()` runs the loader as a user would, `path` is
    what inspect is given."""

    def __init__(self, load, path):
        self.load, self.path = load, path


def _copy(originals, tmp, name):
    src = originals / name
    if src.is_dir():
        shutil.copytree(src, tmp / name, symlinks=True)
    else:
        shutil.copyfile(src, tmp / name)
    return tmp / name


def _native(originals, tmp, name="c", **load_kw):
    c = _copy(originals, tmp, name)
    return c, Case(lambda: ckpt.load(c, **load_kw), c)


def _edit_index(c, fn):
    idx = json.loads((c / "index.json").read_text())
    fn(idx)
    (c / "index.json").write_text(json.dumps(idx))


def _write_meta(shard_file, raw):
    """Replaces a shard's metadata JSON by `raw` bytes, checksums recomputed
    (Shard.write with metadata that is not JSON)."""
    s = Shard(shard_file)
    hdr = b"EBBHDR01" + struct.pack("<IIQQ", len(s.blobs), len(s.chunks), len(s.names), len(raw))
    hdr += b"".join(struct.pack("<QIIIIHHI", *b) for b in s.blobs)
    hdr += b"".join(struct.pack("<QQIIIIHHI", *c) for c in s.chunks)
    hdr += s.names + raw
    data = s.data[:s.h] + hdr + b"\0" * (-len(hdr) % 4096)
    struct.pack_into("<QQI", data, 32, len(hdr), len(data), _core.crc32c(hdr))
    struct.pack_into("<I", data, 56, _core.crc32c(bytes(data[:56])))
    with open(shard_file, "wb") as f:
        f.write(data)


def _meta(c, fn, shard="rank0.ebt"):
    s = Shard(c / shard)
    fn(s.meta)
    s.write()


def _tensor(meta, path):
    return next(t for t in meta["tensors"] if t.get("path") == path)


def _native_meta(fn, name="c"):
    def craft(o, tmp):
        c, case = _native(o, tmp, name)
        _meta(c, fn)
        return case
    return craft


def _native_index(fn):
    def craft(o, tmp):
        c, case = _native(o, tmp)
        _edit_index(c, fn)
        return case
    return craft


def _find_pairs(node, key, out):
    """Every [key, value] pair of dict nodes in a JSON tree."""
    if isinstance(node, dict):
        for v in node.values():
            _find_pairs(v, key, out)
    elif isinstance(node, list):
        if len(node) == 2 and node[0] == key:
            out.append(node)
        for v in node:
            _find_pairs(v, key, out)
    return out


def _delta(fn):
    def craft(o, tmp):
        _copy(o, tmp, "dbase")
        c, case = _native(o, tmp, "delta")
        _meta(c, fn)
        return case
    return craft


def _set_delta(**kw):
    return _delta(lambda m: m["delta"].update(kw))


def _odd_count(m):
    """count one less than the mask keeps, the codes tensor one shorter with
    it (a view of the same storage), so only the data can tell."""
    pair = _find_pairs(m["tree"], "count", [])[0]
    pair[1] -= 1
    codes = m["tensors"][_find_pairs(m["tree"], "codes", [])[0][1]["tensor"]]
    codes["shape"][0] -= 1


def _rename_delta_key(m):
    """The lossy weight moves to a path where the base has no tensor."""
    (_, model), = _find_pairs(m["tree"], "model", [])
    (items,) = model.values()  # {"odict": [[key, value], ...]}
    next(kv for kv in items if kv[0] == "weight")[0] = "weight_renamed"


def _delta_cycle(o, tmp):
    _copy(o, tmp, "dbase")
    c, case = _native(o, tmp, "delta")
    own = json.loads((c / "index.json").read_text())["id"]
    _meta(c, lambda m: m["delta"].update(base="delta", base_id=own))
    return case


def _delta_base_rank(o, tmp):
    _copy(o, tmp, "dbase")
    c = _copy(o, tmp, "delta")
    shutil.copyfile(c / "rank0.ebt", c / "rank1.ebt")
    _edit_index(c, lambda i: i.update(world_size=2, shards=["rank0.ebt", "rank1.ebt"]))
    return Case(lambda: ckpt.load(c, rank=1), c)


def _blob_unused(m):
    s = next(s for s in m["storages"] if s["nbytes"])
    s["nbytes"] = 0


def _shard_tables(o, tmp):
    c, case = _native(o, tmp)
    s = Shard(c / "rank0.ebt")
    a, b = 0, 1
    s.blobs[a][1], s.blobs[b][1] = s.blobs[b][1], s.blobs[a][1]  # swap first_chunk
    s.blobs[a][2], s.blobs[b][2] = s.blobs[b][2], s.blobs[a][2]
    s.write()
    return case


def _stripe_file_missing(o, tmp):
    shutil.copytree(o / "ssd", tmp / "ssd")
    c, case = _native(o, tmp, "striped")
    stripes = json.loads((c / "index.json").read_text())["stripes"]
    # The index names the originals' stripe directories: point it at the copies.
    moved = [str(tmp / "ssd" / os.path.basename(sd)) for sd in stripes]
    _edit_index(c, lambda i: i.update(stripes=moved))
    os.unlink(os.path.join(moved[0], "rank0.ebt"))
    return case


def _flip_chunk(o, tmp):
    c, case = _native(o, tmp)
    off = next(b["offset"] for b in _core.CkptReader(str(c / "rank0.ebt")).blobs if b["name"] == "state.a")
    with open(c / "rank0.ebt", "r+b") as f:
        f.seek(off + 100)
        b = f.read(1)
        f.seek(off + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    return case


def _index_special(o, tmp):
    c, case = _native(o, tmp)
    os.unlink(c / "index.json")
    os.mkdir(c / "index.json")
    return case


def _index_symlink(o, tmp):
    c, case = _native(o, tmp)
    os.rename(c / "index.json", tmp / "elsewhere.json")
    os.symlink(tmp / "elsewhere.json", c / "index.json")
    return case


def _index_too_large(o, tmp):
    c, case = _native(o, tmp)
    os.truncate(c / "index.json", (64 << 20) + 1)
    return case


def _index_raw(raw):
    def craft(o, tmp):
        c, case = _native(o, tmp)
        (c / "index.json").write_text(raw)
        return case
    return craft


def _meta_raw(raw):
    def craft(o, tmp):
        c, case = _native(o, tmp)
        _write_meta(c / "rank0.ebt", raw)
        return case
    return craft


def _deep_tree(m):
    node = 1
    for _ in range(101):
        node = {"list": [node]}
    m["tree"] = node


# -- safetensors ------------------------------------------------------------------------------

def _st(fn, name):
    """A copy of safetensors original `name` (a file, or a directory with an index) edited by `fn`."""
    def craft(o, tmp):
        p = _copy(o, tmp, name)
        fn(p)
        return Case(lambda: ckpt.load_safetensors(p), p)
    return craft


def _st_file(fn):
    return _st(fn, "m.safetensors")


def _st_index(fn):
    return _st(fn, "st")


def _st_weight_map(wm):
    return _st_index(lambda d: (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm})))


def _st_two_files(o, tmp):
    d = tmp / "two"
    d.mkdir()
    shutil.copyfile(o / "m.safetensors", d / "x.safetensors")
    shutil.copyfile(o / "m.safetensors", d / "y.safetensors")
    return Case(lambda: ckpt.load_safetensors(d), d)


def _st_f4(f):
    header = json.dumps({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\x12")


# -- torch.distributed.checkpoint ---------------------------------------------------------------

def _dcp_load(path):
    def load():
        try:
            dcp.load(_zeros_like(_dcp_state()), storage_reader=EbbtideReader(path))
        except CheckpointException as e:
            inner = _original(e)
            if check_of(inner) is not None:
                raise inner from None
            # Unusable metadata: DCP tries the rank's own metadata next and raises an AssertionError
            # holding both errors; the reader's error is load_metadata's.
            try:
                load_metadata(path)
            except (ValueError, FileNotFoundError) as m:
                assert _message(m) in _one_line(inner), f"{m}\nnot in\n{inner}"
                raise m from None
            raise
    return load


def _dcp(name="ebb"):
    def wrap(fn):
        def craft(o, tmp):
            if name == "dstriped":  # saved here: stripe directories are named after their checkpoint's path
                p = tmp / name
                (tmp / "dssd").mkdir()
                dcp.save(_dcp_state(), storage_writer=EbbtideWriter(p, stripe_dirs=[tmp / "dssd"], chunk_bytes=4096))
            else:
                p = _copy(o, tmp, name)
            fn(p)
            return Case(_dcp_load(p), p)
        return craft
    return wrap


def _md_edit(fn, name="ebb"):
    """Edits the unpickled .metadata (the test trusts its own files)."""
    def edit(p):
        with open(p / ".metadata", "rb") as f:
            md = pickle.load(f)
        fn(md)
        with open(p / ".metadata", "wb") as f:
            pickle.dump(md, f)
    return _dcp(name)(edit)


def _si(md, fqn):
    return next((k, v) for k, v in md.storage_data.items() if k.fqn == fqn)


def _si_replace(fqn, **kw):
    def fn(md):
        k, v = _si(md, fqn)
        md.storage_data[k] = dataclasses.replace(v, **kw)
    return fn


def _dcp_shard(fn):
    """Edits the JSON metadata of the ebbtide .distcp shard (checksums recomputed)."""
    return _dcp()(lambda p: _meta(p, fn, "__0_0.distcp"))


def _dcp_shard_item(fqn, fn):
    def edit(p):
        s = Shard(p / "__0_0.distcp")
        names = [s.names[b[3]:b[3] + b[4]].decode() for b in s.blobs]
        k = next(i for i, n in enumerate(names) if fqn in n)
        fn(s.meta["items"][k])
        s.write()
    return _dcp()(edit)


def _dcp_blob_unused(md):
    (_, w), (kb, b) = _si(md, "w"), _si(md, "bf")
    md.storage_data[kb] = dataclasses.replace(b, offset=w.offset, length=w.length)


def _dcp_header(p):
    s = Shard(p / "__0_0.distcp")
    s.blobs[0][2] += 1  # one chunk more than the table holds for it
    s.write()


def _dcp_stripe_missing(p):
    rec = json.loads((p / ".ebbtide-stripes.json").read_text())
    os.unlink(os.path.join(rec["stripes"][0], "__0_0.distcp"))


def _fsw_other_file(obj):
    def fn(p):
        torch.save(obj, p / "other.distcp")
        size = os.path.getsize(p / "other.distcp")
        with open(p / ".metadata", "rb") as f:
            md = pickle.load(f)
        _si_replace("w", relative_path="other.distcp", offset=0, length=size)(md)
        with open(p / ".metadata", "wb") as f:
            pickle.dump(md, f)
    return _dcp("fsw")(fn)


def _fsw_garble(p):
    with open(p / ".metadata", "rb") as f:
        md = pickle.load(f)
    _, si = _si(md, "w")
    with open(p / si.relative_path, "r+b") as f:
        f.seek(si.offset)
        f.write(b"\0" * 64)


def _bad_metadata(raw):
    return _dcp()(lambda p: (p / ".metadata").write_bytes(raw))


def _chunk_outside(md):
    m = md.state_dict_metadata["w"]
    m.chunks[0] = md_types.ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([999, 32]))


def _unchecked_index(fqn, offset):
    """A MetadataIndex as unpickling makes it: its __init__ (which makes the offset a torch.Size) not run."""
    idx = object.__new__(md_types.MetadataIndex)
    for k, v in (("fqn", fqn), ("offset", offset), ("index", None)):
        object.__setattr__(idx, k, v)
    return idx


def _unstored(md):
    del md.storage_data[_si(md, "w")[0]]


def _unlisted(md):
    _, si = _si(md, "w")
    md.storage_data[md_types.MetadataIndex("ghost", (0, 0))] = si


def _set_attr(obj_of, **kw):
    def fn(md):
        o = obj_of(md)
        for k, v in kw.items():
            object.__setattr__(o, k, v)
    return fn


def _stripe_record(fn):
    def edit(p):
        rp = p / ".ebbtide-stripes.json"
        rp.write_text(fn(json.loads(rp.read_text())))
    return _dcp("dstriped")(edit)


CRAFTED = {
    # files of every format
    "file.symlink": _index_symlink,
    "file.special": _index_special,
    "file.too_large": _index_too_large,
    # index.json
    "ckpt.index.no_directory": lambda o, tmp: Case(lambda: ckpt.load(tmp / "nowhere"), tmp / "nowhere"),
    "ckpt.index.missing": lambda o, tmp: _set_delta(base="empty")(o, tmp) if os.mkdir(tmp / "empty") is None
    else None,
    "ckpt.index.json": _index_raw("{"),
    "ckpt.index.format": _index_raw(json.dumps({"format": "other"})),
    "ckpt.index.version": _native_index(lambda i: i.update(format_version=99)),
    "ckpt.index.id": _native_index(lambda i: i.update(id=5)),
    "ckpt.index.world_size": _native_index(lambda i: i.update(world_size=0)),
    "ckpt.index.shards": _native_index(lambda i: i.update(shards="rank0.ebt")),
    "ckpt.index.shard_name": _native_index(lambda i: i.update(shards=["../c/rank0.ebt"])),
    "ckpt.index.stripes": _native_index(lambda i: i.update(stripes="x")),
    "ckpt.index.compress": _native_index(lambda i: i.update(compress=1)),
    "ckpt.index.stripe_dir": _native_index(lambda i: i.update(stripes=["/tmp/precious"], format_version=2)),
    "ckpt.delta.entry": _native_index(lambda i: i.update(delta="x")),
    # a shard's file, tables and stripe files
    "ckpt.shard.tables": _shard_tables,
    "ckpt.shard.extents": _stripe_file_missing,
    # a shard's metadata
    "ckpt.meta.json": _meta_raw(b"{"),
    "ckpt.meta.object": _meta_raw(b"[1]"),
    "ckpt.meta.lists": _native_meta(lambda m: m.update(storages="no")),
    "ckpt.meta.tree": _native_meta(lambda m: m.pop("tree")),
    "ckpt.meta.id": _native_meta(lambda m: m.update(id=5)),
    "ckpt.meta.other_checkpoint": _native_meta(lambda m: m.update(id="abc")),
    "ckpt.storage.fields": _native_meta(lambda m: m["storages"][0].update(nbytes="4000")),
    "ckpt.storage.device": _native_meta(lambda m: m["storages"][0].update(device="nonsense")),
    "ckpt.storage.blob": _native_meta(lambda m: m["storages"][0].update(blob=99)),
    "ckpt.storage.blob_twice": _native_meta(lambda m: m["storages"][1].update(blob=m["storages"][0]["blob"])),
    "ckpt.storage.nbytes": _native_meta(lambda m: m["storages"][0].update(nbytes=m["storages"][0]["nbytes"] - 4)),
    "ckpt.storage.blob_unused": _native_meta(_blob_unused),
    "ckpt.tensor.path": _native_meta(lambda m: m["tensors"][0].update(path=5)),
    "ckpt.tensor.shape": _native_meta(lambda m: m["tensors"][0].update(shape="x")),
    "ckpt.tensor.numel": _native_meta(lambda m: m["tensors"][0].update(shape=[2**40, 2**40], stride=[0, 0])),
    "ckpt.tensor.layout": _native_meta(lambda m: m["tensors"][0].update(layout="sparse_csr")),
    "ckpt.tensor.dtype": _native_meta(lambda m: m["tensors"][0].update(dtype=5)),
    "dtype.unknown": _native_meta(lambda m: m["tensors"][0].update(dtype="pickle")),
    "ckpt.tensor.stride": _native_meta(lambda m: m["tensors"][0].update(stride=[-1])),
    "ckpt.tensor.offset": _native_meta(lambda m: m["tensors"][0].update(offset=-1)),
    "ckpt.tensor.storage": _native_meta(lambda m: m["tensors"][0].update(storage=99)),
    "ckpt.tensor.flag": _native_meta(lambda m: m["tensors"][0].update(parameter="yes")),
    "ckpt.tensor.extent": _native_meta(lambda m: _tensor(m, "state.a").update(shape=[1 << 31])),
    "ckpt.tensor.requires_grad": _native_meta(lambda m: _tensor(m, "state.b").update(parameter=True,
                                                                                    requires_grad=True)),
    "ckpt.sparse.refs": _native_meta(lambda m: _tensor(m, "state.s").update(indices=99), "sparse"),
    "ckpt.sparse.layout": _native_meta(lambda m: _tensor(m, "state.s").update(shape=[3, 2]), "sparse"),
    "ckpt.sparse.indices": _native_meta(lambda m: _tensor(m, "state.s").update(shape=[2]), "sparse"),
    # the object tree
    "ckpt.tree.tensor": _native_meta(lambda m: m.update(tree={"dict": [["a", {"tensor": -1}]]})),
    "ckpt.tree.node": _native_meta(lambda m: m.update(tree={"dict": "no"})),
    "ckpt.tree.key": _native_meta(lambda m: m.update(tree={"dict": [[{"dict": []}, 1]]})),
    "ckpt.tree.depth": _native_meta(_deep_tree),
    # delta chains
    "ckpt.delta.base_missing": _set_delta(base="nowhere"),
    "ckpt.delta.base_id": _set_delta(base_id="ff"),
    "ckpt.delta.cycle": _delta_cycle,
    "ckpt.delta.base_rank": _delta_base_rank,
    "ckpt.delta.tensor": _delta(lambda m: _find_pairs(m["tree"], "bits", [])[0].__setitem__(1, 99)),
    "ckpt.delta.base_tensor": _delta(_rename_delta_key),
    "ckpt.delta.values": _delta(_odd_count),
    "ckpt.chunk": _flip_chunk,
    # safetensors
    "st.directory": _st_two_files,
    "st.index.json": _st_index(lambda d: (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "p1.safetensors", "a": "p2.safetensors"}}')),
    "st.index.weight_map": _st_index(lambda d: (d / "model.safetensors.index.json").write_text('{"x": 1}')),
    "st.index.file": _st_weight_map({"a": "../p1.safetensors", "b": "p2.safetensors"}),
    "st.file": _st_file(lambda f: os.truncate(f, os.path.getsize(f) - 8)),
    "st.shard.missing": _st_weight_map({"a": "p1.safetensors", "b": "p2.safetensors", "c": "p2.safetensors"}),
    "st.shard.extra": _st_index(lambda d: ckpt.save_safetensors({"a": torch.ones(8), "z": torch.ones(1)},
                                                                 d / "p1.safetensors")),
    "st.dtype": _st_file(_st_f4),
    # torch.distributed.checkpoint: .metadata
    "dcp.meta.class": _bad_metadata(pickle.dumps(os.getcwd)),
    "dcp.meta.pickle": _bad_metadata(b"\x80\x04junk"),
    "dcp.meta.type": _bad_metadata(pickle.dumps([1])),
    "dcp.meta.dicts": _md_edit(lambda md: setattr(md, "storage_data", [])),
    "dcp.meta.fqn": _md_edit(lambda md: md.state_dict_metadata.update({5: md_types.BytesStorageMetadata()})),
    "dcp.meta.entry": _md_edit(lambda md: md.state_dict_metadata.update(w=5)),
    "dcp.meta.dtype": _md_edit(_set_attr(lambda md: md.state_dict_metadata["w"].properties, dtype="float")),
    "dcp.meta.size": _md_edit(_set_attr(lambda md: md.state_dict_metadata["w"], size="x")),
    "dcp.meta.chunks": _md_edit(_set_attr(lambda md: md.state_dict_metadata["w"], chunks="x")),
    "dcp.meta.chunk": _md_edit(_chunk_outside),
    "dcp.meta.storage_meta": _md_edit(lambda md: setattr(md, "storage_meta", 5)),
    "dcp.meta.storage_key": _md_edit(lambda md: md.storage_data.update({_unchecked_index("w", 5): _si(md, "w")[1]})),
    "dcp.meta.storage_info": _md_edit(lambda md: md.storage_data.update({_si(md, "w")[0]: 5})),
    "dcp.meta.file_name": _md_edit(_si_replace("w", relative_path="../x")),
    "dcp.meta.range": _md_edit(_si_replace("w", offset=-1)),
    "dcp.meta.transforms": _md_edit(_si_replace("w", transform_descriptors=5)),
    "dcp.meta.unstored": _md_edit(_unstored),
    "dcp.meta.unlisted": _md_edit(_unlisted),
    # the stripe record
    "dcp.stripes.json": _stripe_record(lambda rec: "{"),
    "dcp.stripes.fields": _stripe_record(lambda rec: json.dumps({"id": 5, "stripes": rec["stripes"]})),
    "dcp.stripes.entry": _stripe_record(lambda rec: json.dumps(dict(rec, stripes=["/tmp/precious"]))),
    # data files
    "dcp.file": _dcp()(lambda p: os.unlink(p / "__0_0.distcp")),
    "dcp.shard.tables": _dcp()(_dcp_header),
    "dcp.shard.extents": _dcp("dstriped")(_dcp_stripe_missing),
    "dcp.shard.json": _dcp()(lambda p: _write_meta(p / "__0_0.distcp", b"{")),
    "dcp.shard.layout": _dcp_shard(lambda m: m.update(layout="other")),
    "dcp.shard.items": _dcp_shard(lambda m: m.update(items=[])),
    "dcp.shard.item_kind": _dcp_shard(lambda m: m["items"][0].update(kind="pickle")),
    "dcp.shard.item_dtype": _dcp_shard_item("w", lambda it: it.update(dtype=5)),
    "dcp.shard.item_layout": _dcp_shard_item("w", lambda it: it.update(size="x")),
    "dcp.shard.item_fit": _dcp_shard_item("w", lambda it: it.update(head=1 << 40)),
    "dcp.shard.blob_unused": _md_edit(_dcp_blob_unused),
    "dcp.item.blob": _md_edit(lambda md: _si_replace("w", offset=_si(md, "w")[1].offset + 1)(md)),
    "dcp.item.striping": _md_edit(_si_replace("w", transform_descriptors=["ebbtide-stripe/1"])),
    "dcp.item.transforms": _md_edit(_si_replace("w", transform_descriptors=["zzz"])),
    "dcp.item.kind": _dcp_shard_item("w", lambda it: it.update(kind="bytes")),
    "dcp.item.tensor": _dcp_shard_item("w", lambda it: it.update(size=[32, 64], stride=[64, 1])),
    "dcp.plain.range": _md_edit(lambda md: _si_replace("w", offset=1 << 40)(md), "fsw"),
    "dcp.plain.transforms": _md_edit(_si_replace("w", transform_descriptors=["zzz"]), "fsw"),
    "dcp.plain.frame": _dcp("fsw")(_fsw_garble),
    "dcp.plain.object": _fsw_other_file([1, 2]),
    "dcp.plain.tensor": _fsw_other_file(torch.zeros(3)),
}


def test_every_check_has_a_crafted_file():
    assert sorted(set(CHECKS) - set(CRAFTED)) == [], "checks without a crafted file: add one to CRAFTED"
    assert sorted(set(CRAFTED) - set(CHECKS)) == [], "crafted files for checks that are not in the table"


@pytest.mark.parametrize("check_id", sorted(CHECKS))
def test_every_check_refuses_alike(check_id, originals, tmp_path, capsys):
    check = CHECKS[check_id]
    case = CRAFTED[check_id](originals, tmp_path)
    with pytest.raises((Exception, CheckpointException)) as ei:
        case.load()
    e = _original(ei.value)
    assert check_of(e) == check_id, f"load() raised {type(e).__name__} from check {check_of(e)}: {e}"
    assert isinstance(e, check.exc), f"{type(e).__name__}: {e}"
    msg = _message(e)
    assert str(tmp_path) in str(e), f"the message names no file: {e}"
    rc, out, err = _inspect(capsys, case.path)
    assert rc != 0 and msg in _one_line(err), f"inspect exited {rc}; load() said:\n{msg}\ninspect:\n{out}{err}"
    assert "Traceback" not in err
    rc, out, err = _inspect(capsys, case.path, "--no-verify")
    if check.data:  # found only by reading the data: --no-verify reads none
        assert rc == 0, f"--no-verify exited {rc}:\n{out}{err}"
    else:
        assert rc != 0 and msg in _one_line(err), f"--no-verify exited {rc}; load() said:\n{msg}\n{out}{err}"


# The report: a tree referring to tensor -1 or 10**6, checksums recomputed, was refused by
# load() while `ebbtide ckpt inspect` printed "all chunk checksums OK" and exited 0.
@pytest.mark.parametrize("ref", [-1, 10**6])
def test_inspect_refuses_a_tree_load_refuses(ref, originals, tmp_path, cli):
    c, _ = _native(originals, tmp_path)
    _meta(c, lambda m: m.update(tree={"dict": [["a", {"tensor": ref}]]}))
    with pytest.raises(ValueError) as ei:
        ckpt.load(c)
    assert f"refers to tensor {ref}" in str(ei.value)
    p = cli("ckpt", "inspect", str(c), check=False)
    assert p.returncode == 1 and "checksums OK" not in p.stdout, p.stdout + p.stderr
    assert f"BAD SHARD: {_one_line(ei.value)}" in p.stderr, p.stderr


def test_a_sound_checkpoint_of_each_format_passes_both(originals, tmp_path, capsys):
    for name in ("c", "sparse", "delta", "striped", "ebb", "fsw", "m.safetensors", "st"):
        rc, out, err = _inspect(capsys, originals / name)
        assert rc == 0, f"{name}: {out}{err}"
    ckpt.load(originals / "delta")
    ckpt.load(originals / "sparse")
    _dcp_load(originals / "fsw")()


# -- seeded sweeps: load() and inspect agree on every outcome -----------------------------------

def _outcome(load):
    try:
        load()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - compared with inspect below
        e = _original(e)
        assert isinstance(e, (ValueError, OSError, NotImplementedError)), f"untyped {type(e).__name__}: {e}"
        return _message(e)
    return None


def _agree(capsys, load, path, what):
    refused = _outcome(load)
    rc, out, err = _inspect(capsys, path)
    if refused is None:
        assert rc == 0, f"{what}: load() loaded it, inspect exited {rc}:\n{out}{err}"
    else:
        assert rc != 0 and refused in _one_line(err), f"{what}: load() said {refused!r}; inspect exited {rc}:\n{err}"
    return refused is None


TREE_VALUES = [-1, 0, 1, 3, 4, 10**6, 2**63, True, None, "0", 1.0, [0], {"tensor": 0}]


def _tree_mutation(rng, n_tensors):
    """A node of the tree grammar, usually slightly wrong."""
    k = rng.randrange(12)
    if k < 4:
        return {"tensor": rng.choice(TREE_VALUES + [n_tensors, n_tensors - 1])}
    if k == 4:
        return {"dtype": rng.choice(["float32", "pickle", 5])}
    if k == 5:
        return {"device": rng.choice(["cuda:0", "gpu", "cpu"])}
    if k == 6:
        return {"float": rng.choice(["nan", "x", 1.0])}
    if k == 7:
        return {"dict": rng.choice([[[{"list": []}, 1]], [[1]], "x", [[{"tensor": 0}, 1]], [["k", {"tensor": 1}]]])}
    if k == 8:
        node = {"tensor": 0}
        for _ in range(rng.choice([50, 99, 100, 150])):
            node = {"list": [node]}
        return node
    if k == 9:
        return {"tensor": 0, "list": []}
    if k == 10:
        return {rng.choice(["set", "tuple", "odict"]): rng.choice([[], [1, {"tensor": 2}], "x"])}
    return rng.choice(TREE_VALUES)


def _mutate_tree(tree, rng, n_tensors):
    """Replaces one node of a JSON tree (or the root)."""
    parent, key, node = None, None, tree
    while isinstance(node, (dict, list)) and node and rng.random() < 0.75:
        parent = node
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        node = node[key]
    if parent is None:
        return _tree_mutation(rng, n_tensors)
    parent[key] = _tree_mutation(rng, n_tensors)
    return tree


STATE_TREE_MUTATIONS = 150


def test_seeded_state_tree_mutations_agree(originals, tmp_path, capsys):
    rng = random.Random(33)
    src = Shard(originals / "c" / "rank0.ebt")
    n = len(src.meta["tensors"])
    c = _copy(originals, tmp_path, "c")
    loaded = 0
    for i in range(STATE_TREE_MUTATIONS):
        s = Shard(originals / "c" / "rank0.ebt")
        s.path = c / "rank0.ebt"
        s.meta["tree"] = _mutate_tree(s.meta["tree"], rng, n)
        s.write()
        loaded += _agree(capsys, lambda: ckpt.load(c), c, f"mutation {i}: {json.dumps(s.meta['tree'])[:300]}")
    assert 0 < loaded < STATE_TREE_MUTATIONS  # both outcomes occurred


DCP_MUTATIONS = 40


def test_seeded_dcp_metadata_mutations_agree(originals, tmp_path, capsys):
    rng = random.Random(34)
    p = _copy(originals, tmp_path, "ebb")
    with open(originals / "ebb" / ".metadata", "rb") as f:
        raw = f.read()
    shard = (originals / "ebb" / "__0_0.distcp").read_bytes()
    values = [-1, 0, 1, 7, 1 << 40, None, "x", "w", "__0_0.distcp", ["ebbtide-zstd/1"], torch.Size([1])]
    loaded = 0
    for i in range(DCP_MUTATIONS):
        md = pickle.loads(raw)
        (p / "__0_0.distcp").write_bytes(shard)
        k, si = rng.choice(list(md.storage_data.items()))
        if rng.random() < 0.6:
            field = rng.choice(["relative_path", "offset", "length", "transform_descriptors"])
            md.storage_data[k] = dataclasses.replace(si, **{field: rng.choice(values)})
        else:
            s = Shard(p / "__0_0.distcp")
            it = rng.choice(s.meta["items"])
            it[rng.choice(list(it))] = rng.choice(values[:8] + [[1], [64, 32], "float64"])
            s.write()
        with open(p / ".metadata", "wb") as f:
            pickle.dump(md, f)
        loaded += _agree(capsys, _dcp_load(p), p, f"mutation {i}")
    assert loaded < DCP_MUTATIONS
