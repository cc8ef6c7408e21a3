#include "ebbtide/mem/pinned_pool.hpp"

#include <cstdlib>
#include <iterator>
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
    : buffer_bytes_(buffer_bytes), count_(count), driver_(options.driver) {
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
  if (options.cuda_register) {
    // Not in a context made up for it (Note [Registration context]): a thread
    // without one leaves the pool to ensure_registered().
    if (driver_ == nullptr) driver_ = cuda::driver();
    if (driver_ != nullptr && driver_->current_context() != 0) mapping_.pin(driver_);
    else if (driver_ != nullptr)
      log::info("pinned pool: no CUDA context is current; ", count_, " x ", buffer_bytes_,
                " bytes stay pageable until ensure_registered() runs with a device bound");
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
}

bool PinnedPool::ensure_registered() {
  std::lock_guard lock(mu_);
  if (driver_ == nullptr) driver_ = cuda::driver();
  return mapping_.pin(driver_);
}

bool PinnedPool::ensure_registered(int device) {
  std::lock_guard lock(mu_);
  if (driver_ == nullptr) driver_ = cuda::driver();
  if (driver_ == nullptr || mapping_.pin_tried()) return mapping_.pinned();
  cuda::DeviceScope scope(driver_, device);
  return mapping_.pin(driver_);
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

// Note [Reused staging] (pinned_pool.hpp).
namespace {
struct IdlePools {
  std::mutex mu;
  LockedAcrossFork fork_lock{mu};  // Note [Pinned memory across fork]
  std::vector<std::pair<bool, std::unique_ptr<PinnedPool>>> pools;  // (registered with CUDA, pool)
  size_t bytes = 0;
};
// Never destroyed: a pool may come back while static objects are torn down.
IdlePools& idle_pools() {
  static auto* idle = new IdlePools;
  return *idle;
}
}  // namespace

void ReturnPinnedPool::operator()(PinnedPool* pool) const noexcept {
  std::unique_ptr<PinnedPool> owned(pool);
  if (pool == nullptr || pool->in_use() != 0) return;  // a pool with leases out aborts in its destructor
  auto& idle = idle_pools();
  std::lock_guard lock(idle.mu);
  if (idle.bytes + pool->total_bytes() > kMaxIdlePinnedBytes) return;  // unmapped
  idle.bytes += pool->total_bytes();
  // Registered pools serve either kind of request; unregistered ones only those that do not ask.
  idle.pools.emplace_back(pool->registered(), std::move(owned));
}

BorrowedPinnedPool borrow_pinned_pool(size_t buffer_bytes, size_t count, const PinnedPoolOptions& options) {
  EBB_CHECK(options.driver == nullptr, "borrow_pinned_pool: idle pools register with the process's CUDA driver only");
  const size_t page = PinnedPool::page_size();
  const size_t rounded = buffer_bytes <= std::numeric_limits<size_t>::max() - (page - 1)
                             ? (buffer_bytes + page - 1) / page * page
                             : 0;  // the constructor below reports it
  {
    auto& idle = idle_pools();
    std::lock_guard lock(idle.mu);
    for (auto it = idle.pools.rbegin(); it != idle.pools.rend(); ++it) {  // the last returned is the warmest
      PinnedPool& p = *it->second;
      if (p.buffer_bytes() != rounded || p.count() != count || (options.cuda_register && !it->first)) continue;
      idle.bytes -= p.total_bytes();
      BorrowedPinnedPool out(it->second.release());
      idle.pools.erase(std::next(it).base());
      return out;
    }
  }
  return BorrowedPinnedPool(new PinnedPool(buffer_bytes, count, options));
}

size_t idle_pinned_bytes() {
  auto& idle = idle_pools();
  std::lock_guard lock(idle.mu);
  return idle.bytes;
}

}  // namespace ebbtide::mem
