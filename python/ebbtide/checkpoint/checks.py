"""Every check a checkpoint load can fail, in one table (Note [One validator]).

Note [One validator]
`load()` and `ebbtide ckpt inspect` must never disagree about a file: a user
runs inspect to decide whether a long job may resume from a checkpoint. So
each format has one validator, which both call: `validate.open_chain`
(ebbtide checkpoints and their delta chains), `dcp_format._DataFile` with
`dcp.load_metadata` (torch.distributed.checkpoint) and `_safetensors._shards`
(safetensors), on top of the C++ readers' own checks. Every refusal they make
is one entry of CHECKS below: a stable id, the exception type and a message
template. `fail(id, where, ...)` builds the exception and tags it with the id
(`exc.check`); a refusal by a C++ reader is tagged with the id of its entry
(`tag`), whose message comes from C++ and whose rules are listed where
`rules` points.

Checks marked `data` need the tensor bytes (checksums, sparse indices,
lossy codes, torch.save frames): `load()` meets them while reading and
inspect makes them only when it verifies (its default; `--no-verify` reads
no tensor data). Everything else is decided from the metadata, before any
tensor memory is allocated, by both.

python/tests/test_ckpt_validation.py walks this table: for each entry it
crafts a file that breaks it (checksums recomputed) and asserts that `load()`
raises the entry's id and that inspect exits non-zero printing the same
message, so a check added here without a crafted file fails that test.
Arguments of a load (a rank out of range, `into=` targets of another shape, a
device this machine lacks) are not properties of the file and not listed.
"""
import dataclasses
import errno


@dataclasses.dataclass(frozen=True)
class Check:
    id: str
    exc: type          # what load() raises (ValueError, NotImplementedError, OSError, ...; a tuple for C++ rules)
    message: str       # str.format template; fail() puts "WHERE: " in front
    data: bool = False  # needs the tensor data: inspect reports it only when verifying
    rules: str = ""    # checked in C++: where its rules are listed (its message comes from there)


