"""The DCP plugin's reader: ``EbbtideReader`` for ``dcp.load`` (ebbtide shards
through the C++ reader, checksums verified; FileSystemWriter's files by checked
byte ranges) and ``inspect`` (``ebbtide ckpt inspect`` on a DCP checkpoint).
The file layout and its Notes are in dcp_format.py.
"""
import io
import math
import os
import uuid

import torch
from torch.futures import Future
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed._shard._utils import narrow_tensor_by_index

from ebbtide.checkpoint import tree
from ebbtide.checkpoint import validate as check
from ebbtide import _core
from ebbtide.checkpoint.checks import tag
from ebbtide.checkpoint.native_load import _host_buffer
from ebbtide.checkpoint.dcp_format import (METADATA_NAME, _DataFile, _DirectoryId, _check_metadata,
                                           _chunk_table, _files_of, _metadata_name, load_metadata,
                                           read_stripe_dirs)
from ebbtide.checkpoint.dcp_writer import _direct_devices


class EbbtideReader(_DirectoryId, StorageReader):
    """DCP StorageReader reading through ebbtide's C++ reader. Loads
    checkpoints written by EbbtideWriter (checksums verified, compressed or
    not) and by torch's FileSystemWriter.

    Args:
        path: checkpoint directory.
        threads: reader threads (0: the reader's default).
        batch_bytes: most bytes of one file read ahead at once.

    Raises:
        FileNotFoundError: no .metadata in `path` (read_metadata).
        ValueError: hostile or corrupt metadata or data, naming the file and
            the item (Note [DCP metadata safety]).
        ebbtide._core.ChecksumError: data that fails its crc32c.

    Example:
        >>> dcp.load(state, storage_reader=EbbtideReader("/ckpt/step100"))
    """

    def __init__(self, path, *, threads=0, batch_bytes=256 << 20):
        super().__init__()
        self.path = os.fspath(path)
        self.threads = threads
        self.batch_bytes = batch_bytes
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())
        self._stripes = None

    def reset(self, checkpoint_id=None):
        self.storage_data = {}
        self._stripes = None
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args, **kwargs):
        # rank: the rank-local metadata of a save without collectives (Note
        # [DCP without collectives]); DCP asks for it when .metadata is missing.
        rank = kwargs.get("rank")
        self._stripes = None  # a reader kept across loads (no reset) reads the stripes of the checkpoint as it is now
        self._metadata_file = os.path.join(self.path, _metadata_name(rank))
        md = load_metadata(self.path, rank=rank)
        if md.storage_meta is None:
            md.storage_meta = _md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        _check_metadata(metadata, getattr(self, "_metadata_file", os.path.join(self.path, METADATA_NAME)))
        self.metadata = metadata
        self.storage_data = metadata.storage_data
        self._chunks = _chunk_table(metadata)

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        per_file = {}
        for req in plan.items:
            si = self.storage_data.get(req.storage_index)
            if si is None:
                raise ValueError(f"{self.path}: the load plan asks for {req.storage_index}, which the checkpoint's "
                                 "metadata does not list")
            per_file.setdefault(si.relative_path, []).append(req)
        entries = _files_of(self.metadata)
        for name, reqs in per_file.items():
            # Each file read is checked whole first, as inspect checks it (Note [One validator] in checks.py).
            f = _DataFile(self.path, self.metadata, self._chunks, name, entries[name], self._stripe_dirs)
            if f.shard is not None:
                self._read_shard(f.shard, reqs, planner)
            else:
                self._read_plain(f, reqs, planner)
        fut = Future()
        fut.set_result(None)
        return fut

    def _stripe_dirs(self):
        if self._stripes is None:
            self._stripes = read_stripe_dirs(self.path)
        return self._stripes

    def _batches(self, reqs, size_of):
        batch, total = [], 0
        for r in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
            n = size_of(r)
            if batch and total + n > self.batch_bytes:
                yield batch
                batch, total = [], 0
            batch.append(r)
            total += n
        if batch:
            yield batch

    def _read_shard(self, shard, reqs, planner):
        def blob_of(r):
            return shard.blob_of(self.storage_data[r.storage_index], r.storage_index.fqn)

        for batch in self._batches(reqs, lambda r: self.storage_data[r.storage_index].length):
            bufs, into, rest = {}, [], []  # rest: (request, blob) read through a buffer of the blob
            for r in batch:
                k = blob_of(r)
                target = self._whole_target(shard, k, r, planner)
                if target is not None:
                    into.append((r, target, (k, shard.items[k]["head"], target.data_ptr(), target.nbytes,
                                             target.device.type == "cuda", tree.core_stream(target.device))))
                    continue
                rest.append((r, k))
                if k not in bufs:
                    bufs[k] = _host_buffer(shard.blobs[k]["nbytes"])
            try:  # every chunk of the blobs is checked (Note [Parts are checked whole] in cpp/src/ckpt/reader.cpp)
                if into:
                    shard.reader.read_parts([part for _, _, part in into], threads=self.threads)
                if bufs:
                    shard.reader.read([(k, b.data_ptr(), b.nbytes, False, 0) for k, b in bufs.items()],
                                      threads=self.threads)
            except check.READER_ERRORS as e:
                raise tag(e, "ckpt.chunk")
            for r, target, _ in into:
                planner.commit_tensor(r, target)
            for r, k in rest:  # each item's kind is the metadata's (_DataFile), so DCP's request's
                it, buf = shard.items[k], bufs[k]
                if r.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(r, io.BytesIO(buf.numpy().tobytes()))
                    continue
                if it["_nbytes"] == 0:
                    t = torch.empty(it["size"], dtype=it["_dtype"])
                else:
                    data = buf[it["head"]:it["head"] + it["_nbytes"]].view(it["_dtype"])
                    t = torch.as_strided(data, it["size"], it["stride"])
                self._commit(planner, r, t, shard.file)

    # Note [Reading into the targets]
    # A load into an existing state (the usual resume) asks for whole stored
    # tensors into tensors of the same dtype, shape and layout. Those are read
    # straight into the target: the tensor's bytes inside its torch.save frame
    # are a byte range of the blob (ShardReader::read with a part, checksums
    # verified chunk by chunk as ever), so no buffer of the blob is allocated
    # (fresh memory costs more than the read on some VMs: docs/benchmarks.md)
    # and nothing is copied twice. CUDA targets too (FSDP's shards on the
    # GPU), where the core can drive CUDA: each chunk goes from its pinned
    # staging buffer to the device on the target's current stream, and the
    # read waits for those copies. Resharded requests, other dtypes or
    # layouts and bytes items take the buffer path.
    @staticmethod
    def _whole_target(shard, k, req, planner):
        it = shard.items[k]
        if req.type == LoadItemType.BYTE_IO or it["kind"] != "tensor":
            return None  # the buffer path reports a kind mismatch
        size, stride = it["size"], it["stride"]
        if 0 in size or list(req.storage_offsets) != [0] * len(size) or list(req.lengths) != size:
            return None
        want, acc = [], 1
        for n in reversed(size):
            want.append(acc)
            acc *= n
        if stride != want[::-1]:
            return None
        target = planner.resolve_tensor(req).detach()
        if (target.device.type not in _direct_devices() or target.dtype != it["_dtype"] or list(target.shape) != size
                or not target.is_contiguous() or target.is_conj() or target.is_neg()):
            return None
        return target

    def _read_plain(self, f, reqs, planner):
        """Reads the items `reqs` of plain file `f` (a _DataFile, its ranges checked)."""
        for batch in self._batches(reqs, lambda r: self.storage_data[r.storage_index].length):
            ranges, bufs = [], {}
            for r in batch:
                si = self.storage_data[r.storage_index]
                key = (si.offset, si.length)
                if key not in bufs:
                    bufs[key] = torch.empty(si.length, dtype=torch.uint8)
                    ranges.append((si.offset, si.length, bufs[key].data_ptr()))
            _core.ckpt_read_file_ranges(f.file, ranges)
            for r in batch:
                si = self.storage_data[r.storage_index]
                buf = bufs[(si.offset, si.length)]
                if r.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(r, io.BytesIO(buf.numpy().tobytes()))
                    continue
                self._commit(planner, r, f.plain_tensor(self.metadata, self._chunks, r.storage_index, si, buf), f.file)

    @staticmethod
    def _commit(planner, req, tensor, file):
        if any(o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, tensor.shape)) or \
                len(req.storage_offsets) != tensor.dim():
            raise ValueError(f"{file}: item {req.storage_index.fqn!r}: stored chunk of shape {tuple(tensor.shape)} "
                             f"does not hold the requested offsets {tuple(req.storage_offsets)} and lengths "
                             f"{tuple(req.lengths)}")
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise ValueError(f"{file}: item {req.storage_index.fqn!r}: stored shape {tuple(tensor.size())} does not "
                             f"match the target's {tuple(target.size())}")
        if target.dtype != tensor.dtype:
            raise ValueError(f"{file}: item {req.storage_index.fqn!r}: stored dtype {tensor.dtype} does not match "
                             f"the target's {target.dtype}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


# -- inspection ------------------------------------------------------------------------------
def inspect(path, verify=True, rank=None, progress=None):
    """What `ebbtide ckpt inspect` shows of DCP checkpoint directory `path`
    (with `rank`: of that rank's part of a save without collectives, Note
    [DCP without collectives]), checked as EbbtideReader checks what it loads,
    by the same code (Note [One validator] in checks.py).

    Returns a dict: ``path``, ``items`` (one per state-dict entry: ``fqn``,
    ``kind`` "tensor" | "bytes", ``dtype``, ``size``, ``chunks``, ``bytes``),
    ``files`` (one per data file: ``file``, ``writer`` "ebbtide" |
    "FileSystemWriter", ``file_bytes``, ``items``, ``bytes``, ``codecs``, for
    ebbtide's files ``stripe_files``, Note [DCP striping]) and
    ``errors`` (one line each: a data file a load would refuse, with its
    reason; with `verify` also a chunk failing its checksum or decoding, and
    a plain file's item that is not the torch.save'd chunk the metadata
    lists). Without `verify` no tensor data is read. `progress`: optional
    f(done_bytes, total_bytes), called after each data file with the bytes
    the metadata gives the files checked so far.

    Raises:
        FileNotFoundError, ValueError: no or unusable ``.metadata`` (load_metadata).
    """
    path = os.fspath(path)
    md = load_metadata(path, rank=rank)
    items = []
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, _md.TensorStorageMetadata):
            items.append(dict(fqn=fqn, kind="tensor", dtype=str(m.properties.dtype).replace("torch.", ""),
                              size=list(m.size), chunks=len(m.chunks),
                              bytes=math.prod(m.size) * m.properties.dtype.itemsize))
        else:
            items.append(dict(fqn=fqn, kind="bytes", dtype=None, size=None, chunks=1, bytes=None))
    per_file = _files_of(md)
    chunks = _chunk_table(md)
    stripes = []

    def stripe_dirs():
        if not stripes:
            stripes.append(read_stripe_dirs(path))
        return stripes[0]

    files, errors = [], []
    total = sum(si.length for entries in per_file.values() for _, si in entries)
    done = 0
    for name in sorted(per_file):
        if progress is not None:
            progress(done, total)
        infos = [si for _, si in per_file[name]]
        entry = dict(file=name, items=len(infos), bytes=sum(si.length for si in infos))
        done += entry["bytes"]
        files.append(entry)
        try:
            f = _DataFile(path, md, chunks, name, per_file[name], stripe_dirs)
        except check.READER_ERRORS as e:
            errors.append(str(e))
            continue
        entry["file_bytes"] = f.size
        entry["writer"] = "ebbtide" if f.shard is not None else "FileSystemWriter"
        if f.shard is not None:
            entry["codecs"] = sorted({b["codec"] for b in f.shard.blobs})
            entry["stripe_files"] = f.shard.stripe_files
            if verify:
                for _blob, _off, msg in f.shard.reader.verify():
                    errors.append(msg)
            continue
        entry["codecs"] = ["none"]
        if verify:
            errors.extend(_verify_plain(f, md, chunks))
    if progress is not None:
        progress(total, total)
    return dict(path=path, items=items, files=files, errors=errors)


def _verify_plain(f, md, chunks):
    """The data checks EbbtideReader makes on the tensor items of plain file
    `f`, one item at a time: [error line, ...]."""
    errors = []
    for idx, si in f.entries:
        if not isinstance(md.state_dict_metadata[idx.fqn], _md.TensorStorageMetadata):
            continue
        buf = torch.empty(si.length, dtype=torch.uint8)
        try:
            _core.ckpt_read_file_ranges(f.file, [(si.offset, si.length, buf.data_ptr())])
            f.plain_tensor(md, chunks, idx, si, buf)
        except check.READER_ERRORS as e:
            errors.append(str(e))
    return errors
