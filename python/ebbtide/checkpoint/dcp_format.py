"""The DCP plugin's file layout and metadata: constants, the checked reading of
``.metadata`` and stripe records, and the shard and data-file readers the
reader and ``inspect`` share. The plugin itself: dcp_writer.py (EbbtideWriter)
and dcp_reader.py (EbbtideReader, inspect); ``ebbtide.dcp`` is its public name.

The plugin, in short:

``EbbtideWriter`` and ``EbbtideReader`` plug into ``dcp.save``,
``dcp.async_save`` and ``dcp.load`` (FSDP2, torchtitan, torchtune): DCP plans
what each rank saves and how it reshards on load; the bytes are moved by the
C++ checkpoint writer and reader (O_DIRECT from pinned aligned buffers,
io_uring where available, crc32c per chunk, optional zstd), and a save is
committed by renaming its directory. See docs/checkpoints.md,
"torch.distributed.checkpoint".

Note [DCP layout]
Each rank writes one file ``__<rank>_0.distcp`` that is an ebbtide shard
(docs/checkpoint-format.md): a superblock in block 0, data chunks at 4 KiB
offsets, the chunk table (crc32c, codec) after the data. Each DCP write item
is one blob. A tensor item's blob is framed (Note [Framed blobs] in
cpp/src/ckpt/writer_arena.cpp) with the bytes torch.save writes around its storage
(made by torch.save itself under ``torch.serialization.skip_data`` into a
sink that keeps everything but the storage bytes), so that uncompressed, the
blob is exactly what torch.save would have written. ``.metadata`` is DCP's own
pickle with ``_StorageInfo(relative_path, offset, length)`` naming the blob's
first byte and size: torch's FileSystemReader reads the range and torch.loads
it, never looking at the rest of the file, so it loads these checkpoints as
its own. Compressed blobs carry the transform descriptor ``ebbtide-zstd/1``,
which FileSystemReader refuses ("Unknown extension"). EbbtideReader reads
ebbtide shards through the C++ reader (tables validated, checksums verified,
chunks decompressed) and takes tensors out of the frame by the layout the
shard's JSON metadata records; any other file (FileSystemWriter's) by
bounds-checked byte ranges and ``torch.load(weights_only=True)``.

Note [DCP metadata safety]
``.metadata`` is a pickle, which can run any code when loaded.
torch's weights_only unpickler cannot read it (DCP writes pickle protocol 4,
whose FRAME opcode it refuses), so EbbtideReader unpickles it with
``_MetadataUnpickler``, whose ``find_class`` allows only the DCP metadata
dataclasses, torch.Size/dtype/layout/memory_format and pathlib paths: no other
callable can be reached. Then every field the reader uses is type- and
range-checked (``_check_metadata``): file names must be plain names inside the
checkpoint directory, offsets and lengths integers; the C++ side checks each
range against the real file, which must be a regular file (Note [Untrusted
byte ranges] in cpp/src/ckpt/range_read.cpp).

Note [DCP striping]
``EbbtideWriter(path, stripe_dirs=[d1, ...])`` spreads each rank's data file
over ``path`` and one stripe directory per entry, as ebbtide.checkpoint does
(docs/checkpoints.md, "Striping"): the coordinator reserves the save through
the core's SaveTransaction (cpp/include/ebbtide/ckpt/transaction.hpp: the
stripe directories ``<d>/<basename>.stripe-<tag>-<id>`` with their
owner.json, made and removed under Note [Stripe ownership] in
cpp/src/ckpt/transaction.cpp), every rank writes ``__<rank>_0.distcp`` with
its chunks round-robin over the shard file and a stripe file of that name in
each stripe directory, and the commit writes ``.ebbtide-stripes.json``
({"id", "stripes"}) beside ``.metadata``: the record the next save reads to
remove the replaced stripes, and the reader reads to find them. A blob's bytes
then lie in several files, so a striped item's ``_StorageInfo`` names the
shard file, the blob's index in the shard as ``offset`` and its size as
``length``, and carries the transform descriptor ``ebbtide-stripe/1``, which
FileSystemReader refuses ("Unknown extension"). EbbtideReader treats the
record as hostile: each entry must be a stripe directory of this checkpoint
(its name, and an owner.json naming this checkpoint path and the record's
id), else ValueError naming the entry.
"""
import io
import os
import pathlib
import pickle
import re

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import _StorageInfo, FileSystem

from ebbtide.checkpoint import tree
from ebbtide.checkpoint import validate as check
from ebbtide import _core
from ebbtide.checkpoint.checks import fail, tag