_C = Check
_CXX = (ValueError, OSError, NotImplementedError)  # what the C++ readers raise for a file they refuse
_TABLE = [
    # -- files of every format ------------------------------------------------------------------
    _C("file.symlink", ValueError, "{what} is a symbolic link; only regular files are read"),
    _C("file.special", ValueError, "{what} is not a regular file; only regular files are read"),
    _C("file.too_large", ValueError, "{what} has {size} bytes, more than the {limit} a checkpoint writes"),

    # -- ebbtide checkpoints: index.json --------------------------------------------------------
    _C("ckpt.index.no_directory", FileNotFoundError, "checkpoint directory does not exist"),
    _C("ckpt.index.missing", FileNotFoundError, "not an ebbtide checkpoint (no {name})"),
    _C("ckpt.index.json", ValueError, "corrupt checkpoint index ({error})"),
    _C("ckpt.index.format", ValueError, "not an ebbtide checkpoint index"),
    _C("ckpt.index.version", NotImplementedError,
       "checkpoint format version {version!r} is not supported by this ebbtide (it reads versions 1 to "
       "{known}); upgrade ebbtide to load it"),
    _C("ckpt.index.id", ValueError, "corrupt checkpoint index (id {id!r} is not a hex string)"),
    _C("ckpt.index.world_size", ValueError,
       "corrupt checkpoint index (world_size {world!r} is not a positive integer)"),
    _C("ckpt.index.shards", ValueError, "corrupt checkpoint index (shards must be a list of {world} file names)"),
    _C("ckpt.index.shard_name", ValueError,
       "corrupt checkpoint index ({what} {name!r} is not a file name inside the checkpoint directory)"),
    _C("ckpt.index.stripes", ValueError,
       "corrupt checkpoint index (stripes must be a list of at most 255 directory paths)"),
    _C("ckpt.index.compress", ValueError, "corrupt checkpoint index (compress is not a string)"),
    _C("ckpt.index.stripe_dir", ValueError,
       "corrupt checkpoint index (stripes entry {entry!r} is not an absolute path of a stripe directory of "
       "checkpoint {id})"),
    _C("ckpt.delta.entry", ValueError, "corrupt delta entry {delta!r} (needs base and base_id strings)"),

    # -- ebbtide checkpoints: a shard's file, tables and stripe files (C++) ---------------------
    _C("ckpt.shard.tables", _CXX, "",
       rules="ShardReader's constructor: the file (regular, readable), superblock, header and tables "
             "(Note [Hostile headers] in cpp/src/ckpt/format.cpp, docs/checkpoint-format.md \"Validation\")"),
    _C("ckpt.shard.extents", _CXX, "",
       rules="ShardReader::check_extents: every stripe file opens and is stripe k of the shard, and every "
             "chunk lies inside its file (cpp/src/ckpt/reader.cpp)"),

    # -- ebbtide checkpoints: a shard's metadata -------------------------------------------------
    _C("ckpt.meta.json", ValueError, "corrupt checkpoint metadata ({error})"),
    _C("ckpt.meta.object", ValueError, "corrupt checkpoint metadata (not a JSON object)"),
    _C("ckpt.meta.lists", ValueError, "corrupt checkpoint metadata (storages and tensors must be lists)"),
    _C("ckpt.meta.tree", ValueError, "corrupt checkpoint metadata (no object tree)"),
    _C("ckpt.meta.id", ValueError, "corrupt checkpoint metadata (id is not a string)"),
    _C("ckpt.meta.other_checkpoint", ValueError, "shard {name} belongs to checkpoint {shard_id}, the index to {id}"),
    _C("ckpt.storage.fields", ValueError,
       "corrupt checkpoint metadata (storage {i} needs an integer nbytes and a device string)"),
    _C("ckpt.storage.device", ValueError, "corrupt checkpoint metadata (storage {i}: device {device!r} {why})"),
    _C("ckpt.storage.blob", ValueError,
       "corrupt checkpoint metadata (storage {i} names blob {blob!r}; the shard has {n})"),
    _C("ckpt.storage.blob_twice", ValueError,
       "corrupt checkpoint metadata (storages {first} and {i} both name blob {blob})"),
    _C("ckpt.storage.nbytes", ValueError,
       "corrupt checkpoint metadata (storage {i} of {name} has {blob_bytes} bytes in the shard, {nbytes} in the "
       "metadata)"),
    _C("ckpt.storage.blob_unused", ValueError,
       "corrupt checkpoint metadata (blob {blob} ({name}) belongs to no storage: nothing would read it)"),
    _C("ckpt.tensor.path", ValueError, "corrupt checkpoint metadata (tensor {i} needs a path string)"),
    _C("ckpt.tensor.shape", ValueError, "corrupt checkpoint metadata ({t}: shape {shape} is not a list of sizes)"),
    _C("ckpt.tensor.numel", ValueError, "corrupt checkpoint metadata ({t}: shape {shape} has more than 2^62 elements)"),
    _C("ckpt.tensor.layout", ValueError,
       "corrupt checkpoint metadata ({t}: layout {layout!r} is not strided or sparse_coo)"),
    _C("ckpt.tensor.dtype", ValueError, "corrupt checkpoint metadata ({t}: dtype is not a string)"),
    _C("ckpt.tensor.stride", ValueError,
       "corrupt checkpoint metadata ({t}: stride {stride} does not match shape {shape})"),
    _C("ckpt.tensor.offset", ValueError,
       "corrupt checkpoint metadata ({t}: offset {offset!r} is not a non-negative integer)"),
    _C("ckpt.tensor.storage", ValueError,
       "corrupt checkpoint metadata ({t}: storage {sid!r} out of range ({n} storages))"),
    _C("ckpt.tensor.flag", ValueError, "corrupt checkpoint metadata ({t}: {flag} is not a bool)"),
    _C("ckpt.tensor.extent", ValueError,
       "corrupt checkpoint metadata ({t}: shape {shape}, stride {stride} and offset {offset} reach byte {end} of "
       "storage {sid}, which has {nbytes} bytes)"),
    _C("ckpt.tensor.requires_grad", ValueError, "tensor {path!r}: {error}"),
    _C("ckpt.sparse.refs", ValueError,
       "corrupt checkpoint metadata ({t}: {what} {ref!r} is not an earlier strided tensor)"),
    _C("ckpt.sparse.layout", ValueError, "sparse tensor {path!r} is corrupt ({error})"),
    _C("ckpt.sparse.indices", ValueError, "sparse tensor {path!r} is corrupt ({error})", data=True),
    _C("dtype.unknown", ValueError, "dtype {name!r} is not known to this torch build"),

    # -- ebbtide checkpoints: the object tree ----------------------------------------------------
    _C("ckpt.tree.tensor", ValueError,
       "corrupt object tree (it refers to tensor {ref}; the checkpoint has {n} tensors)"),
    _C("ckpt.tree.node", ValueError, "corrupt object tree (node {node!r})"),
    _C("ckpt.tree.key", ValueError, "corrupt object tree (a key of type {type})"),
    _C("ckpt.tree.depth", ValueError, "corrupt object tree (containers nested more than {limit} deep)"),

    # -- ebbtide checkpoints: delta chains --------------------------------------------------------
    _C("ckpt.delta.base_missing", FileNotFoundError, "delta checkpoint {delta} needs its base, which does not exist"),
    _C("ckpt.delta.base_id", ValueError,
       "delta checkpoint needs base {base} with id {want}, but that directory now holds checkpoint {have}"),
    _C("ckpt.delta.cycle", ValueError, "delta checkpoint's chain of bases comes back to {base}"),
    _C("ckpt.delta.base_rank", ValueError,
       "delta checkpoint's shard {rank} needs shard {rank} of its base {base}, which has {world}"),
    _C("ckpt.delta.tensor", ValueError, "corrupt lossy delta tensor {path} ({what})"),
    _C("ckpt.delta.base_tensor", ValueError,
       "delta-compressed tensor {path} has no tensor of its shape {shape} in the base"),
    _C("ckpt.delta.values", ValueError, "corrupt lossy delta tensor {path} ({error})", data=True),

    # -- ebbtide checkpoints and DCP shards: the data (C++) --------------------------------------
    _C("ckpt.chunk", _CXX, "", data=True,
       rules="ShardReader::read and ::verify: each chunk's crc32c (ChecksumError) and decoding "
             "(cpp/src/ckpt/reader.cpp)"),

    # -- safetensors -----------------------------------------------------------------------------
    _C("st.directory", FileNotFoundError, "no {index} or {single} in the directory{found}"),
    _C("st.index.json", ValueError, "corrupt safetensors index ({error})"),
    _C("st.index.weight_map", ValueError, "not a safetensors index (no weight_map object)"),
    _C("st.index.file", ValueError,
       "tensor {name!r} maps to {file!r}, which is not a file name in the index's directory"),
    _C("st.file", _CXX, "",
       rules="SafetensorsReader's constructor: the file (regular, readable) and its header (Note [Hostile "
             "safetensors] in cpp/src/ckpt/safetensors.cpp, docs/checkpoints.md \"safetensors\")"),
    _C("st.shard.missing", ValueError, "tensor {name!r} (mapped to this file by {index}) is not in it{more}"),
    _C("st.shard.extra", ValueError, "tensor {name!r} is in this file but {index} does not map it here{more}"),
    _C("st.dtype", NotImplementedError, "tensor {name!r} has dtype {dtype}, which has no torch dtype here"),

    # -- torch.distributed.checkpoint: .metadata ---------------------------------------------------
    _C("dcp.meta.class", ValueError,
       "refers to {module}.{name}, which is not a DCP metadata type; refusing to load it (a DCP .metadata holds "
       "only checkpoint metadata)"),
    _C("dcp.meta.pickle", ValueError, "corrupt DCP metadata ({type}: {error})"),
    _C("dcp.meta.type", ValueError, "holds a {type}, not DCP Metadata"),
    _C("dcp.meta.dicts", ValueError, "state_dict_metadata and storage_data must be dicts"),
    _C("dcp.meta.fqn", ValueError, "state_dict_metadata key {fqn!r} is not a string"),
    _C("dcp.meta.entry", ValueError, "entry {fqn!r} is a {type}, not tensor or bytes metadata"),
    _C("dcp.meta.dtype", ValueError, "tensor {fqn!r}: dtype {dtype!r} is not a torch dtype"),
    _C("dcp.meta.size", ValueError, "tensor {fqn!r}: size {size!r} is not a shape"),
    _C("dcp.meta.chunks", ValueError, "tensor {fqn!r}: chunks is not a list"),
    _C("dcp.meta.chunk", ValueError, "tensor {fqn!r}: chunk {chunk!r} does not lie inside the tensor of size {size}"),
    _C("dcp.meta.storage_meta", ValueError, "storage_meta is a {type}, not StorageMeta"),
    _C("dcp.meta.storage_key", ValueError, "storage_data key {key!r} is not a MetadataIndex of a name and offsets"),
    _C("dcp.meta.storage_info", ValueError, "storage_data[{fqn!r}] is a {type}, not _StorageInfo"),
    _C("dcp.meta.file_name", ValueError,
       "storage_data[{fqn!r}]: file name {name!r} is not a plain file name inside the checkpoint directory"),
    _C("dcp.meta.range", ValueError,
       "storage_data[{fqn!r}]: offset {offset!r} / length {length!r} must be integers >= 0"),
    _C("dcp.meta.transforms", ValueError,
       "storage_data[{fqn!r}]: transform_descriptors {descriptors!r} is not a list of strings"),
    _C("dcp.meta.unstored", ValueError, "{what} {fqn!r}{at} has no storage_data entry: a load could not read it"),
    _C("dcp.meta.unlisted", ValueError,
       "storage_data[{fqn!r}] (offset {offset}) is not a {what} of state_dict_metadata: no load would read it"),

    # -- torch.distributed.checkpoint: the stripe record ------------------------------------------
    _C("dcp.stripes.json", ValueError, "corrupt stripe record ({error})"),
    _C("dcp.stripes.fields", ValueError, "corrupt stripe record (needs a hex id and a list of at most 255 stripes)"),
    _C("dcp.stripes.entry", ValueError,
       "stripes entry {entry!r} is not a stripe directory of checkpoint {path} (id {id}): refusing to read it"),

    # -- torch.distributed.checkpoint: data files --------------------------------------------------
    _C("dcp.file", _CXX, "",
       rules="ckpt_probe_file: a data file opens as a regular file (cpp/src/ckpt/range_read.cpp)"),
    _C("dcp.shard.tables", _CXX, "", rules="as ckpt.shard.tables, for an ebbtide .distcp file"),
    _C("dcp.shard.extents", _CXX, "", rules="as ckpt.shard.extents, for an ebbtide .distcp file"),
    _C("dcp.shard.json", ValueError, "corrupt shard metadata ({error})"),
    _C("dcp.shard.layout", ValueError, "not an ebbtide DCP shard (layout {layout!r})"),
    _C("dcp.shard.items", ValueError, "metadata lists {items} items for {blobs} blobs"),
    _C("dcp.shard.item_kind", ValueError, "item {k}: kind must be 'bytes' or 'tensor'"),
    _C("dcp.shard.item_dtype", ValueError, "item {k}: dtype missing"),
    _C("dcp.shard.item_layout", ValueError,
       "item {k}: size {size!r}, stride {stride!r}, head {head!r} are not a tensor layout"),
    _C("dcp.shard.item_fit", ValueError,
       "item {k} ({name}): {size} {dtype} at byte {head} does not fit its {nbytes}-byte blob"),
    _C("dcp.shard.blob_unused", ValueError,
       "blob {k} ({name}) is named by no entry of the DCP metadata: nothing would read it"),
    _C("dcp.item.blob", ValueError,
       "item {fqn!r} names {what} [{offset}, +{length}) that {verb} not a blob of this shard"),
    _C("dcp.item.striping", ValueError,
       "item {fqn!r}: transform descriptors {descriptors!r} do not match the shard ({kind})"),
    _C("dcp.item.transforms", ValueError,
       "item {fqn!r}: transform descriptors {descriptors!r} do not match its blob (codec {codec})"),
    _C("dcp.item.kind", ValueError, "item {fqn!r} is {stored} in the file, {listed} in the DCP metadata"),
    _C("dcp.item.tensor", ValueError,
       "item {fqn!r}: the file holds {dtype} {size}, the DCP metadata a chunk of {md_dtype} {md_size}"),
    _C("dcp.plain.range", ValueError,
       "item {fqn!r}: byte range [{offset}, +{length}) lies outside the file ({size} bytes)"),
    _C("dcp.plain.transforms", ValueError,
       "item {fqn!r} uses stream transforms {descriptors!r}, which EbbtideReader does not read; load it with "
       "FileSystemReader"),
    _C("dcp.plain.frame", ValueError, "item {fqn!r} at [{offset}, +{length}) is not a torch.save'd tensor ({error})",
       data=True),
    _C("dcp.plain.object", ValueError, "item {fqn!r} holds a {type}, not a tensor", data=True),
    _C("dcp.plain.tensor", ValueError,
       "item {fqn!r}: the file holds {dtype} {size}, the DCP metadata a chunk of {md_dtype} {md_size}", data=True),
]
del _C, _CXX

CHECKS = {c.id: c for c in _TABLE}
assert len(CHECKS) == len(_TABLE), "a check id is listed twice"


def fail(check_id, where, **fields):
    """The exception of check `check_id` for the file or entry `where`, its
    message formatted from `fields`, tagged with the id (`exc.check`)."""
    c = CHECKS[check_id]
    msg = c.message.format(**fields)
    if issubclass(c.exc, OSError):
        e = c.exc(errno.ENOENT, msg, where)
    else:
        e = c.exc(f"{where}: {msg}" if where else msg)
    e.check = check_id
    return e


def tag(e, check_id):
    """Tags an exception raised by a C++ reader with the id of its entry
    (unless it has one); returns it."""
    if getattr(e, "check", None) is None:
        try:
            e.check = check_id
        except AttributeError:  # an exception type without a __dict__
            pass
    return e


def check_of(e):
    """The id of the check that raised `e`, or None."""
    return getattr(e, "check", None)
