// Shard reader: validates superblock and header (pread), then reads chunks
// through the engine's backends (Note [Read pipeline]).
#include "ebbtide/ckpt/reader.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <memory>
#include <thread>

#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/mem/stream_copy.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"
#include "shard_io.hpp"
#include "workers.hpp"

namespace ebbtide::ckpt {
namespace {

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<char, AlignedFree>;
AlignedBuf aligned_buf(uint64_t n) {
  void* p = std::aligned_alloc(kBlockBytes, align_up(std::max<uint64_t>(n, 1), kBlockBytes));
  if (p == nullptr) throw std::bad_alloc();
  return AlignedBuf(static_cast<char*>(p));
}

std::string tensor_at(const std::string& path, const std::string& blob) {
  return path + ": tensor '" + blob + "'";
}

}  // namespace

struct ShardReader::Impl {
  std::unique_ptr<io::DirectFile> file;
  Superblock sb;
  Header h;
  uint64_t size = 0;
  // Stripe k (0 = the shard file): file, size, and why it is unusable ("" = fine).
  std::vector<const io::DirectFile*> files;
  std::vector<std::unique_ptr<io::DirectFile>> stripes;
  std::vector<std::string> stripe_paths;
  std::vector<uint64_t> sizes;
  std::vector<std::string> stripe_error;
  std::vector<int> stripe_errno;

  const std::string& path_of(const ChunkEntry& c) const {
    return c.stripe == 0 ? file->path() : stripe_paths[c.stripe - 1];
  }
  // Throws for a chunk whose stripe file is missing or bad, naming both.
  void check_stripe(const ChunkEntry& c) const {
    if (stripe_error[c.stripe].empty()) return;
    std::string what = ebbtide::detail::concat("stripe file ", c.stripe, " of checkpoint shard ", file->path(),
                                               ", needed for tensor '", h.blobs[c.blob].name, "' (chunk at offset ",
                                               c.file_offset, "): ", stripe_error[c.stripe]);
    if (stripe_errno[c.stripe] != 0) throw IoError(stripe_errno[c.stripe], path_of(c), -1, what);
    throw InvalidArgument(path_of(c) + ": " + what);
  }
  // What read() throws for a chunk it cannot read: its stripe file missing
  // or bad, or its extent past the end of its file.
  void check_extent(const ChunkEntry& c) const {
    check_stripe(c);
    const uint64_t len = align_up(c.stored_bytes, kBlockBytes);
    if (!fits_within(c.file_offset, len, sizes[c.stripe])) {
      throw IoError(ENODATA, tensor_at(path_of(c), h.blobs[c.blob].name), static_cast<int64_t>(c.file_offset),
                    ebbtide::detail::concat("truncated checkpoint file: chunk needs bytes up to ", c.file_offset + len,
                                            " but the file has ", sizes[c.stripe]));
    }
  }
  void check_crc(const ChunkEntry& c, const char* stored) const {
    uint32_t crc = crc32c(stored, c.stored_bytes);
    if (crc != c.crc)
      throw ChecksumError(tensor_at(path_of(c), h.blobs[c.blob].name), static_cast<int64_t>(c.file_offset), c.crc, crc);
  }
  // `direct[i]`, when set, is where chunk i's stored bytes are read (in place,
  // Note [Read pipeline]); `process` then gets that pointer.
  // `device`: the driver copying from the staging buffers into device
  // targets, `given` the caller's, `served` one of those targets
  // (detail::lock_staging).
  void run_chunks(const std::vector<const ChunkEntry*>& chunks, const std::vector<char*>& direct, unsigned threads,
                  const std::function<void(size_t, const char*)>& process, mem::cuda::Driver* device = nullptr,
                  const mem::cuda::Driver* given = nullptr, const void* served = nullptr);

  void decode_chunk(const ChunkEntry& c, const char* stored, char* dst, char* scratch) {
    const auto& b = h.blobs[c.blob];
    std::string what = ebbtide::detail::concat(tensor_at(path_of(c), b.name), " chunk at offset ", c.file_offset);
    decompress_chunk(c.codec, b.elem_bytes, stored, c.stored_bytes, dst, c.raw_bytes, scratch, what.c_str());
  }