METADATA_NAME = ".metadata"
DCP_VERSION = "1.0.0"
LAYOUT = "ebbtide-dcp"
LAYOUT_VERSION = 1
COMPRESSED_DESCRIPTOR = "ebbtide-zstd/1"
STRIPED_DESCRIPTOR = "ebbtide-stripe/1"
STRIPE_RECORD = ".ebbtide-stripes.json"
MAX_METADATA_BYTES = 1 << 30


class _DirectoryId:
    """A checkpoint is identified by its directory, as with FileSystemWriter/Reader."""

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return FileSystem.validate_checkpoint_id(checkpoint_id)


def _test_hook(point):
    """Crash tests: EBBTIDE_DCP_TEST_PARK=<point> parks the saving process at
    `point` (after writing a file <tmp>/PARKED) until it is killed."""
    if _core.env_setting("EBBTIDE_DCP_TEST_PARK") == point:
        import time

        marker = _core.env_setting("EBBTIDE_DCP_TEST_PARK_MARKER")
        with open(marker, "w") as f:
            f.write(point)
        while True:
            time.sleep(3600)


_test_gates = {}  # point -> callable, run where _test_hook_gate(point) is reached (tests only)


def _test_hook_gate(point):
    """Tests stage races deterministically: a callable in _test_gates[point]
    runs (and may block) where the code reaches `point`."""
    fn = _test_gates.get(point)
    if fn is not None:
        fn()


