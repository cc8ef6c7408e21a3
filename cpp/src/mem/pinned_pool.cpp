#include "ebbtide/mem/pinned_pool.hpp"

#include <cstdlib>
#include <limits>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::mem {

// All slots are one mapping (Note [Pinned staging memory] in host_mapping.cpp):
// registration with CUDA is one call, and the engine registers `base()` with
// its ring once. Slots are handed out LIFO so a lightly loaded pool keeps
// reusing the same cache- and TLB-warm buffers.

PinnedPool::PinnedPool(size_t buffer_bytes, size_t count)
    : PinnedPool(buffer_bytes, count, PinnedPoolOptions{}) {}

PinnedPool::PinnedPool(size_t buffer_bytes, size_t count, const PinnedPoolOptions& options)
    : buffer_bytes_(buffer_bytes), count_(count) {
  EBB_CHECK(buffer_bytes > 0, "pinned pool: buffer size must be > 0 bytes");
  EBB_CHECK(count > 0, "pinned pool: buffer count must be > 0");
  const size_t page = page_size();
  EBB_CHECK(buffer_bytes <= std::numeric_limits<size_t>::max() - (page - 1),
            "pinned pool: buffer size ", buffer_bytes, " is too large");
  buffer_bytes_ = (buffer_bytes + page - 1) / page * page;
  EBB_CHECK(buffer_bytes_ <= std::numeric_limits<size_t>::max() / count_, "pinned pool: ", count_,
            " buffers of ", buffer_bytes_, " bytes overflow the address space");
  mapping_ = HostMapping(buffer_bytes_ * count_, detail::concat("pinned pool of ", count_, " x ", buffer_bytes_, " bytes"),
                         options.populate, /*huge=*/true);
  if (options.cuda_register) mapping_.pin(cuda::driver());

  free_.reserve(count_);
  for (size_t i = count_; i-- > 0;) free_.push_back(i);  // index 0 is handed out first
}

PinnedPool::~PinnedPool() {
  size_t out = in_use();
  if (out != 0) {
    // A lease outliving its pool would later write into unmapped memory and
    // return itself to a dead pool; stop here, where the bug is visible.
    log::error("PinnedPool destroyed with ", out, " of ", count_,
               " buffers still leased: every Lease must be released before its pool dies");
    std::abort();
  }
}

bool PinnedPool::ensure_registered() {
  std::lock_guard lock(mu_);
  return mapping_.pin(cuda::driver());
}

void* PinnedPool::buffer(size_t index) const {
  EBB_CHECK(index < count_, "pinned pool: buffer index ", index, " out of range (count ", count_, ")");
  return static_cast<char*>(base()) + index * buffer_bytes_;
}

size_t PinnedPool::index_of(const Lease& lease) const {
  EBB_CHECK(lease.pool_ == this, "pinned pool: the lease does not belong to this pool");
  return lease.index_;
}

size_t PinnedPool::in_use() const {
  std::lock_guard lock(mu_);
  return count_ - free_.size();
}

PinnedPool::Lease PinnedPool::acquire() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return !free_.empty(); });
  size_t i = free_.back();
  free_.pop_back();
  return Lease(this, i, static_cast<char*>(base()) + i * buffer_bytes_, buffer_bytes_);
}

std::optional<PinnedPool::Lease> PinnedPool::try_acquire() {
  std::lock_guard lock(mu_);
  if (free_.empty()) return std::nullopt;
  size_t i = free_.back();
  free_.pop_back();
  return Lease(this, i, static_cast<char*>(base()) + i * buffer_bytes_, buffer_bytes_);
}

void PinnedPool::release(size_t index) {
  {
    std::lock_guard lock(mu_);
    EBB_ASSERT(index < count_ && free_.size() < count_, "pinned pool: buffer ", index,
               " released twice or foreign");
    free_.push_back(index);
  }
  cv_.notify_one();
}

PinnedPool::Lease::Lease(Lease&& o) noexcept
    : pool_(o.pool_), index_(o.index_), data_(o.data_), size_(o.size_) {
  o.pool_ = nullptr;
  o.data_ = nullptr;
  o.size_ = 0;
}

PinnedPool::Lease& PinnedPool::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    reset();
    pool_ = o.pool_;
    index_ = o.index_;
    data_ = o.data_;
    size_ = o.size_;
    o.pool_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

PinnedPool::Lease::~Lease() { reset(); }

void PinnedPool::Lease::reset() {
  if (pool_ != nullptr) {
    PinnedPool* p = pool_;
    pool_ = nullptr;
    data_ = nullptr;
    size_ = 0;
    p->release(index_);
  }
}

}  // namespace ebbtide::mem