  void open_stripes(bool direct) {
    size_t n = sb.stripe_count;
    files.assign(n, nullptr);
    files[0] = file.get();
    sizes.assign(n, 0);
    sizes[0] = size;
    stripe_error.assign(n, "");
    stripe_errno.assign(n, 0);
    stripes.resize(n);
    auto blk = aligned_buf(kBlockBytes);
    for (size_t k = 1; k < n; ++k) {
      const std::string& p = stripe_paths[k - 1];
      try {
        stripes[k] = detail::open_shard(p, false, direct);
        files[k] = stripes[k].get();
        sizes[k] = stripes[k]->size();
        if (sizes[k] < kBlockBytes)
          throw InvalidArgument(ebbtide::detail::concat("truncated stripe file (", sizes[k], " bytes)"));
        io::read_exact(*stripes[k], blk.get(), kBlockBytes, 0);
        Superblock s = decode_superblock(reinterpret_cast<const unsigned char*>(blk.get()), p);
        if (!(s.flags & kFlagStripeFile) || s.stripe_index != k || s.stripe_count != n)
          throw InvalidArgument(ebbtide::detail::concat("not stripe ", k, " of ", n, " (its superblock says stripe ",
                                                        s.stripe_index, " of ", s.stripe_count, ")"));
        if (s.file_bytes > sizes[k])
          throw InvalidArgument(ebbtide::detail::concat("truncated stripe file (", sizes[k],
                                                        " bytes on disk, its superblock says ", s.file_bytes, ")"));
      } catch (const IoError& e) {
        stripe_errno[k] = e.err();
        // check_stripe and verify add the file and the errno's text
        if (e.path() != p)
          stripe_error[k] = e.what();
        else if (e.offset() < 0)
          stripe_error[k] = e.cause();
        else
          stripe_error[k] = ebbtide::detail::concat(e.cause(), " at offset ", e.offset());
      } catch (const std::exception& e) {
        stripe_error[k] = e.what();
      }
    }
  }
};

ShardReader::ShardReader(const std::string& path, bool direct, std::vector<std::string> stripe_paths)
    : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.file = detail::open_shard(path, false, direct);
  I.size = I.file->size();
  if (I.size < kBlockBytes) {
    throw InvalidArgument(ebbtide::detail::concat(path, ": truncated checkpoint shard (", I.size,
                                         " bytes, smaller than the 4096-byte superblock)"));
  }
  auto blk = aligned_buf(kBlockBytes);
  io::read_exact(*I.file, blk.get(), kBlockBytes, 0);
  I.sb = decode_superblock(reinterpret_cast<const unsigned char*>(blk.get()), path);
  EBB_CHECK(!(I.sb.flags & kFlagStripeFile) && I.sb.stripe_index == 0, path,
            ": this is a stripe data file of a striped shard, not the shard file (rankR.ebt in the checkpoint directory)");
  if (I.sb.file_bytes > I.size || !fits_within(I.sb.header_offset, I.sb.header_bytes, I.size)) {
    throw InvalidArgument(ebbtide::detail::concat(path, ": truncated checkpoint shard (", I.size, " bytes on disk, the superblock says ",
                                         I.sb.file_bytes, "; the header at offset ", I.sb.header_offset, " is missing)"));
  }
  EBB_CHECK(I.sb.header_offset % kBlockBytes == 0 && I.sb.header_offset >= kDataStart, path,
            ": corrupt superblock (header offset ", I.sb.header_offset, ")");
  uint64_t hlen = align_up(I.sb.header_bytes, kBlockBytes);
  auto hb = aligned_buf(hlen);
  io::read_exact(*I.file, hb.get(), std::min(hlen, I.size - I.sb.header_offset), I.sb.header_offset);
  uint32_t crc = crc32c(hb.get(), I.sb.header_bytes);
  if (crc != I.sb.header_crc) throw ChecksumError(path + " (header)", static_cast<int64_t>(I.sb.header_offset), I.sb.header_crc, crc);
  I.h = decode_header(std::string_view(hb.get(), I.sb.header_bytes), path);
  for (const auto& c : I.h.chunks) {
    EBB_CHECK(c.stripe < I.sb.stripe_count, path, ": corrupt checkpoint header (chunk of tensor '",
              I.h.blobs[c.blob].name, "' in stripe ", c.stripe, ", the shard has ", I.sb.stripe_count, " files)");
    // Data lies between the superblock block and the header (stripe files: checked against their size on reading).
    EBB_CHECK(c.stripe != 0 || fits_within(c.file_offset, align_up(c.stored_bytes, kBlockBytes), I.sb.header_offset),
              path, ": corrupt checkpoint header (chunk of tensor '", I.h.blobs[c.blob].name, "' at offset ",
              c.file_offset, " with ", c.stored_bytes, " bytes runs past the data area, which ends at the header at ",
              I.sb.header_offset, ")");
  }
  EBB_CHECK(stripe_paths.size() + 1 == I.sb.stripe_count, path, ": the shard is striped over ", I.sb.stripe_count,
            " files; ", I.sb.stripe_count - 1, " stripe file paths are needed, ", stripe_paths.size(), " were given");
  I.stripe_paths = std::move(stripe_paths);
  I.open_stripes(direct);
}