# -- metadata --------------------------------------------------------------------------
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n): getattr(_md, n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a lookup in torch's layouts
_ALLOWED[("pathlib", "PosixPath")] = pathlib.PosixPath
_ALLOWED[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Note [DCP metadata safety]: only DCP metadata types can be created."""

    def __init__(self, f, where):
        super().__init__(f)
        self.where = where

    def find_class(self, module, name):
        obj = _ALLOWED.get((module, name))
        if obj is None and module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            obj = getattr(torch, name)
        if obj is None:
            raise fail("dcp.meta.class", self.where, module=module, name=name)
        return obj


def _is_int(x):
    return type(x) is int and 0 <= x <= check.MAX_INT


def _check_metadata(md, where):
    """Checks DCP metadata `md` (read from `where`) field by field (Note [DCP
    metadata safety]), and that its entries and its storage_data name each
    other: every chunk a load may ask for is stored, every stored item is a
    chunk of an entry (so a load of the whole state reads every data file
    inspect checks)."""
    if not isinstance(md, _md.Metadata):
        raise fail("dcp.meta.type", where, type=type(md).__name__)
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise fail("dcp.meta.dicts", where)
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise fail("dcp.meta.fqn", where, fqn=fqn)
        if isinstance(m, _md.BytesStorageMetadata):
            continue
        if not isinstance(m, _md.TensorStorageMetadata) or not isinstance(m.properties, _md.TensorProperties):
            raise fail("dcp.meta.entry", where, fqn=fqn, type=type(m).__name__)
        if not isinstance(m.properties.dtype, torch.dtype):
            raise fail("dcp.meta.dtype", where, fqn=fqn, dtype=m.properties.dtype)
        if not isinstance(m.size, tuple) or len(m.size) > check.MAX_DIMS or not all(map(_is_int, m.size)):
            raise fail("dcp.meta.size", where, fqn=fqn, size=m.size)
        if not isinstance(m.chunks, list):
            raise fail("dcp.meta.chunks", where, fqn=fqn)
        for c in m.chunks:
            if (not isinstance(c, _md.ChunkStorageMetadata) or not isinstance(c.offsets, tuple)
                    or not isinstance(c.sizes, tuple) or len(c.offsets) != len(m.size)
                    or len(c.sizes) != len(m.size) or not all(map(_is_int, c.offsets))
                    or not all(map(_is_int, c.sizes))
                    or any(o + s > n for o, s, n in zip(c.offsets, c.sizes, m.size))):
                raise fail("dcp.meta.chunk", where, fqn=fqn, chunk=c, size=tuple(m.size))
    if md.storage_meta is not None and not isinstance(md.storage_meta, _md.StorageMeta):
        raise fail("dcp.meta.storage_meta", where, type=type(md.storage_meta).__name__)
    for idx, si in md.storage_data.items():
        if (not isinstance(idx, _md.MetadataIndex) or not isinstance(idx.fqn, str)
                or not (idx.offset is None or isinstance(idx.offset, tuple) and all(map(_is_int, idx.offset)))):
            raise fail("dcp.meta.storage_key", where, key=idx)
        if not isinstance(si, _StorageInfo):
            raise fail("dcp.meta.storage_info", where, fqn=idx.fqn, type=type(si).__name__)
        p = si.relative_path
        if (not isinstance(p, str) or p in ("", ".", "..") or "/" in p or "\0" in p or p == METADATA_NAME):
            raise fail("dcp.meta.file_name", where, fqn=idx.fqn, name=p)
        if not _is_int(si.offset) or not _is_int(si.length):
            raise fail("dcp.meta.range", where, fqn=idx.fqn, offset=si.offset, length=si.length)
        d = si.transform_descriptors
        if d is not None and (not isinstance(d, (list, tuple)) or not all(isinstance(x, str) for x in d)):
            raise fail("dcp.meta.transforms", where, fqn=idx.fqn, descriptors=d)
    for fqn, m in md.state_dict_metadata.items():  # MetadataIndex compares by fqn and offset, as DCP's planner asks
        if isinstance(m, _md.BytesStorageMetadata):
            if _md.MetadataIndex(fqn) not in md.storage_data:
                raise fail("dcp.meta.unstored", where, what="bytes entry", fqn=fqn, at="")
            continue
        for c in m.chunks:
            if _md.MetadataIndex(fqn, c.offsets) not in md.storage_data:
                raise fail("dcp.meta.unstored", where, what="chunk of tensor", fqn=fqn, at=f" at {tuple(c.offsets)}")
    chunks = _chunk_table(md)
    for idx in md.storage_data:
        m = md.state_dict_metadata.get(idx.fqn)
        if isinstance(m, _md.BytesStorageMetadata):
            listed = idx.offset is None
        else:
            listed = idx.offset is not None and (idx.fqn, tuple(idx.offset)) in chunks
        if not listed:
            raise fail("dcp.meta.unlisted", where, fqn=idx.fqn, offset=None if idx.offset is None else
                       tuple(idx.offset), what="bytes entry" if isinstance(m, _md.BytesStorageMetadata) else
                       "chunk of a tensor")


def rank_metadata_ranks(path):
    """The ranks with a ``__<rank>.metadata`` in `path` (a save without
    collectives), in order."""
    ranks = []
    for name in os.listdir(path):
        m = re.fullmatch(r"__(\d+)" + re.escape(METADATA_NAME), name)
        if m:
            ranks.append(int(m.group(1)))
    return sorted(ranks)


def _metadata_name(rank=None):
    return METADATA_NAME if rank is None else f"__{int(rank)}{METADATA_NAME}"


def load_metadata(path, rank=None):
    """Reads and checks the ``.metadata`` of DCP checkpoint directory `path`
    (Note [DCP metadata safety]).

    Args:
        path: checkpoint directory.
        rank: read rank `rank`'s ``__<rank>.metadata`` instead, written by a
            save without collectives (Note [DCP without collectives]).

    Returns:
        torch.distributed.checkpoint.metadata.Metadata

    Raises:
        FileNotFoundError: no .metadata (not a DCP checkpoint, or a save that
            was killed before its commit).
        ValueError: the file is not valid, safe DCP metadata.
    """
    mp = os.path.join(os.fspath(path), _metadata_name(rank))
    try:
        raw = check.read_regular_file(mp, "DCP metadata", limit=MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise FileNotFoundError(f"{mp}: no DCP metadata; {path} is not a committed checkpoint (a save killed "
                                "before its commit leaves the previous checkpoint in place and its own files "
                                "in PATH.tmp-*)") from None
    try:
        md = _MetadataUnpickler(io.BytesIO(raw), mp).load()
    except ValueError as e:
        if getattr(e, "check", None):
            raise
        raise fail("dcp.meta.pickle", mp, type=type(e).__name__, error=e) from None
    except Exception as e:  # truncated or corrupt pickle: any of pickle's many error types
        raise fail("dcp.meta.pickle", mp, type=type(e).__name__, error=e) from None
    _check_metadata(md, mp)
    return md


# -- reader ----------------------------------------------------------------------------------
def _check_layout(meta, blobs, file):
    """Checks a shard's JSON metadata written by EbbtideWriter against its blob table."""
    if not isinstance(meta, dict) or meta.get("layout") != LAYOUT or meta.get("version") != LAYOUT_VERSION:
        raise fail("dcp.shard.layout", file, layout=str(meta.get("layout") if isinstance(meta, dict) else meta)[:64])
    items = meta.get("items")
    if not isinstance(items, list) or len(items) != len(blobs):
        raise fail("dcp.shard.items", file, items=len(items) if isinstance(items, list) else "no", blobs=len(blobs))
    for k, (it, b) in enumerate(zip(items, blobs)):
        if not isinstance(it, dict) or it.get("kind") not in ("bytes", "tensor"):
            raise fail("dcp.shard.item_kind", file, k=k)
        if it["kind"] == "bytes":
            continue
        if not isinstance(it.get("dtype"), str):
            raise fail("dcp.shard.item_dtype", file, k=k)
        dtype = tree.dtype_from_name(it["dtype"], f"{file}: item {k}")
        size, stride, head = it.get("size"), it.get("stride"), it.get("head")
        if (not isinstance(size, list) or not isinstance(stride, list) or len(size) != len(stride)
                or len(size) > check.MAX_DIMS or not all(map(_is_int, size + stride)) or not _is_int(head)):
            raise fail("dcp.shard.item_layout", file, k=k, size=size, stride=stride, head=head)
        extent = 0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride))
        need = extent * dtype.itemsize
        if need and (head % dtype.itemsize or head + need > b["nbytes"]):
            raise fail("dcp.shard.item_fit", file, k=k, name=b["name"][:200], size=tuple(size), dtype=dtype,
                       head=head, nbytes=b["nbytes"])
        it["_dtype"], it["_nbytes"] = dtype, need  # the bytes the tensor spans from `head`
    return items


