#include "ebbtide/mem/buffer_pool.hpp"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>

#include "ebbtide/util/error.hpp"

namespace ebbtide::mem {

// Note [Buffer reuse]
// Training stores and reloads similar shapes every step: keeping freed
// buffers spares the allocator's mmap/munmap, the kernel's zeroing and
// faulting of fresh pages and, for pinned buffers, a cuMemHostRegister
// (milliseconds per MiB, on the training thread) per buffer per step. Plain
// buffers are kept by their rounded size: they come from the heap, where
// small ones share pages, and a new one costs little. Pinned buffers are
// mappings of whole pages (registration pins pages, never parts of them) in
// size classes: whole pages, then multiples of 1/8 of the largest power of
// two not above the size (at most 12.5% slack). A request takes the smallest
// spare of at least its class and at most twice it, so activations whose
// sizes change from step to step (variable sequence lengths) reuse pinned
// buffers: once the largest have been seen, sizes down to half of theirs
// register nothing new, at the price of up to half a buffer unused while it
// is out. Spares are bounded by the most bytes ever handed out at once, so a
// pool never holds more than twice its peak.

HostBufferPool::HostBufferPool(HostBufferPoolOptions options) : opts_(std::move(options)) {
  EBB_CHECK(opts_.align > 0 && (opts_.align & (opts_.align - 1)) == 0, opts_.name, ": alignment ", opts_.align,
            " is not a power of two");
}

HostBufferPool::~HostBufferPool() {
  for (auto& [key, v] : spare_)
    for (Block& b : v) free_block(b);
  for (auto& [p, b] : out_) free_block(b);
}

size_t HostBufferPool::pinned_size_class(size_t nbytes) {
  const size_t page = HostMapping::page_size();
  const size_t pages = (nbytes + page - 1) / page * page;
  if (pages <= 8 * page) return pages;
  const size_t step = std::bit_floor(pages) / 8;  // a power of two, at least a page
  return (pages + step - 1) / step * step;
}

void HostBufferPool::free_block(Block& b) noexcept {
  if (b.kind == Kind::kHeap) std::free(b.data);
  b.mapping = HostMapping();  // unregisters and unmaps
  b.data = nullptr;
}

bool HostBufferPool::take_spare(size_t bytes, Kind kind, Block& out) {
  auto it = spare_.lower_bound({kind, bytes});
  if (it == spare_.end() || it->first.first != kind) return false;
  const size_t have = it->first.second;
  if (kind == Kind::kHeap ? have != bytes : have / 2 > bytes) return false;  // Note [Buffer reuse]
  out = std::move(it->second.back());
  it->second.pop_back();
  if (it->second.empty()) spare_.erase(it);
  spare_bytes_ -= out.bytes;
  ++reused_;
  return true;
}

HostBufferPool::Block HostBufferPool::allocate(size_t bytes, bool pin) {
  Block b;
  b.bytes = bytes;
  if (pin) {
    b.mapping = HostMapping(bytes, opts_.name);
    if (opts_.driver != nullptr) {
      const bool pinned = b.mapping.pin(opts_.driver);  // a refusal is warned once by the shim
      registrations_.fetch_add(1, std::memory_order_relaxed);
      b.kind = pinned ? Kind::kPinned : Kind::kRefused;
    } else {
      b.kind = Kind::kRefused;
    }
    b.data = b.mapping.data();
    return b;
  }
  if (::posix_memalign(&b.data, std::max(opts_.align, sizeof(void*)), bytes) != 0)
    throw IoError(ENOMEM, "host memory", 0, detail::concat(opts_.name, ": cannot allocate ", bytes, " bytes"));
  return b;
}

HostBufferPool::Buffer HostBufferPool::take(size_t nbytes, bool pin) {
  EBB_CHECK(nbytes > 0, opts_.name, ": empty buffer requested");
  EBB_CHECK(nbytes <= SIZE_MAX / 2, opts_.name, ": ", nbytes, " bytes is too large");
  const size_t bytes = pin ? pinned_size_class(nbytes) : (nbytes + opts_.align - 1) / opts_.align * opts_.align;
  Block b;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    found = pin ? take_spare(bytes, Kind::kPinned, b) || take_spare(bytes, Kind::kRefused, b)
                : take_spare(bytes, Kind::kHeap, b);
  }
  if (!found) b = allocate(bytes, pin);
  // pinned(), not the kind: a forked child's buffers are no longer pinned (Note [Pinned memory across fork]).
  const Buffer out{b.data, b.bytes, b.mapping.pinned()};
  std::lock_guard<std::mutex> lock(mu_);
  out_bytes_ += b.bytes;
  high_water_ = std::max(high_water_, out_bytes_);
  out_.emplace(out.data, std::move(b));
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
      const auto key = std::make_pair(b.kind, b.bytes);
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