ShardReader::~ShardReader() = default;
const Superblock& ShardReader::superblock() const { return impl_->sb; }
const Header& ShardReader::header() const { return impl_->h; }
const std::string& ShardReader::path() const { return impl_->file->path(); }
uint64_t ShardReader::file_bytes() const {
  uint64_t n = 0;
  for (auto v : impl_->sizes) n += v;
  return n;
}
size_t ShardReader::stripe_count() const { return impl_->sb.stripe_count; }

// Note [Read pipeline]
// Chunks are read through the engine's backend (io_uring or POSIX pool).
// Raw chunks whose destination is host memory at a 4 KiB-aligned address
// (checkpoint.load allocates large storages page-aligned) and whose length
// is a multiple of 4 KiB are read in place: O_DIRECT lands in the tensor,
// then a worker checks the crc32c there; no staging copy. Other chunks go
// into a ring of pinned staging buffers; each completion hands its buffer to
// a worker that checks the crc32c, decodes into the destination and returns
// the buffer. `process` runs on the workers; errors are collected. Depth:
// 8 transfers per file of the shard in flight. The submitting thread only
// submits and reaps, so the device never waits for a copy or a checksum;
// detail::pipelined_reads (shard_io.cpp) is that loop, shared with the
// safetensors reader.
//
// In-place destinations are faulted in ahead of the reads (PagePopulator,
// Note [Populate ahead] in shard_io.cpp).
void ShardReader::Impl::run_chunks(const std::vector<const ChunkEntry*>& chunks, const std::vector<char*>& direct,
                                   unsigned threads, const std::function<void(size_t, const char*)>& process,
                                   mem::cuda::Driver* device, const mem::cuda::Driver* given, const void* served) {
  if (chunks.empty()) return;
  uint64_t need = kBlockBytes;
  for (size_t i = 0; i < chunks.size(); ++i)
    if (direct.empty() || direct[i] == nullptr) need = std::max<uint64_t>(need, align_up(chunks[i]->stored_bytes, kBlockBytes));
  unsigned nthreads = threads ? threads : detail::default_threads();
  // A staging buffer per transfer in flight plus one per worker decoding: fewer
  // would cap the staged reads' queue depth below the loop's.
  const unsigned depth = 8 * static_cast<unsigned>(files.size());
  mem::PinnedPoolOptions host_only;
  host_only.cuda_register = false;
  const auto staging_owner = mem::borrow_pinned_pool(need, depth + nthreads, host_only);  // Note [Reused staging]
  mem::PinnedPool& staging = *staging_owner;
  detail::lock_staging(staging, device, given, served);  // device targets are copied from the staging buffers
  io::TransferLoop loop(depth, detail::buffers_of(staging), io::BackendKind::kAuto, "checkpoint");
  std::vector<std::pair<char*, uint64_t>> in_place;
  for (size_t i = 0; i < direct.size(); ++i)
    if (direct[i] != nullptr) in_place.emplace_back(direct[i], align_up(chunks[i]->stored_bytes, kBlockBytes));
  detail::PagePopulator populate(std::move(in_place));
  auto read = [&](size_t i) {
    const ChunkEntry& c = *chunks[i];
    check_extent(c);
    return detail::PipelinedRead{files[c.stripe], c.file_offset, align_up(c.stored_bytes, kBlockBytes),
                                 direct.empty() ? nullptr : direct[i]};
  };
  detail::pipelined_reads(chunks.size(), read, loop, &staging, nthreads, process);
}

