// safetensors files: header parsing and validation (Note [Hostile
// safetensors]), reads (Note [Reading in place]) and writes (Note
// [Safetensors save]) through the I/O path (io::TransferLoop).
#include "ebbtide/ckpt/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <system_error>
#include <thread>
#include <unordered_set>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/cufile_shim.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/mem/stream_copy.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
#include "json.hpp"
#include "shard_io.hpp"
#include "workers.hpp"

namespace ebbtide::ckpt::safetensors {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the safetensors header length is little-endian");

using detail::Json;
using detail::json_string;

namespace {

struct DtypeBits {
  std::string_view name;
  uint32_t bits;
};
// Every dtype of the format (the safetensors package 0.8).
constexpr DtypeBits kDtypes[] = {
    {"BOOL", 8},         {"F4", 4},           {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},   {"I8", 8},
    {"F8_E5M2", 8},      {"F8_E4M3", 8},      {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},         {"F8_E5M2FNUZ", 8},
    {"I16", 16},         {"U16", 16},         {"F16", 16},    {"BF16", 16},   {"I32", 32}, {"U32", 32},
    {"F32", 32},         {"C64", 64},         {"F64", 64},    {"I64", 64},    {"U64", 64},
};

// A name as error messages show it: quoted, cut to 120 bytes (a hostile
// header may hold names of megabytes).
std::string quoted(std::string_view name) {
  if (name.size() <= 120) return "'" + std::string(name) + "'";
  return "'" + std::string(name.substr(0, 120)) + "...' (" + std::to_string(name.size()) + " bytes)";
}

// Bytes of `shape` elements of `bits` each; false when the product overflows
// or does not end at a byte boundary.
bool tensor_bytes(const std::vector<uint64_t>& shape, uint32_t bits, uint64_t* out) {
  if (std::find(shape.begin(), shape.end(), uint64_t{0}) != shape.end()) {
    *out = 0;
    return true;
  }
  // Every partial product stays at most `limit` (2^67), so none wraps 128 bits.
  const unsigned __int128 limit = (static_cast<unsigned __int128>(UINT64_MAX) << 3) | 7;
  unsigned __int128 total = bits;
  for (uint64_t d : shape) {
    if (total > limit / d) return false;
    total *= d;
  }
  if (total % 8 != 0) return false;
  *out = static_cast<uint64_t>(total / 8);
  return true;
}

TensorInfo parse_tensor(Json& j, std::string name) {
  TensorInfo t;
  t.name = std::move(name);
  const std::string who = "tensor " + quoted(t.name);
  bool have_dtype = false, have_shape = false, have_offsets = false;
  j.expect('{', "to open the entry of " + who);
  if (j.next_is('}')) {
    j.expect('}', "");
  } else {
    do {
      std::string key = j.string("a member name of " + who);
      j.expect(':', "after a member name of " + who);
      auto once = [&](bool& seen) {
        if (seen) j.fail(ebbtide::detail::concat(who, " has '", key, "' twice"));
        seen = true;
      };
      if (key == "dtype") {
        once(have_dtype);
        t.dtype = j.string("the dtype of " + who);
      } else if (key == "shape") {
        once(have_shape);
        j.expect('[', "to open the shape of " + who);
        if (j.next_is(']')) {
          j.expect(']', "");
        } else {
          do {
            if (t.shape.size() == kMaxDims)
              j.fail(ebbtide::detail::concat("the shape of ", who, " has more than ", kMaxDims, " dimensions"));
            t.shape.push_back(j.uint("a dimension of " + who));
          } while (j.more(']', "in the shape of " + who));
        }
      } else if (key == "data_offsets") {
        once(have_offsets);
        j.expect('[', "to open the data_offsets of " + who);
        t.begin = j.uint("the first data offset of " + who);
        j.expect(',', "in the data_offsets of " + who + " (two offsets)");
        t.end = j.uint("the second data offset of " + who);
        j.expect(']', "after the two data_offsets of " + who);
      } else {
        j.skip_value(1);  // a member the format does not define: ignored, as the safetensors package does
      }
    } while (j.more('}', "after a member of " + who));
  }
  if (!have_dtype || !have_shape || !have_offsets)
    j.fail(ebbtide::detail::concat(who, " has no '", !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets",
                                   "'"));
  return t;
}

void parse_metadata(Json& j, Metadata& out) {
  if (j.literal("null")) return;
  j.expect('{', "to open __metadata__ (a map of strings)");
  if (j.next_is('}')) {
    j.expect('}', "");
    return;
  }
  std::unordered_set<std::string> keys;
  do {
    std::string k = j.string("a __metadata__ key");
    j.expect(':', "after a __metadata__ key");
    if (!j.next_is('"')) j.fail("the __metadata__ value of " + quoted(k) + " is not a string");
    std::string v = j.string("the __metadata__ value of " + quoted(k));
    if (!keys.insert(k).second) j.fail("__metadata__ has the key " + quoted(k) + " twice");
    out.emplace_back(std::move(k), std::move(v));
  } while (j.more('}', "after a __metadata__ entry"));
}


constexpr uint64_t kPieceBytes = 4ull << 20;  // one transfer (and one staging buffer)

}  // namespace

uint32_t dtype_bits(std::string_view dtype) {
  for (const auto& d : kDtypes)
    if (d.name == dtype) return d.bits;
  return 0;
}

// Note [Hostile safetensors]
// A safetensors file may come from anyone; nothing in it is trusted. The
// header length must leave the 8 length bytes and the header inside the file
// and be at most kMaxHeaderBytes (checked by Reader before reading it). The
// header must be one well-formed JSON object (Json above: strict syntax,
// UTF-8, no unpaired surrogates, skipped values at most 64 deep); its members
// are tensors, names unique, plus at most one "__metadata__" map of strings.
// Each tensor has a known dtype, at most kMaxDims dimensions and integer
// offsets begin <= end; shape x dtype bits, computed in 128 bits, is a whole
// number of bytes equal to end - begin. Sorted by offset, the tensors tile
// the data section exactly, as the format requires: the first starts at 0,
// each starts where the previous ends (no gap, no overlap), the last ends at
// the end of the file. So every read lies inside the file and writes only its
// own target's bytes, and destination memory (sized by the header) is
// bounded by the file size.
Header parse_header(std::string_view json, uint64_t file_bytes, const std::string& path) {
  auto bad = [&](auto&&... what) {
    return InvalidArgument(ebbtide::detail::concat(path, ": invalid safetensors file (", what..., ")"));
  };
  if (json.size() > kMaxHeaderBytes || !fits_within(8, json.size(), file_bytes))
    throw bad("header length ", json.size(), " does not fit in the file of ", file_bytes, " bytes");
  Header h;
  h.data_offset = 8 + json.size();
  h.data_bytes = file_bytes - h.data_offset;
  Json j(json, path, "invalid safetensors header", 8);
  j.expect('{', "at the start of the header");
  std::unordered_set<std::string> names;
  bool have_meta = false;
  if (j.next_is('}')) {
    j.expect('}', "");
  } else {
    do {
      std::string key = j.string("a tensor name");
      j.expect(':', "after the name " + quoted(key));
      if (key == "__metadata__") {
        if (have_meta) j.fail("__metadata__ appears twice");
        have_meta = true;
        parse_metadata(j, h.metadata);
        continue;
      }
      if (!names.insert(key).second) j.fail("tensor " + quoted(key) + " appears twice");
      h.tensors.push_back(parse_tensor(j, std::move(key)));
    } while (j.more('}', "after a header entry"));
  }
  if (!j.at_end()) j.fail("text after the header object");

  for (const auto& t : h.tensors) {
    const std::string who = "tensor " + quoted(t.name);
    uint32_t bits = dtype_bits(t.dtype);
    if (bits == 0) throw bad(who, ": unknown dtype ", quoted(t.dtype));
    if (t.begin > t.end) throw bad(who, ": data_offsets [", t.begin, ", ", t.end, "] end before they begin");
    if (t.end > h.data_bytes)
      throw bad(who, ": data_offsets [", t.begin, ", ", t.end, "] run past the data section (", h.data_bytes,
                " bytes)");
    uint64_t n = 0;
    if (!tensor_bytes(t.shape, bits, &n) || n != t.end - t.begin) {
      std::string dims;
      for (auto d : t.shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
      throw bad(who, ": shape [", dims, "] of ", t.dtype, " does not take the ", t.end - t.begin,
                " bytes of its data_offsets [", t.begin, ", ", t.end, "]");
    }
  }
  std::vector<size_t> order(h.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto &x = h.tensors[a], &y = h.tensors[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t covered = 0;  // data bytes [0, covered) belong to a tensor
  const TensorInfo* prev = nullptr;
  for (size_t i : order) {
    const auto& t = h.tensors[i];
    if (t.begin < covered)
      throw bad("tensor ", quoted(t.name), " at data bytes [", t.begin, ", ", t.end, ") overlaps tensor ",
                quoted(prev->name), " at [", prev->begin, ", ", prev->end, ")");
    if (t.begin > covered)
      throw bad("data bytes [", covered, ", ", t.begin, ") belong to no tensor (before tensor ", quoted(t.name), ")");
    covered = t.end;
    prev = &t;
  }
  if (covered != h.data_bytes)
    throw bad("data bytes [", covered, ", ", h.data_bytes, ") at the end of the file belong to no tensor");
  return h;
}

std::string encode_header(const std::vector<TensorInfo>& tensors, const Metadata& metadata) {
  std::string s = "{";
  if (!metadata.empty()) {
    s += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      if (i) s += ',';
      s += json_string(metadata[i].first) + ':' + json_string(metadata[i].second);
    }
    s += "}";
  }
  for (const auto& t : tensors) {
    if (s.size() > 1) s += ',';
    s += json_string(t.name) + ":{\"dtype\":" + json_string(t.dtype) + ",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(t.shape[i]);
    }
    s += "],\"data_offsets\":[" + std::to_string(t.begin) + "," + std::to_string(t.end) + "]}";
  }
  s += '}';
  s.append((8 - (8 + s.size()) % 8) % 8, ' ');
  return s;
}

IoOptions IoOptions::from_env() {
  WriterOptions w = WriterOptions{}.with_env();
  IoOptions o;
  o.direct = w.direct;
  o.backend = w.backend;
  o.queue_depth = w.queue_depth;
  return o;
}

namespace {

mem::cuda::Driver* need_driver(const std::string& tensor, const IoOptions& opt) {
  return detail::device_driver(opt.cuda_driver, "tensor ", quoted(tensor), " is in CUDA device memory");
}

// A device target's file range [a, b) and its memory.
struct DeviceRead {
  uint64_t a, b;
  const ReadTarget* t;
};

// Note [Reads into device memory]
// Device targets of an O_DIRECT file are read by cuFile (GPUDirect Storage)
// when it is usable (mem::cufile::cufile(): libcufile loads and nvidia-fs is
// there, or EBBTIDE_CUFILE=1): straight from the disk into device memory, no
// pinned staging and no host copy. cuFile is not stream-ordered, so each
// target's stream is synchronized first (its memory may still be in use by
// kernels queued there, as memory the caching allocator just handed out
// again can be), in the target's own context: stream handle 0 is a
// different stream on every device, so the waits are keyed by (context,
// stream), not by handle (detail::StreamWaits). The reads are synchronous,
// 4 MiB each, on the workers, and done when this returns. The tensors of a safetensors file start at any
// byte, which cuFile takes (through its own bounce buffers when unaligned).
// Any cuFile failure turns it off for this reader, says so once, and sends
// the device targets through pinned staging, which reports real disk errors
// itself. Returns whether the targets were read.
bool read_into_device(const io::DirectFile& file, mem::cufile::Driver& cf, mem::cuda::Driver& drv,
                      const std::vector<DeviceRead>& reads) {
  try {
    struct Registered {
      mem::cufile::Driver& cf;
      mem::cufile::Handle h;
      ~Registered() {
        try {
          cf.handle_deregister(h);
        } catch (...) {  // the error in flight, if any, is the one to report
        }
      }
    } reg{cf, cf.handle_register(file.fd())};
    {  // each target's stream, in its device's context (stream handle 0 is each device's own)
      detail::StreamWaits busy;
      for (const auto& r : reads) {
        drv.bind_context_of(reinterpret_cast<mem::cuda::DevicePtr>(r.t->dst.ptr));
        busy.add(&drv, r.t->dst.stream);
      }
      busy.synchronize();
    }
    struct Piece {
      const DeviceRead* r;
      uint64_t off, len;
    };
    std::vector<Piece> pieces;
    for (const auto& r : reads)
      for (uint64_t o = r.a; o < r.b; o += kPieceBytes) pieces.push_back({&r, o, std::min(kPieceBytes, r.b - o)});
    detail::Workers workers(detail::default_threads());
    workers.parallel_for(pieces.size(), [&](size_t i) {
      const Piece& p = pieces[i];
      drv.bind_context_of(reinterpret_cast<mem::cuda::DevicePtr>(p.r->t->dst.ptr));
      size_t n = cf.read(reg.h, p.r->t->dst.ptr, p.len, static_cast<int64_t>(p.off),
                         static_cast<int64_t>(p.off - p.r->a));
      if (n != p.len)
        throw IoError(EIO, file.path(), static_cast<int64_t>(p.off),
                      ebbtide::detail::concat("cuFile read ", n, " of ", p.len, " bytes"));
    });
    return true;
  } catch (const std::exception& e) {
    log::warn_once("safetensors-cufile", ebbtide::detail::concat("safetensors: cuFile failed reading ", file.path(),
                                                                 " (", e.what(),
                                                                 "); reading device tensors through pinned staging"));
    return false;
  }
}

// Note [Replaced files]
// A save over an existing file renames the new one over it. When the old
// file's last name goes, the kernel frees its extents, and on a
// discard-mounted ext4 that is ~0.15 s per GB in the rename and in the
// directory fsync after it (the journal commit issues the discards): a 1 GB
// save over its predecessor took 0.55 s against 0.41 s for a new name. So
// the save holds the old file open across the rename (an open file is freed
// at its last close) and closes it on a thread of its own after the save,
// as the directory checkpoints hand theirs to a Reaper (Note [Deferred
// removal] in writer.cpp). Nothing is left on disk by a crash: the kernel
// closes the descriptor at exit, and ext4's orphan list frees an unlinked
// inode after a power cut. Each save first waits for the closes queued
// before it, so back-to-back saves on a nearly full disk never hold more
// than one old file.
// Fork: a child (a DataLoader worker, a multiprocessing pool) inherits the
// count of closes in flight but not the threads doing them, so the state
// belongs to the process that made it and a child starts afresh (its copies
// of the parent's held descriptors stay open until it exits). Hence no
// mutex or long-lived thread here: an atomic count, waited on by futex.
class ReplacedFiles {
 public:
  void close_later(int fd) {
    adopt();
    in_flight_.fetch_add(1);
    try {
      std::thread([this, fd] {
        for (bool p = paused_.load(); p; p = paused_.load()) paused_.wait(true);
        close_counted(fd);
      }).detach();
    } catch (const std::system_error&) {  // no thread to be had: close here
      close_counted(fd);
    }
  }
  void drain() {
    adopt();
    for (int n = in_flight_.load(); n != 0; n = in_flight_.load()) in_flight_.wait(n);
  }
  void pause(bool paused) {
    adopt();
    paused_ = paused;
    paused_.notify_all();
  }

 private:
  void close_counted(int fd) {
    ::close(fd);
    if (in_flight_.fetch_sub(1) == 1) in_flight_.notify_all();
  }
  void adopt() {  // a forked child starts afresh (see the Note)
    if (owner_.load() == ::getpid()) return;
    in_flight_ = 0;
    paused_ = false;
    owner_ = ::getpid();
  }
  std::atomic<pid_t> owner_{::getpid()};
  std::atomic<int> in_flight_{0};
  std::atomic<bool> paused_{false};  // tests: closes wait while set
};

// Never destroyed: a close may still run while the process exits.
ReplacedFiles& replaced_files() {
  static auto* files = new ReplacedFiles;
  return *files;
}

// The open file at `path` if it is a regular file, else -1 (nothing there, a
// link, a FIFO: nothing of size to free).
int hold_replaced(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return -1;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

void finish_replaced_files() { replaced_files().drain(); }
void pause_replaced_files(bool paused) { replaced_files().pause(paused); }

struct Reader::Impl {
  std::unique_ptr<io::DirectFile> file;
  Header h;
  uint64_t size = 0;
  IoOptions opt;
  bool cufile_failed = false;  // Note [Reads into device memory]
};

Reader::Reader(const std::string& path, const IoOptions& options) : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.opt = options;
  // Buffered while the header is read (exact lengths at any offset), O_DIRECT after.
  I.file = detail::open_shard(path, false, false, "safetensors file");
  I.size = I.file->size();
  auto bad = [&](auto&&... what) {
    return InvalidArgument(ebbtide::detail::concat(path, ": invalid safetensors file (", what..., ")"));
  };
  if (I.size < 8) throw bad("the file has ", I.size, " bytes, fewer than the 8-byte header length");
  unsigned char len8[8];
  io::read_exact(*I.file, len8, 8, 0);
  uint64_t n = 0;
  std::memcpy(&n, len8, 8);
  if (n > kMaxHeaderBytes || n > I.size - 8) {
    const char* hint = std::memcmp(len8, "PK\x03\x04", 4) == 0 ? "; it looks like a zip file (torch.save)"
                       : std::memcmp(len8, kSuperMagic, 8) == 0 ? "; it is an ebbtide checkpoint shard"
                                                                : "";
    if (n > kMaxHeaderBytes)
      throw bad("header length ", n, " is above the ", kMaxHeaderBytes, "-byte limit", hint);
    throw bad("header length ", n, " runs past the end of the file (", I.size, " bytes)", hint);
  }
  std::string json(n, '\0');
  io::read_exact(*I.file, json.data(), n, 8);
  I.h = parse_header(json, I.size, path);
  if (options.direct) detail::enable_direct(*I.file);
}

Reader::~Reader() = default;
const Header& Reader::header() const { return impl_->h; }
const std::string& Reader::path() const { return impl_->file->path(); }
uint64_t Reader::file_bytes() const { return impl_->size; }
bool Reader::direct() const { return impl_->file->direct(); }

// Note [Reading in place]
// Host targets are read straight into their memory where the I/O allows it:
// buffered reads take any address and length; O_DIRECT needs file offset,
// address and length 4 KiB-aligned, which a tensor at data offset x meets
// only when its address is congruent to x mod 4 KiB and the caller owns the
// blocks around it (ReadTarget::own_blocks: the read covers whole blocks and
// overwrites the bytes before and after the tensor in them).
// checkpoint.load_safetensors allocates large tensors that way. Everything
// else (device targets, other host targets) is read in 4 MiB pieces into
// pinned staging buffers and copied out by worker threads, so that the
// thread submitting the reads never stops for a copy (detail::pipelined_reads,
// Note [Read pipeline] in reader.cpp): a piece may serve several small
// tensors, and a tensor may span several pieces. Pieces are submitted in file
// order, `queue_depth` in flight; the last block of the file is asked for
// whole and the read stops at the end of the file. Owned destinations are
// faulted in ahead of their reads on another thread. Device targets may be
// read by cuFile instead (Note [Reads into device memory]).
std::string Reader::read(const std::vector<ReadTarget>& targets) {
  auto& I = *impl_;
  const std::string& path = I.file->path();
  const bool direct = I.file->direct();
  struct Staged {
    uint64_t a, b;  // file range
    const ReadTarget* t;
  };
  struct Piece {
    uint64_t off, len;
    char* dst;  // in place; nullptr: staged
    bool owned;  // dst covers whole blocks the caller owns (may be faulted in ahead)
  };
  std::vector<Piece> pieces;
  std::vector<Staged> staged;
  std::vector<DeviceRead> to_device;  // by cuFile
  std::vector<bool> seen(I.h.tensors.size(), false);
  mem::cuda::Driver* drv = nullptr;
  mem::cufile::Driver* cf = nullptr;
  detail::CallerContext caller;
  auto cut = [&](uint64_t off, uint64_t end, char* dst, bool owned) {
    for (uint64_t o = off; o < end; o += kPieceBytes)
      pieces.push_back({o, std::min(kPieceBytes, end - o), dst == nullptr ? nullptr : dst + (o - off), owned});
  };
  for (const auto& t : targets) {
    EBB_CHECK(t.tensor < I.h.tensors.size(), path, ": tensor index ", t.tensor, " out of range (",
              I.h.tensors.size(), " tensors)");
    const TensorInfo& ti = I.h.tensors[t.tensor];
    EBB_CHECK(!seen[t.tensor], path, ": tensor ", quoted(ti.name), " is to be read twice");
    seen[t.tensor] = true;
    const uint64_t n = ti.end - ti.begin, a = I.h.data_offset + ti.begin;
    EBB_CHECK(t.dst.nbytes == n, path, ": tensor ", quoted(ti.name), " has ", n, " bytes, its destination ",
              t.dst.nbytes);
    if (n == 0) continue;
    EBB_CHECK(t.dst.ptr != nullptr, path, ": null destination for tensor ", quoted(ti.name));
    if (t.dst.on_device() && drv == nullptr) {
      drv = need_driver(ti.name, I.opt);
      caller.take(drv);
      if (direct && I.opt.try_cufile && !I.cufile_failed)
        cf = I.opt.cufile_driver != nullptr ? I.opt.cufile_driver : mem::cufile::cufile();
    }
    auto* dst = static_cast<char*>(t.dst.ptr);
    if (t.dst.on_device() && cf != nullptr) {
      to_device.push_back({a, a + n, &t});
    } else if (!t.dst.on_device() && !direct) {
      cut(a, a + n, dst, false);
    } else if (!t.dst.on_device() && t.own_blocks && reinterpret_cast<uintptr_t>(dst) % kBlockBytes == a % kBlockBytes) {
      uint64_t head = a % kBlockBytes;
      cut(a - head, align_up(a + n, kBlockBytes), dst - head, true);
    } else {
      staged.push_back({a, a + n, &t});
    }
  }
  std::string how;
  if (!to_device.empty()) {
    if (read_into_device(*I.file, *cf, *drv, to_device)) {
      how = " + cuFile into device memory";
    } else {
      I.cufile_failed = true;
      for (const auto& r : to_device) staged.push_back({r.a, r.b, r.t});
    }
  }
  // Staged pieces: the union of the staged tensors' (block-aligned) ranges.
  std::sort(staged.begin(), staged.end(), [](const Staged& x, const Staged& y) { return x.a < y.a; });
  for (size_t k = 0; k < staged.size();) {
    uint64_t lo = direct ? staged[k].a / kBlockBytes * kBlockBytes : staged[k].a;
    uint64_t hi = direct ? align_up(staged[k].b, kBlockBytes) : staged[k].b;
    for (++k; k < staged.size(); ++k) {
      uint64_t a = direct ? staged[k].a / kBlockBytes * kBlockBytes : staged[k].a;
      if (a > hi) break;
      hi = std::max(hi, direct ? align_up(staged[k].b, kBlockBytes) : staged[k].b);
    }
    cut(lo, hi, nullptr, false);
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) { return x.off < y.off; });
  if (pieces.empty()) return how.empty() ? "nothing to read" : "cuFile into device memory";

  const unsigned depth = std::max(1u, I.opt.queue_depth);
  const unsigned threads = detail::default_threads();
  const bool any_staged = !staged.empty();
  mem::PinnedPoolOptions host_only;
  host_only.cuda_register = false;
  mem::BorrowedPinnedPool staging;  // Note [Reused staging]
  if (any_staged) {
    // A buffer per read in flight and one per worker copying out of one.
    staging = mem::borrow_pinned_pool(kPieceBytes, depth + threads, host_only);
    const void* served = nullptr;  // a device target copied from the staging buffers
    for (const auto& st : staged)
      if (st.t->dst.on_device()) {
        served = st.t->dst.ptr;
        break;
      }
    detail::lock_staging(*staging, drv, I.opt.cuda_driver, served);  // asynchronous host-to-device copies
  }
  // Staged tensors before first_staged[i] end before piece i.
  std::vector<size_t> first_staged(pieces.size());
  for (size_t i = 0, k = 0; i < pieces.size(); ++i) {
    while (k < staged.size() && staged[k].b <= pieces[i].off) ++k;
    first_staged[i] = k;
  }
  // Copies the staged tensors' bytes out of piece i's buffer (on a worker:
  // pieces are disjoint, so are their destinations). Device copies are all
  // queued, then each (context, stream) waited for once before the buffer is
  // reused: a piece of many small tensors costs one wait, not one per tensor.
  auto scatter = [&](size_t i, const char* buf) {
    const Piece& p = pieces[i];
    if (p.dst != nullptr) return;  // read in place
    detail::StreamWaits copies;
    for (size_t k = first_staged[i]; k < staged.size() && staged[k].a < p.off + p.len; ++k) {
      uint64_t lo = std::max(staged[k].a, p.off), hi = std::min(staged[k].b, p.off + p.len);
      if (lo >= hi) continue;
      const ReadTarget& t = *staged[k].t;
      char* dst = static_cast<char*>(t.dst.ptr) + (lo - staged[k].a);
      if (!t.dst.on_device()) {
        mem::stream_copy(dst, buf + (lo - p.off), hi - lo);  // Note [Streaming copies]
        continue;
      }
      auto d = reinterpret_cast<mem::cuda::DevicePtr>(dst);
      drv->bind_context_of(d);
      drv->memcpy_htod_async(d, buf + (lo - p.off), hi - lo, t.dst.stream);
      copies.add(drv, t.dst.stream);
    }
    copies.synchronize();  // before the staging buffer is reused
  };
  io::TransferLoop loop(depth, any_staged ? detail::buffers_of(*staging) : std::vector<iovec>{}, I.opt.backend,
                       "checkpoint");
  std::vector<std::pair<char*, uint64_t>> fresh;
  for (const auto& p : pieces)
    if (p.owned) fresh.emplace_back(p.dst, p.len);
  detail::PagePopulator populate(std::move(fresh));  // Note [Populate ahead] in shard_io.cpp
  auto read = [&](size_t i) {
    const Piece& p = pieces[i];
    // The file may end inside the last block.
    return detail::PipelinedRead{I.file.get(), p.off, p.len, p.dst, std::min(p.len, I.size - p.off)};
  };
  detail::pipelined_reads(pieces.size(), read, loop, any_staged ? &*staging : nullptr, threads, scatter);
  return loop.describe() + (direct ? " O_DIRECT" : " buffered") + how;
}

// Note [Safetensors save]
// The file is streamed through a ring of pinned buffers: worker threads copy
// the file image (length, header, then each tensor's bytes, host memcpy or
// device-to-host copy) into buffer k % N for the 4 MiB piece k while the
// ring writes the earlier pieces (O_DIRECT where allowed, into the file
// preallocated to its whole size; the last piece is padded to a whole block
// and the file truncated to its size after). The
// data section of a safetensors file starts at 8 + N, which is not block
// aligned, so tensors cannot be written from their own memory. The file is
// written under a temporary name beside `path`, fdatasync'd, renamed over
// `path` and the directory fsync'd: a crash leaves the old file or the new
// one, never a torn one.
SaveResult save(const std::string& path, const std::vector<SaveTensor>& tensors, const Metadata& metadata,
                const IoOptions& opt) {
  EBB_CHECK(!path.empty(), "safetensors: the file path is empty");
  auto bad = [&](const std::string& name, auto&&... what) {
    return InvalidArgument(ebbtide::detail::concat(path, ": cannot save tensor ", quoted(name), ": ", what...));
  };
  std::unordered_set<std::string_view> names;
  std::vector<TensorInfo> infos(tensors.size());
  std::vector<uint32_t> bits(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.name == "__metadata__") throw bad(t.name, "the name is reserved for the metadata");
    if (!valid_utf8(t.name)) throw bad(t.name, "the name is not valid UTF-8");
    if (!names.insert(t.name).second) throw bad(t.name, "the name appears twice");
    bits[i] = dtype_bits(t.dtype);
    if (bits[i] == 0) throw bad(t.name, "unknown safetensors dtype ", quoted(t.dtype));
    if (t.shape.size() > kMaxDims) throw bad(t.name, t.shape.size(), " dimensions (at most ", kMaxDims, ")");
    uint64_t n = 0;
    if (!tensor_bytes(t.shape, bits[i], &n)) throw bad(t.name, "its size is not a whole number of bytes below 2^64");
    if (t.src.nbytes != n) throw bad(t.name, "its ", t.dtype, " shape has ", n, " bytes, its data ", t.src.nbytes);
    if (n > 0 && t.src.ptr == nullptr) throw bad(t.name, "null data pointer");
    infos[i] = {t.name, t.dtype, t.shape, 0, n};
  }
  std::unordered_set<std::string_view> keys;
  for (const auto& [k, v] : metadata) {
    EBB_CHECK(valid_utf8(k) && valid_utf8(v), path, ": safetensors metadata ", quoted(k), " is not valid UTF-8");
    EBB_CHECK(keys.insert(k).second, path, ": safetensors metadata key ", quoted(k), " appears twice");
  }
  // Largest elements first, then by name: every tensor starts at a multiple of its element size.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return bits[a] != bits[b] ? bits[a] > bits[b] : tensors[a].name < tensors[b].name;
  });
  std::vector<TensorInfo> sorted;
  uint64_t data = 0;
  for (size_t i : order) {
    TensorInfo t = infos[i];
    uint64_t n = t.end;
    EBB_CHECK(n <= UINT64_MAX / 2 - data, path, ": the tensors add up to more than 2^63 bytes");
    t.begin = data;
    t.end = data + n;
    data += n;
    sorted.push_back(std::move(t));
  }
  const std::string json = encode_header(sorted, metadata);
  EBB_CHECK(json.size() <= kMaxHeaderBytes, path, ": the safetensors header would have ", json.size(),
            " bytes, above the ", kMaxHeaderBytes, "-byte limit readers accept");
  std::string prefix(8, '\0');
  uint64_t n = json.size();
  std::memcpy(prefix.data(), &n, 8);
  prefix += json;
  const uint64_t total = prefix.size() + data;

  // The file image as extents in file order: the prefix, then each tensor.
  struct Extent {
    uint64_t off, len;
    const char* src;
    bool device;
    uintptr_t stream;
    const std::string* name;
  };
  std::vector<Extent> extents{{0, prefix.size(), prefix.data(), false, 0, nullptr}};
  mem::cuda::Driver* drv = nullptr;
  for (size_t k = 0; k < order.size(); ++k) {
    const auto& t = tensors[order[k]];
    if (sorted[k].end == sorted[k].begin) continue;
    if (t.src.on_device() && drv == nullptr) drv = need_driver(t.name, opt);
    extents.push_back({prefix.size() + sorted[k].begin, sorted[k].end - sorted[k].begin,
                       static_cast<const char*>(t.src.ptr), t.src.on_device(), t.src.stream, &t.name});
  }

  std::string tmp;
  {
    std::random_device rd;
    char suffix[24];
    std::snprintf(suffix, sizeof suffix, ".tmp-%08x%08x", rd(), rd());
    tmp = path + suffix;
  }
  struct RemoveTemp {
    const std::string& tmp;
    bool keep = false;
    ~RemoveTemp() {
      if (!keep) ::unlink(tmp.c_str());
    }
  } remove_tmp{tmp};
  {  // fail before writing a byte, not at the rename
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      throw IoError(EISDIR, path, -1, "cannot save a safetensors file there: the path is a directory");
  }
  finish_replaced_files();  // Note [Replaced files]: at most one old file held
  const auto file_ptr = detail::open_shard(tmp, true, opt.direct, "safetensors file");
  // Note [Preallocated saves] in writer.cpp: no write extends the file.
  file_ptr->grow_to(align_up(total, kBlockBytes));
  const io::DirectFile& file = *file_ptr;
  const bool direct = file.direct();
  const uint64_t npieces = (total + kPieceBytes - 1) / kPieceBytes;
  const unsigned depth = std::max(1u, opt.queue_depth);
  mem::PinnedPoolOptions host_only;
  host_only.cuda_register = false;
  // Note [Reused staging]: periodic saves of one model borrow the same ring.
  const auto ring_owner = mem::borrow_pinned_pool(kPieceBytes, std::min<uint64_t>(npieces, depth + 2), host_only);
  mem::PinnedPool& ring = *ring_owner;
  const void* served = nullptr;  // a device tensor copied into the ring
  for (const auto& e : extents)
    if (e.device) {
      served = e.src;
      break;
    }
  detail::lock_staging(ring, drv, opt.cuda_driver, served);
  const size_t nbuf = ring.count();
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> filled(nbuf, 0);      // 1: piece in the buffer is ready, -1: its copy failed
  std::vector<int> writing(nbuf, 0);     // 1 while a write from the buffer is in flight
  std::exception_ptr fill_error;
  detail::CallerContext caller;
  if (drv != nullptr) caller.take(drv);

  // Copies file bytes [off, off + len) into `out` (a worker thread). Device
  // copies are all queued, then each (context, stream) waited for once.
  auto fill = [&](uint64_t off, uint64_t len, char* out) {
    detail::StreamWaits copies;
    auto it = std::upper_bound(extents.begin(), extents.end(), off,
                               [](uint64_t o, const Extent& e) { return o < e.off; });
    for (--it; it != extents.end() && it->off < off + len; ++it) {
      uint64_t lo = std::max(it->off, off), hi = std::min(it->off + it->len, off + len);
      if (lo >= hi) continue;
      if (!it->device) {
        mem::stream_copy(out + (lo - off), it->src + (lo - it->off), hi - lo);  // read back only by the disk
        continue;
      }
      auto src = reinterpret_cast<mem::cuda::DevicePtr>(it->src) + (lo - it->off);
      drv->bind_context_of(src);
      drv->memcpy_dtoh_async(out + (lo - off), src, hi - lo, it->stream);
      copies.add(drv, it->stream);
    }
    copies.synchronize();
  };
  std::string backend;
  {
    detail::Workers workers(detail::default_threads());
    struct Join {  // worker tasks reference this frame: every exit waits for them
      std::mutex& mu;
      std::condition_variable& cv;
      size_t posted = 0, finished = 0;
      ~Join() {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return finished == posted; });
      }
    } join{mu, cv};
    io::TransferLoop loop(depth, detail::buffers_of(ring), opt.backend, "checkpoint");
    uint64_t next_fill = 0;
    for (uint64_t k = 0; k < npieces; ++k) {
      // Keep the copies ahead of the writes: piece j uses buffer j % nbuf once its last write is done.
      while (next_fill < npieces && next_fill < k + nbuf) {
        size_t slot = next_fill % nbuf;
        if (writing[slot]) {
          loop.poll(true);
          continue;
        }
        uint64_t off = next_fill * kPieceBytes, len = std::min(kPieceBytes, total - off);
        char* out = static_cast<char*>(ring.buffer(slot));
        {
          std::lock_guard lock(mu);
          filled[slot] = 0;
          ++join.posted;
        }
        workers.post([&, off, len, out, slot] {
          int state = 1;
          try {
            fill(off, len, out);
          } catch (...) {
            state = -1;
            std::lock_guard lock(mu);
            if (!fill_error) fill_error = std::current_exception();
          }
          std::lock_guard lock(mu);
          filled[slot] = state;
          ++join.finished;
          cv.notify_all();
        });
        ++next_fill;
      }
      const size_t slot = k % nbuf;
      {
        std::unique_lock lock(mu);
        if (filled[slot] == 0) {
          lock.unlock();
          loop.poll(false);  // frees buffers while the copy runs
          lock.lock();
          cv.wait(lock, [&] { return filled[slot] != 0; });
        }
        if (fill_error) std::rethrow_exception(fill_error);
      }
      const uint64_t off = k * kPieceBytes, len = std::min(kPieceBytes, total - off);
      uint64_t wlen = len;
      char* buf = static_cast<char*>(ring.buffer(slot));
      if (direct && len % kBlockBytes != 0) {  // the last piece: whole blocks, truncated below
        wlen = align_up(len, kBlockBytes);
        std::memset(buf + len, 0, wlen - len);
      }
      writing[slot] = 1;
      loop.submit(file, true, buf, wlen, off, static_cast<int>(slot), [&writing, slot] { writing[slot] = 0; });
    }
    loop.drain();
    backend = loop.describe() + (direct ? " O_DIRECT" : " buffered");
  }
  EBB_SYSCALL(::ftruncate(file.fd(), static_cast<off_t>(total)), tmp, static_cast<int64_t>(total));
  file.sync();
  struct Replaced {  // Note [Replaced files]
    int fd;
    bool renamed = false;
    ~Replaced() {
      if (fd < 0) return;
      if (renamed)
        replaced_files().close_later(fd);
      else
        ::close(fd);
    }
  } replaced{hold_replaced(path)};
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw_io_error(errno, path, -1, "rename");
  replaced.renamed = true;
  remove_tmp.keep = true;
  auto slash = path.rfind('/');
  fsync_directory(slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash));
  SaveResult r;
  r.file_bytes = total;
  r.data_bytes = data;
  r.backend = backend;
  return r;
}

}  // namespace ebbtide::ckpt::safetensors
