// Shard reader. Chunks are read by the worker threads (each with its own
// aligned buffer), checked against their crc32c before anything is decoded,
// then decompressed straight into the destination (or through a host buffer
// and cuMemcpyHtoDAsync for device targets).
#include "ebbtide/ckpt/reader.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <cstring>
#include <memory>

#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
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
  std::unique_ptr<detail::ShardFile> file;
  Superblock sb;
  Header h;
  uint64_t size = 0;

  // Reads stored bytes of chunk `c` into buf (>= align_up(stored)) and checks its crc.
  void read_chunk(const ChunkEntry& c, char* buf) {
    const std::string& name = h.blobs[c.blob].name;
    uint64_t len = align_up(c.stored_bytes, kBlockBytes);
    if (c.file_offset + len > size) {
      throw IoError(ENODATA, tensor_at(file->path(), name), static_cast<int64_t>(c.file_offset),
                    ebbtide::detail::concat("truncated checkpoint shard: chunk needs bytes up to ", c.file_offset + len,
                                   " but the file has ", size));
    }
    detail::read_exact(*file, buf, len, c.file_offset);
    uint32_t crc = crc32c(buf, c.stored_bytes);
    if (crc != c.crc) throw ChecksumError(tensor_at(file->path(), name), static_cast<int64_t>(c.file_offset), c.crc, crc);
  }

  void decode_chunk(const ChunkEntry& c, const char* stored, char* dst, char* scratch) {
    const auto& b = h.blobs[c.blob];
    std::string what = ebbtide::detail::concat(tensor_at(file->path(), b.name), " chunk at offset ", c.file_offset);
    decompress_chunk(c.codec, b.elem_bytes, stored, c.stored_bytes, dst, c.raw_bytes, scratch, what.c_str());
  }
};

ShardReader::ShardReader(const std::string& path, bool direct) : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.file = std::make_unique<detail::ShardFile>(path, false, direct);
  I.size = I.file->size();
  if (I.size < kBlockBytes) {
    throw InvalidArgument(ebbtide::detail::concat(path, ": truncated checkpoint shard (", I.size,
                                         " bytes, smaller than the 4096-byte superblock)"));
  }
  auto blk = aligned_buf(kBlockBytes);
  detail::read_exact(*I.file, blk.get(), kBlockBytes, 0);
  I.sb = decode_superblock(reinterpret_cast<const unsigned char*>(blk.get()), path);
  if (I.sb.file_bytes > I.size || I.sb.header_offset + I.sb.header_bytes > I.size) {
    throw InvalidArgument(ebbtide::detail::concat(path, ": truncated checkpoint shard (", I.size, " bytes on disk, the superblock says ",
                                         I.sb.file_bytes, "; the header at offset ", I.sb.header_offset, " is missing)"));
  }
  EBB_CHECK(I.sb.header_offset % kBlockBytes == 0 && I.sb.header_offset >= kDataStart, path,
            ": corrupt superblock (header offset ", I.sb.header_offset, ")");
  uint64_t hlen = align_up(I.sb.header_bytes, kBlockBytes);
  auto hb = aligned_buf(hlen);
  detail::read_exact(*I.file, hb.get(), std::min(hlen, I.size - I.sb.header_offset), I.sb.header_offset);
  uint32_t crc = crc32c(hb.get(), I.sb.header_bytes);
  if (crc != I.sb.header_crc) throw ChecksumError(path + " (header)", static_cast<int64_t>(I.sb.header_offset), I.sb.header_crc, crc);
  I.h = decode_header(std::string_view(hb.get(), I.sb.header_bytes), path);
}

ShardReader::~ShardReader() = default;
const Superblock& ShardReader::superblock() const { return impl_->sb; }
const Header& ShardReader::header() const { return impl_->h; }
const std::string& ShardReader::path() const { return impl_->file->path(); }
uint64_t ShardReader::file_bytes() const { return impl_->size; }

void ShardReader::read(const std::vector<BlobTarget>& targets, unsigned threads) {
  auto& I = *impl_;
  struct Work {
    const ChunkEntry* c;
    const BlobTarget* t;
  };
  std::vector<Work> work;
  mem::cuda::Driver* drv = nullptr;
  for (const auto& t : targets) {
    EBB_CHECK(t.blob < I.h.blobs.size(), path(), ": blob index ", t.blob, " out of range (", I.h.blobs.size(), " blobs)");
    const auto& b = I.h.blobs[t.blob];
    EBB_CHECK(t.ptr != nullptr || b.nbytes == 0, "null destination for tensor '", b.name, "'");
    if (t.device && drv == nullptr) {
      drv = mem::cuda::driver();
      EBB_CHECK(drv != nullptr, "tensor '", b.name, "' is to be loaded into CUDA memory but no CUDA driver is usable: ",
                mem::cuda::unavailable_reason());
    }
    for (uint32_t k = 0; k < b.chunk_count; ++k) work.push_back({&I.h.chunks[b.first_chunk + k], &t});
  }
  detail::Workers pool(threads ? threads - 1 : detail::default_threads() - 1);
  pool.parallel_for(work.size(), [&](size_t i) {
    thread_local std::vector<char> scratch, host;
    thread_local AlignedBuf buf;
    thread_local uint64_t buf_cap = 0;
    const ChunkEntry& c = *work[i].c;
    const BlobTarget& t = *work[i].t;
    uint64_t need = align_up(c.stored_bytes, kBlockBytes);
    if (buf_cap < need) {
      buf = aligned_buf(need);
      buf_cap = need;
    }
    I.read_chunk(c, buf.get());
    if (scratch.size() < c.raw_bytes) scratch.resize(c.raw_bytes);
    if (!t.device) {
      I.decode_chunk(c, buf.get(), static_cast<char*>(t.ptr) + c.raw_offset, scratch.data());
    } else {
      if (host.size() < c.raw_bytes) host.resize(c.raw_bytes);
      I.decode_chunk(c, buf.get(), host.data(), scratch.data());
      auto dst = reinterpret_cast<mem::cuda::DevicePtr>(t.ptr) + c.raw_offset;
      drv->bind_context_of(dst);
      drv->memcpy_htod_async(dst, host.data(), c.raw_bytes, t.stream);
      drv->stream_synchronize(t.stream);
    }
  });
}

std::vector<VerifyProblem> ShardReader::verify(unsigned threads) {
  auto& I = *impl_;
  std::vector<VerifyProblem> problems;
  std::mutex mu;
  detail::Workers pool(threads ? threads - 1 : detail::default_threads() - 1);
  pool.parallel_for(I.h.chunks.size(), [&](size_t i) {
    const ChunkEntry& c = I.h.chunks[i];
    try {
      auto buf = aligned_buf(align_up(c.stored_bytes, kBlockBytes));
      I.read_chunk(c, buf.get());
      std::vector<char> out(c.raw_bytes), scratch(c.raw_bytes);
      I.decode_chunk(c, buf.get(), out.data(), scratch.data());
    } catch (const std::exception& e) {
      std::lock_guard lock(mu);
      problems.push_back({I.h.blobs[c.blob].name, c.file_offset, e.what()});
    }
  });
  std::sort(problems.begin(), problems.end(), [](const auto& a, const auto& b) { return a.file_offset < b.file_offset; });
  return problems;
}

}  // namespace ebbtide::ckpt