def read_stripe_dirs(path):
    """The stripe directories of DCP checkpoint directory `path` (Note [DCP
    striping]), from its stripe record, each checked to be a stripe directory
    of this checkpoint: [] for an unstriped checkpoint; ValueError naming the
    record and a refused entry."""
    rp = os.path.join(os.fspath(path), STRIPE_RECORD)
    try:
        raw = check.read_regular_file(rp, "stripe record")
    except FileNotFoundError:
        return []
    try:
        rec = check.parse_json(raw)
    except (ValueError, RecursionError) as e:
        raise fail("dcp.stripes.json", rp, error=e) from None
    ckpt_id = rec.get("id") if isinstance(rec, dict) else None
    dirs = rec.get("stripes") if isinstance(rec, dict) else None
    if not isinstance(ckpt_id, str) or not check.ID.fullmatch(ckpt_id) or not isinstance(dirs, list) or \
            len(dirs) > 255:
        raise fail("dcp.stripes.fields", rp)
    owner = os.path.abspath(os.fspath(path))
    for d in dirs:
        try:
            ok = isinstance(d, str) and _core.ckpt_owned_stripe_dir(d, owner, ckpt_id)
        except (TypeError, UnicodeError):  # a string the core cannot take (lone surrogates)
            ok = False
        if not ok:
            raise fail("dcp.stripes.entry", rp, entry=str(d)[:200], path=owner, id=ckpt_id)
    return dirs


class _Shard:
    """An ebbtide shard written by EbbtideWriter, opened and checked; its
    stripe files in `stripes` (Note [DCP striping])."""

    def __init__(self, file, stripes=()):
        self.stripe_files = [os.path.join(d, os.path.basename(file)) for d in stripes]
        try:
            self.reader = _core.CkptReader(file, stripes=self.stripe_files)
        except check.READER_ERRORS as e:
            raise tag(e, "dcp.shard.tables")
        try:
            self.reader.check_extents()
        except check.READER_ERRORS as e:
            raise tag(e, "dcp.shard.extents")
        self.blobs = self.reader.blobs
        try:
            meta = check.parse_json(self.reader.meta)
        except (ValueError, RecursionError) as e:
            raise fail("dcp.shard.json", file, error=e) from None
        self.items = _check_layout(meta, self.blobs, file)
        self.by_range = {(b["offset"], b["nbytes"]): k for k, b in enumerate(self.blobs)}
        self.file = file

    def blob_of(self, si, fqn):
        """The blob that DCP storage info `si` (of item `fqn`) names: by its
        byte range, or in a striped shard by its index; ValueError when it
        names none or its transform descriptors do not match the blob."""
        desc = list(si.transform_descriptors or ())
        striped = desc[:1] == [STRIPED_DESCRIPTOR]
        if striped != bool(self.stripe_files):
            kind = f"striped over {len(self.stripe_files)} stripe files" if self.stripe_files else "unstriped"
            raise fail("dcp.item.striping", self.file, fqn=fqn, descriptors=desc, kind=kind)
        if striped:
            k = si.offset if si.offset < len(self.blobs) and self.blobs[si.offset]["nbytes"] == si.length else None
        else:
            k = self.by_range.get((si.offset, si.length))
        if k is None:
            raise fail("dcp.item.blob", self.file, fqn=fqn, what="blob" if striped else "bytes", offset=si.offset,
                       length=si.length, verb="is" if striped else "are")
        rest = desc[1:] if striped else desc  # the stripe descriptor comes first
        if rest not in ([], [COMPRESSED_DESCRIPTOR]) or (self.blobs[k]["codec"] != "none" and not rest):
            raise fail("dcp.item.transforms", self.file, fqn=fqn, descriptors=si.transform_descriptors,
                       codec=self.blobs[k]["codec"])
        return k