// Note [Parts are checked whole]
// A target with `part` wants a byte range of its blob (a DCP item's tensor
// inside its torch.save frame), but every chunk of the blob is read and
// checked (checksum, decoding), the chunks outside the range only to be
// dropped: a load then fails exactly where verify() finds a bad chunk, so
// `ebbtide ckpt inspect` and the load agree (Note [One validator] in
// python/ebbtide/checkpoint/checks.py). Those chunks are the frame's few bytes
// before and after the tensor's, at most one chunk at each end.
void ShardReader::read(const std::vector<BlobTarget>& targets, unsigned threads, mem::cuda::Driver* cuda_driver) {
  auto& I = *impl_;
  std::vector<const ChunkEntry*> chunks;
  std::vector<const BlobTarget*> owner;
  std::vector<char*> direct;
  mem::cuda::Driver* drv = nullptr;  // of the device targets
  const void* served = nullptr;      // one device target
  uint64_t decoded_bytes = 0;        // largest compressed chunk bound for a device target
  for (const auto& t : targets) {
    EBB_CHECK(t.blob < I.h.blobs.size(), path(), ": blob index ", t.blob, " out of range (", I.h.blobs.size(), " blobs)");
    const auto& b = I.h.blobs[t.blob];
    EBB_CHECK(t.dst.ptr != nullptr || t.dst.nbytes == 0, "null destination for tensor '", b.name, "'");
    if (t.part) {
      EBB_CHECK(fits_within(t.offset, t.dst.nbytes, b.nbytes), path(), ": tensor '", b.name, "' has ", b.nbytes,
                " bytes, its destination asks for ", t.dst.nbytes, " at byte ", t.offset);
    } else {
      EBB_CHECK(t.offset == 0 && t.dst.nbytes == b.nbytes, path(), ": tensor '", b.name, "' has ", b.nbytes,
                " bytes, its destination ", t.dst.nbytes);
    }
    if (t.dst.nbytes == 0) continue;
    if (t.dst.on_device() && drv == nullptr) {
      drv = detail::device_driver(cuda_driver, "tensor '", b.name, "' is to be loaded into CUDA memory");
      served = t.dst.ptr;
    }
    const uint64_t lo = t.offset, hi = t.offset + t.dst.nbytes;
    for (uint32_t k = 0; k < b.chunk_count; ++k) {
      const ChunkEntry& c = I.h.chunks[b.first_chunk + k];
      chunks.push_back(&c);
      owner.push_back(&t);
      if (c.raw_offset >= hi || c.raw_offset + c.raw_bytes <= lo) {  // Note [Parts are checked whole]
        direct.push_back(nullptr);
        continue;
      }
      if (t.dst.on_device() && (c.codec != Codec::kNone || c.stored_bytes != c.raw_bytes))
        decoded_bytes = std::max<uint64_t>(decoded_bytes, c.raw_bytes);
      const bool whole = c.raw_offset >= lo && c.raw_offset + c.raw_bytes <= hi;
      char* dst = t.dst.on_device() || !whole ? nullptr : static_cast<char*>(t.dst.ptr) + (c.raw_offset - lo);
      bool in_place = dst != nullptr && c.codec == Codec::kNone && c.stored_bytes == c.raw_bytes &&
                      c.raw_bytes % kBlockBytes == 0 && reinterpret_cast<uintptr_t>(dst) % kBlockBytes == 0;
      direct.push_back(in_place ? dst : nullptr);
    }
  }
  // Note [Decoded device chunks]
  // A compressed chunk bound for device memory is decoded into a pinned
  // buffer of its own (one per worker, page-locked like the staging), not
  // into pageable memory: a host-to-device copy from pageable memory is
  // staged by the driver through its own bounce buffer and blocks the
  // calling thread, so it neither overlaps nor stays on the target's stream.
  const unsigned nthreads = threads ? threads : detail::default_threads();
  mem::BorrowedPinnedPool decoded;  // Note [Reused staging]
  if (decoded_bytes > 0) {
    mem::PinnedPoolOptions host_only;
    host_only.cuda_register = false;
    decoded = mem::borrow_pinned_pool(decoded_bytes, nthreads, host_only);
    detail::lock_staging(*decoded, drv, cuda_driver, served);
  }
  I.run_chunks(chunks, direct, nthreads, [&](size_t i, const char* stored) {
    thread_local std::vector<char> scratch, host;
    const ChunkEntry& c = *chunks[i];
    const BlobTarget& t = *owner[i];
    I.check_crc(c, stored);
    if (direct[i] != nullptr) return;  // read in place
    // The chunk's bytes [from, to) go to dst + (from - t.offset) (all of them unless t.part).
    const uint64_t from = std::max(c.raw_offset, t.offset);
    const uint64_t to = std::min(c.raw_offset + c.raw_bytes, t.offset + t.dst.nbytes);
    if (from >= to) {  // outside the part asked for: checked only
      if (c.codec != Codec::kNone || c.stored_bytes != c.raw_bytes) {
        if (scratch.size() < c.raw_bytes) scratch.resize(c.raw_bytes);
        if (host.size() < c.raw_bytes) host.resize(c.raw_bytes);
        I.decode_chunk(c, stored, host.data(), scratch.data());
      }
      return;
    }
    const bool whole = from == c.raw_offset && to == c.raw_offset + c.raw_bytes;
    const char* raw = stored;  // a raw chunk is its own decoding (device copies go from its staging buffer)
    mem::PinnedPool::Lease lease;  // a device target's decoded chunk, held until its copy is done
    if (c.codec != Codec::kNone || c.stored_bytes != c.raw_bytes) {
      if (scratch.size() < c.raw_bytes) scratch.resize(c.raw_bytes);
      if (!t.dst.on_device() && whole) {  // decoded straight into the tensor
        I.decode_chunk(c, stored, static_cast<char*>(t.dst.ptr) + (c.raw_offset - t.offset), scratch.data());
        return;
      }
      if (t.dst.on_device()) {  // Note [Decoded device chunks]
        lease = decoded->acquire();
        I.decode_chunk(c, stored, static_cast<char*>(lease.data()), scratch.data());
        raw = static_cast<const char*>(lease.data());
      } else {
        if (host.size() < c.raw_bytes) host.resize(c.raw_bytes);
        I.decode_chunk(c, stored, host.data(), scratch.data());
        raw = host.data();
      }
    }
    const char* src = raw + (from - c.raw_offset);
    if (!t.dst.on_device()) {  // into the tensor being loaded, read again only after the load
      mem::stream_copy(static_cast<char*>(t.dst.ptr) + (from - t.offset), src, to - from);
      return;
    }
    auto dst = reinterpret_cast<mem::cuda::DevicePtr>(t.dst.ptr) + (from - t.offset);
    drv->bind_context_of(dst);
    drv->memcpy_htod_async(dst, src, to - from, t.dst.stream);
    drv->stream_synchronize(t.dst.stream);  // before the staging buffer (or the decoded one) is reused
  }, drv, cuda_driver, served);
}

