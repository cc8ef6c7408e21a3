#include "ebbtide/mem/buffer_pool.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "ebbtide/util/error.hpp"

namespace ebbtide::mem {

// Note [Buffer reuse]
// Training stores and reloads the same shapes every step: keeping freed
// buffers by exact size spares the allocator's mmap/munmap, the kernel's
// zeroing and faulting of fresh pages and, for pinned buffers, a
// cuMemHostRegister (which costs about as much as touching every page) per
// buffer per step. Spares are bounded by the most bytes ever handed out at
// once, so a pool never holds more than twice its peak. Plain buffers come
// from the heap, where small ones share pages; pinned ones are mappings of
// whole pages, as registration pins pages, never parts of them.

HostBufferPool::HostBufferPool(HostBufferPoolOptions options) : opts_(std::move(options)) {
  EBB_CHECK(opts_.align > 0 && (opts_.align & (opts_.align - 1)) == 0, opts_.name, ": alignment ", opts_.align,
            " is not a power of two");
}

HostBufferPool::~HostBufferPool() {
  for (auto& [key, v] : spare_)
    for (Block& b : v) free_block(b);
  for (auto& [p, b] : out_) free_block(b);
}

void HostBufferPool::free_block(Block& b) noexcept {
  if (b.kind == Kind::kHeap) std::free(b.data);
  b.mapping = HostMapping();  // unregisters and unmaps
  b.data = nullptr;
}

bool HostBufferPool::take_spare(size_t bytes, Kind kind, Block& out) {
  auto it = spare_.find({bytes, kind});
  if (it == spare_.end() || it->second.empty()) return false;
  out = std::move(it->second.back());
  it->second.pop_back();
  spare_bytes_ -= bytes;
  ++reused_;
  return true;
}

HostBufferPool::Block HostBufferPool::allocate(size_t bytes, bool pin) {
  Block b;
  b.bytes = bytes;
  if (pin) {
    b.mapping = HostMapping(bytes, opts_.name);
    b.kind = b.mapping.pin(opts_.driver) ? Kind::kPinned : Kind::kRefused;  // a refusal is warned once by the shim
    b.data = b.mapping.data();
    return b;
  }
  if (::posix_memalign(&b.data, std::max(opts_.align, sizeof(void*)), bytes) != 0)
    throw IoError(ENOMEM, "host memory", 0, detail::concat(opts_.name, ": cannot allocate ", bytes, " bytes"));
  return b;
}

HostBufferPool::Buffer HostBufferPool::take(size_t nbytes, bool pin) {
  EBB_CHECK(nbytes > 0, opts_.name, ": empty buffer requested");
  const size_t granule = pin ? HostMapping::page_size() : opts_.align;
  EBB_CHECK(nbytes <= SIZE_MAX - (granule - 1), opts_.name, ": ", nbytes, " bytes is too large");
  const size_t bytes = (nbytes + granule - 1) / granule * granule;
  Block b;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    found = pin ? take_spare(bytes, Kind::kPinned, b) || take_spare(bytes, Kind::kRefused, b)
                : take_spare(bytes, Kind::kHeap, b);
  }
  if (!found) b = allocate(bytes, pin);
  const Buffer out{b.data, bytes, b.kind == Kind::kPinned};
  std::lock_guard<std::mutex> lock(mu_);
  out_.emplace(out.data, std::move(b));
  out_bytes_ += bytes;
  high_water_ = std::max(high_water_, out_bytes_);
  return out;
}

void HostBufferPool::give(void* p) {
  Block b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = out_.find(p);
    EBB_CHECK_STATE(it != out_.end(), opts_.name, ": ", p, " was not handed out by this pool");
    b = std::move(it->second);
    out_.erase(it);
    out_bytes_ -= b.bytes;
    if (spare_bytes_ + b.bytes <= high_water_) {
      spare_bytes_ += b.bytes;
      const auto key = std::make_pair(b.bytes, b.kind);
      spare_[key].push_back(std::move(b));
      return;
    }
  }
  free_block(b);  // outside the lock: unregistering waits for the driver
}

size_t HostBufferPool::out_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return out_bytes_;
}
size_t HostBufferPool::spare_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spare_bytes_;
}
uint64_t HostBufferPool::reused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reused_;
}

HostBufferPool& HostBufferPool::shared() {
  static auto* pool = new HostBufferPool();  // leaked: buffers may die at interpreter exit
  return *pool;
}

}  // namespace ebbtide::mem