def _chunk_table(md):
    """{(fqn, offsets): chunk} of every tensor entry's chunks."""
    return {(fqn, tuple(c.offsets)): c for fqn, m in md.state_dict_metadata.items()
            if isinstance(m, _md.TensorStorageMetadata) for c in m.chunks}


def _check_stored_tensor(md, chunks, idx, dtype, size, file, check_id):
    """A stored chunk of tensor entry idx.fqn has the dtype and sizes the
    metadata gives it (what a load into a state shaped as the metadata says
    needs). `chunks`: _chunk_table(md), in which _check_metadata found it."""
    m = md.state_dict_metadata[idx.fqn]
    sizes = list(chunks[(idx.fqn, tuple(idx.offset))].sizes)
    if dtype != m.properties.dtype or list(size) != sizes:
        raise fail(check_id, file, fqn=idx.fqn, dtype=str(dtype).replace("torch.", ""), size=list(size),
                   md_dtype=str(m.properties.dtype).replace("torch.", ""), md_size=sizes)


class _DataFile:
    """A data file of a DCP checkpoint, checked as a load needs it (Note [One
    validator] in checks.py): `shard` (an ebbtide shard, its items'
    blobs and layouts checked against the metadata) or None (a plain file of
    torch's FileSystemWriter, its byte ranges inside it); `size` its bytes;
    `entries` its (MetadataIndex, _StorageInfo); `chunks` _chunk_table(md);
    `stripes()` the checkpoint's stripe directories."""

    def __init__(self, path, md, chunks, name, entries, stripes):
        self.file = os.path.join(path, name)
        self.entries = entries
        try:
            self.size, is_shard = _core.ckpt_probe_file(self.file)
        except check.READER_ERRORS as e:
            raise tag(e, "dcp.file")
        self.shard = None
        if not is_shard:
            for idx, si in entries:
                if si.offset + si.length > self.size:
                    raise fail("dcp.plain.range", self.file, fqn=idx.fqn, offset=si.offset, length=si.length,
                               size=self.size)
                if si.transform_descriptors:
                    raise fail("dcp.plain.transforms", self.file, fqn=idx.fqn, descriptors=si.transform_descriptors)
            return
        shard = _Shard(self.file, stripes())
        blobs = [shard.blob_of(si, idx.fqn) for idx, si in entries]
        named = set(blobs)
        for k, b in enumerate(shard.blobs):  # a load reads the blobs the metadata names
            if k not in named:
                raise fail("dcp.shard.blob_unused", self.file, k=k, name=b["name"][:200])
        for (idx, _), k in zip(entries, blobs):
            it = shard.items[k]
            listed = isinstance(md.state_dict_metadata[idx.fqn], _md.TensorStorageMetadata)
            if (it["kind"] == "tensor") != listed:
                raise fail("dcp.item.kind", self.file, fqn=idx.fqn, stored="bytes" if listed else "a tensor",
                           listed="a tensor" if listed else "bytes")
            if listed:
                _check_stored_tensor(md, chunks, idx, it["_dtype"], it["size"], self.file, "dcp.item.tensor")
        self.shard = shard

    def plain_tensor(self, md, chunks, idx, si, buf):
        """The tensor torch.save'd in bytes `buf` of item `idx` of this plain
        file, checked to be the chunk the metadata lists (data checks: load()
        and a verifying inspect make them)."""
        try:
            t = torch.load(io.BytesIO(buf.numpy()), map_location="cpu", weights_only=True)
        except Exception as e:
            raise fail("dcp.plain.frame", self.file, fqn=idx.fqn, offset=si.offset, length=si.length,
                       error=f"{type(e).__name__}: {str(e)[:300]}") from None
        if not isinstance(t, torch.Tensor):
            raise fail("dcp.plain.object", self.file, fqn=idx.fqn, type=type(t).__name__)
        _check_stored_tensor(md, chunks, idx, t.dtype, t.shape, self.file, "dcp.plain.tensor")
        return t


def _files_of(md):
    """{data file name: [(MetadataIndex, _StorageInfo), ...]} of checked metadata."""
    out = {}
    for idx, si in md.storage_data.items():
        out.setdefault(si.relative_path, []).append((idx, si))
    return out
