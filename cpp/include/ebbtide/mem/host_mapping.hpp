// Page-aligned anonymous host memory, page-locked with the CUDA driver on request.
//
// The one place ebbtide maps host memory for I/O and device copies (Note
// [Pinned staging memory]): the fixed-slot PinnedPool, the page-locked buffers
// of HostBufferPool and the checkpoint writer's snapshot arena all stand on
// it. The memory starts zeroed. Move-only; not thread safe (owners serialise
// pin() against their own use); the destructor unregisters (in the context
// that pinned, on any thread) and unmaps. A child made by fork() inherits
// pinned mappings as fresh, zeroed, unpinned memory at the same address
// (Note [Pinned memory across fork]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string_view>

#include "ebbtide/mem/cuda_shim.hpp"

namespace ebbtide::mem {

class HostMapping {
 public:
  HostMapping() = default;
  // Maps `bytes` rounded up to the page size; `owner` names the caller in
  // errors ("pinned pool"). `populate`: fault every page in now. `huge`: an
  // I/O buffer, 2 MiB aligned and advised MADV_HUGEPAGE when it has 2 MiB or
  // more (Note [Huge-page buffers] in host_mapping.cpp).
  // Throws InvalidArgument for 0 bytes or a size that overflows, IoError when
  // mmap fails.
  HostMapping(size_t bytes, std::string_view owner, bool populate = false, bool huge = false);
  static constexpr size_t kHugePage = size_t{2} << 20;
  ~HostMapping();
  HostMapping(HostMapping&& o) noexcept;
  HostMapping& operator=(HostMapping&& o) noexcept;
  HostMapping(const HostMapping&) = delete;
  HostMapping& operator=(const HostMapping&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }  // whole pages
  explicit operator bool() const { return data_ != nullptr; }

  // Registers the whole mapping with `driver` (cuMemHostRegister) in the
  // calling thread's current context, which must be that of the device the
  // memory serves (Note [Registration context]), unless it was tried
  // already; a refusal (false, warned once by the shim) is not retried.
  // nullptr (no driver) leaves it unpinned. With no context current the
  // driver's IoError propagates, nothing is registered and pin() may be
  // called again. Returns pinned(). The driver must outlive the mapping,
  // which unregisters with it.
  bool pin(cuda::Driver* driver);
  // Page-locked by this process (false in a forked child).
  bool pinned() const;
  bool pin_tried() const { return pin_tried_; }

  static size_t page_size();

 private:
  void release() noexcept;
  void* data_ = nullptr;
  size_t size_ = 0;
  cuda::Driver* pinned_by_ = nullptr;
  cuda::Context context_ = 0;  // current when pinned: unregistration binds it
  uint64_t generation_ = 0;    // the process's fork generation when pinned
  bool pin_tried_ = false;
  bool dontfork_ = false;  // advised MADV_DONTFORK: a child gets fresh memory here
};

// Keeps `mu` locked across every fork() of the process (pthread_atfork), so a
// forked child never finds it held by a thread it does not have (Note
// [Pinned memory across fork]): a member declared right after the mutex of a
// pool whose state a child may use. Code holding `mu` must not fork, nor wait
// for another such mutex.
class LockedAcrossFork {
 public:
  explicit LockedAcrossFork(std::mutex& mu);
  ~LockedAcrossFork();
  LockedAcrossFork(const LockedAcrossFork&) = delete;
  LockedAcrossFork& operator=(const LockedAcrossFork&) = delete;

 private:
  std::mutex* mu_;
};

}  // namespace ebbtide::mem