void ShardReader::check_extents() const {
  for (const auto& c : impl_->h.chunks) impl_->check_extent(c);
}

std::vector<VerifyProblem> ShardReader::verify(unsigned threads) {
  auto& I = *impl_;
  std::vector<VerifyProblem> problems;
  std::mutex mu;
  std::vector<const ChunkEntry*> chunks;
  for (const auto& c : I.h.chunks) chunks.push_back(&c);
  auto note = [&](const ChunkEntry& c, const std::string& what) {
    std::lock_guard lock(mu);
    problems.push_back({I.h.blobs[c.blob].name, c.file_offset,
                        c.stripe == 0 ? what : ebbtide::detail::concat("in stripe file ", I.path_of(c), ": ", what)});
  };
  // Truncated chunks and missing stripe files are problems too, reported before the rest is read.
  std::vector<const ChunkEntry*> readable;
  for (const auto* c : chunks) {
    if (!I.stripe_error[c->stripe].empty()) {
      const int err = I.stripe_errno[c->stripe];
      note(*c, err == 0 ? I.stripe_error[c->stripe]
                        : ebbtide::detail::concat(I.stripe_error[c->stripe], ": ", std::strerror(err)));
    } else if (!fits_within(c->file_offset, align_up(c->stored_bytes, kBlockBytes), I.sizes[c->stripe])) {
      note(*c, "chunk lies beyond the end of the file (truncated shard)");
    } else {
      readable.push_back(c);
    }
  }
  try {
    I.run_chunks(readable, {}, threads, [&](size_t i, const char* stored) {
      thread_local std::vector<char> out, scratch;
      const ChunkEntry& c = *readable[i];
      try {
        I.check_crc(c, stored);
        if (out.size() < c.raw_bytes) out.resize(c.raw_bytes);
        if (scratch.size() < c.raw_bytes) scratch.resize(c.raw_bytes);
        I.decode_chunk(c, stored, out.data(), scratch.data());
      } catch (const std::exception& e) {
        note(c, e.what());
      }
    });
  } catch (const std::exception& e) {
    problems.push_back({"", 0, e.what()});
  }
  std::sort(problems.begin(), problems.end(), [](const auto& a, const auto& b) { return a.file_offset < b.file_offset; });
  return problems;
}

}  // namespace ebbtide::ckpt
