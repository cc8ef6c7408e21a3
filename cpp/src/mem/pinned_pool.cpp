#include "ebbtide/mem/pinned_pool.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <limits>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::mem {

// Note [Pinned staging memory]
// Staging buffers are one anonymous private mapping, not cudaHostAlloc memory:
// io_uring buffer registration (IORING_REGISTER_BUFFERS) pins pages itself and
// refuses driver-allocated pinned memory on some kernels, while an ordinary
// mapping that is then cuMemHostRegister'ed works for both. One mapping keeps
// the registration to one call and lets the engine register `base()` with the
// ring once. Buffers are handed out LIFO so a lightly loaded pool keeps reusing
// the same cache- and TLB-warm buffers.

size_t PinnedPool::page_size() {
  static const size_t kPage = [] {
    long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return kPage;
}

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
  const size_t total = buffer_bytes_ * count_;

  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (options.populate) flags |= MAP_POPULATE;
  void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw IoError(err, "", -1,
                  detail::concat("pinned pool: mmap of ", count_, " x ", buffer_bytes_, " bytes (",
                                 total, " bytes) failed"));
  }
  base_ = p;

  if (options.cuda_register) {
    register_tried_ = true;
    try {
      if (cuda::Driver* drv = cuda::driver()) registered_ = drv->host_register(base_, total);
    } catch (...) {
      ::munmap(base_, total);
      throw;
    }
  }

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
  if (registered_) {
    try {
      if (cuda::Driver* drv = cuda::driver()) drv->host_unregister(base_);
    } catch (const std::exception& e) {
      log::warn("pinned pool: unregistering ", total_bytes(), " bytes from CUDA failed: ", e.what());
    }
  }
  if (base_ != nullptr && ::munmap(base_, total_bytes()) != 0) {
    log::warn("pinned pool: munmap failed (errno ", errno, ")");
  }
}

bool PinnedPool::ensure_registered() {
  std::lock_guard lock(mu_);
  if (!registered_ && !register_tried_) {
    register_tried_ = true;
    if (cuda::Driver* drv = cuda::driver()) registered_ = drv->host_register(base_, total_bytes());
  }
  return registered_;
}

void* PinnedPool::buffer(size_t index) const {
  EBB_CHECK(index < count_, "pinned pool: buffer index ", index, " out of range (count ", count_, ")");
  return static_cast<char*>(base_) + index * buffer_bytes_;
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
  return Lease(this, i, static_cast<char*>(base_) + i * buffer_bytes_, buffer_bytes_);
}

std::optional<PinnedPool::Lease> PinnedPool::try_acquire() {
  std::lock_guard lock(mu_);
  if (free_.empty()) return std::nullopt;
  size_t i = free_.back();
  free_.pop_back();
  return Lease(this, i, static_cast<char*>(base_) + i * buffer_bytes_, buffer_bytes_);
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
