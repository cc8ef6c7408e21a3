// A bounded pool of page-aligned host buffers for staging I/O.
//
// Buffers are fixed slots of one HostMapping, registered with the CUDA driver
// when a driver is present (cuMemHostRegister, in the context of the device
// they serve: Note [Registration context] in host_mapping.cpp) so device
// copies from and to them are truly asynchronous; one mapping lets an
// io_uring ring register every slot at once (base()). acquire() blocks while
// every buffer is in use (bounded memory); buffers are reused, never freed
// until the pool dies (on any thread). Thread safe.
// The pool must outlive every Lease taken from it: destroying it with leases
// out is a bug and aborts the process with a message.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "ebbtide/mem/host_mapping.hpp"

namespace ebbtide::mem {

struct PinnedPoolOptions {
  bool populate = false;  // MAP_POPULATE: fault every page in at construction
  // cuMemHostRegister at construction, in the context current there; with no
  // context current, or false, the pool stays pageable until ensure_registered().
  bool cuda_register = true;
  cuda::Driver* driver = nullptr;  // registers with it; nullptr: the process's (cuda::driver())
};

class PinnedPool {
 public:
  // `count` buffers of `buffer_bytes` each (rounded up to the page size).
  // Throws InvalidArgument for zero sizes (or a total that overflows), IoError
  // when mmap fails.
  PinnedPool(size_t buffer_bytes, size_t count);
  PinnedPool(size_t buffer_bytes, size_t count, const PinnedPoolOptions& options);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // RAII handle to one buffer; returns it to the pool on destruction.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept;
    Lease& operator=(Lease&& o) noexcept;
    ~Lease();
    void* data() const { return data_; }
    size_t size() const { return size_; }
    explicit operator bool() const { return data_ != nullptr; }
    void reset();

   private:
    friend class PinnedPool;
    Lease(PinnedPool* pool, size_t index, void* data, size_t size)
        : pool_(pool), index_(index), data_(data), size_(size) {}
    PinnedPool* pool_ = nullptr;
    size_t index_ = 0;
    void* data_ = nullptr;
    size_t size_ = 0;
  };

  Lease acquire();                    // blocks until a buffer is free
  std::optional<Lease> try_acquire(); // nullopt when all are in use

  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t count() const { return count_; }
  size_t in_use() const;
  bool registered() const { return mapping_.pinned(); }  // pinned with the CUDA driver
  // Registers a pool that is not yet, once, when a CUDA driver is present
  // (pools that may never see a device copy register on first need, so
  // CPU-only work never initialises CUDA), in the calling thread's current
  // context: bind the device the buffers serve first (IoError from the driver
  // when none is current). With `device`, that device's primary context is
  // bound for the call instead (cuda::DeviceScope). Returns registered().
  // Call before leasing buffers for device copies; not concurrent with them.
  bool ensure_registered();
  bool ensure_registered(int device);
  void* base() const { return mapping_.data(); }  // for io_uring buffer registration
  size_t total_bytes() const { return buffer_bytes_ * count_; }
  // Start of buffer `index` (< count()); the same address every time it is leased.
  void* buffer(size_t index) const;
  // Index of the buffer a lease from this pool holds (for io_uring fixed buffers).
  size_t index_of(const Lease& lease) const;
  static size_t page_size() { return HostMapping::page_size(); }

 private:
  void release(size_t index);
  size_t buffer_bytes_;
  size_t count_;
  cuda::Driver* driver_;  // registers the mapping; nullptr: no CUDA
  HostMapping mapping_;   // pinning guarded by mu_
  mutable std::mutex mu_;
  LockedAcrossFork fork_lock_{mu_};  // Note [Pinned memory across fork]
  std::condition_variable cv_;
  std::vector<size_t> free_;
};

// Note [Reused staging]
// Readers and the safetensors writer need their staging only for one call,
// but fresh memory is not free: it must be faulted in (and pinned by io_uring
// registration) before the first transfer, which on a VM whose hypervisor
// reclaims freed memory costs more than the transfers (a 1 GB safetensors
// load into existing tensors: 0.60-0.75 s with its staging fresh, 0.45-0.49 s
// recycled). borrow_pinned_pool() lends a pool from a process-wide cache of
// idle ones of the same shape (buffer size, count, registration wanted) and
// takes it back when the borrower drops it; at most kMaxIdlePinnedBytes stay
// idle (the rest is unmapped), and they stay until the process exits. They
// register with the process's driver only (options.driver must be nullptr:
// InvalidArgument), as a pool may outlive any other.
struct ReturnPinnedPool {
  void operator()(PinnedPool* pool) const noexcept;
};
using BorrowedPinnedPool = std::unique_ptr<PinnedPool, ReturnPinnedPool>;
inline constexpr size_t kMaxIdlePinnedBytes = size_t{128} << 20;
BorrowedPinnedPool borrow_pinned_pool(size_t buffer_bytes, size_t count, const PinnedPoolOptions& options);
// Bytes of idle pools held for borrowing (tests).
size_t idle_pinned_bytes();

}  // namespace ebbtide::mem
