// Page-aligned host buffers for reloads into host memory, reused by exact size.
//
// Training reloads the same sizes every step; reusing buffers spares the
// allocator's mmap/munmap and the kernel's zeroing of fresh pages, and page
// alignment lets O_DIRECT reads land in place. Spare buffers are kept up to the
// most bytes ever handed out at once (so a steady state allocates nothing).
// Thread safe; give() may run on any thread (it never calls back).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace ebbtide::cache {

class HostBufferPool {
 public:
  static constexpr size_t kAlign = 4096;
  HostBufferPool() = default;
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // A buffer of at least `nbytes` (> 0), page aligned. IoError(ENOMEM) when
  // memory is exhausted.
  void* take(size_t nbytes);
  // Returns a buffer from take(); StateError for a pointer it did not hand out.
  void give(void* p);

  size_t out_bytes() const;    // handed out now
  size_t spare_bytes() const;  // kept for reuse
  uint64_t reused() const;     // take() calls served from spares

  // The process-wide pool: the tensor cache's host reload buffers (never destroyed).
  static HostBufferPool& shared();

 private:
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> out_;
  std::unordered_map<size_t, std::vector<void*>> spare_;
  size_t out_bytes_ = 0;
  size_t spare_bytes_ = 0;
  size_t high_water_ = 0;
  uint64_t reused_ = 0;
};

}  // namespace ebbtide::cache
