// safetensors reads: Reader (Notes [Reading in place], [Reads into device
// memory]).
#include "safetensors_impl.hpp"

#include <algorithm>
#include <cstring>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/mem/cufile_shim.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/mem/stream_copy.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
#include "workers.hpp"

namespace ebbtide::ckpt::safetensors {

namespace {

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

}  // namespace

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

}  // namespace ebbtide::ckpt::safetensors
