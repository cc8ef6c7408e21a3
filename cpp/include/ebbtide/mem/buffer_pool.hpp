// Host buffers reused by size (Note [Buffer reuse] in buffer_pool.cpp).
//
// take() hands out a buffer of at least the bytes asked for; give() returns
// it, and it is kept as a spare for later take()s, up to the most bytes ever
// handed out at once (so a steady state allocates nothing). Plain buffers are
// heap memory aligned to `align`, reused for the same rounded size; buffers
// taken with `pin` are whole-page HostMappings in size classes, page-locked
// through the pool's driver in the calling thread's current context (Note
// [Registration context] in host_mapping.cpp). Thread safe; give() may run
// on any thread (it never calls back), and so may the destructor.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ebbtide/mem/host_mapping.hpp"

namespace ebbtide::mem {

struct HostBufferPoolOptions {
  size_t align = 4096;             // plain buffers: alignment and size granule (a power of two)
  cuda::Driver* driver = nullptr;  // pins buffers taken with `pin`; must outlive the pool
  std::string name = "host buffer pool";  // names the pool in errors
};

class HostBufferPool {
 public:
  struct Buffer {
    void* data = nullptr;
    size_t bytes = 0;     // usable bytes: the request rounded up to the granule or size class, or a larger spare's
    bool pinned = false;  // page-locked with the pool's driver
  };

  HostBufferPool() : HostBufferPool(HostBufferPoolOptions{}) {}
  // InvalidArgument when `align` is not a power of two.
  explicit HostBufferPool(HostBufferPoolOptions options);
  ~HostBufferPool();  // frees every buffer, spare or still handed out
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // A buffer of at least `nbytes` (> 0). With `pin`, a page-locked buffer when
  // the driver accepts one: the smallest pinned spare of the request's size
  // class up to twice it, else such a spare the driver refused before (not
  // retried), else a new mapping of the class pinned now, which needs the
  // device the memory serves bound on the calling thread (IoError from the
  // driver otherwise, and nothing is taken); `pinned` tells which. Without,
  // plain memory (never page-locked, never touching the driver).
  // IoError(ENOMEM) when memory is exhausted; InvalidArgument for 0 or more
  // than half the address space.
  Buffer take(size_t nbytes, bool pin = false);
  // Returns a buffer from take(); StateError for a pointer it did not hand out.
  void give(void* p);

  size_t out_bytes() const;    // handed out now
  size_t spare_bytes() const;  // kept for reuse
  uint64_t reused() const;     // take() calls served from spares
  // cuMemHostRegister calls made for new pinned buffers (accepted or refused).
  uint64_t registrations() const { return registrations_.load(std::memory_order_relaxed); }

  // The bytes of a pinned buffer for a request of `nbytes`: whole pages, then
  // a multiple of 1/8 of the largest power of two not above it.
  static size_t pinned_size_class(size_t nbytes);

  // The process-wide pool of plain page-aligned buffers: the tensor cache's
  // host reload buffers (never destroyed).
  static HostBufferPool& shared();

 private:
  enum class Kind : uint8_t { kHeap, kPinned, kRefused };  // kRefused: a mapping the driver would not pin
  struct Block {
    void* data = nullptr;
    size_t bytes = 0;
    Kind kind = Kind::kHeap;
    HostMapping mapping;  // holds kPinned and kRefused memory; kHeap memory is freed by the pool
  };
  bool take_spare(size_t bytes, Kind kind, Block& out);
  Block allocate(size_t bytes, bool pin);
  static void free_block(Block& b) noexcept;

  const HostBufferPoolOptions opts_;
  mutable std::mutex mu_;
  LockedAcrossFork fork_lock_{mu_};  // Note [Pinned memory across fork]
  std::unordered_map<void*, Block> out_;
  std::map<std::pair<Kind, size_t>, std::vector<Block>> spare_;  // no empty vectors
  size_t out_bytes_ = 0;
  size_t spare_bytes_ = 0;
  size_t high_water_ = 0;
  uint64_t reused_ = 0;
  std::atomic<uint64_t> registrations_{0};
};

}  // namespace ebbtide::mem
