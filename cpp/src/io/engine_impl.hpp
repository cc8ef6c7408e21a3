// Internal: the storage engine's state, shared by the files that implement
// it (engine.cpp: workers and requests, engine_slots.cpp, striping.cpp,
// engine_device_copy.cpp, request.cpp, engine_testing.cpp). Layout:
//  - Slab files (anonymous DirectFiles), one per directory, form one logical
//    space striped RAID0-style in chunk_bytes units: logical offset L lives in
//    slab (L / chunk) % N at file offset ((L / chunk) / N) * chunk + L % chunk
//    (stripe_pos in striping.cpp).
//  - SlotAllocator hands out aligned extents of that logical space.
//  - A request is split at stripe boundaries into chunks; each chunk goes to
//    the worker of the block device holding its slab. A worker keeps up to
//    queue_depth chunks in flight on its TransferLoop (io_uring ring or POSIX
//    threads; Note [Transfer loop] in transfer.cpp), taking loads before stores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ebbtide/io/detail/slot_allocator.hpp"
#include "ebbtide/io/direct_file.hpp"
#include "ebbtide/io/engine.hpp"
#include "ebbtide/mem/cufile_shim.hpp"
#include "ebbtide/mem/pinned_pool.hpp"

namespace ebbtide::io {

namespace detail {

enum Phase : int { kQueued = 0, kStarted = 1, kCancelled = 2 };

struct RequestState {
  SlotId slot = 0;
  uint64_t nbytes = 0;
  bool write = false;
  mem::Buffer buf;
  Callback on_done;
  std::atomic<int> phase{kQueued};
  std::atomic<uint32_t> remaining{0};
  std::vector<uint32_t> crcs;  // write: computed per chunk; read: expected
  std::mutex mu;
  std::condition_variable cv;
  bool done = false, finished = false, was_cancelled = false;
  std::exception_ptr error;
};

using ReqPtr = std::shared_ptr<RequestState>;

struct Chunk;
struct Device {
  dev_t dev = 0;
  std::vector<DirectFile*> slabs;
  std::unique_ptr<TransferLoop> loop;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Chunk*> loads, stores;
  bool stop = false;
  std::thread thread;
};

struct Chunk {
  ReqPtr req;
  uint32_t index = 0;
  DirectFile* slab = nullptr;
  size_t slab_index = 0;
  Device* dev = nullptr;
  uint64_t file_off = 0;
  char* user = nullptr;
  uint64_t len = 0;     // bytes of user data
  uint64_t io_len = 0;  // bytes moved (delta + len rounded up to the alignment on staging)
  uint64_t delta = 0;   // staging: the data starts this far into io_buf (file_off - delta is aligned)
  int staging = -1;  // index of `lease` in the pool (io_uring fixed buffer)
  mem::PinnedPool::Lease lease;
  char* io_buf = nullptr;
  bool device = false;  // `user` is a CUDA device address
};

struct SlotMeta {
  detail::Extent extent;
  uint64_t phase = 0;  // data starts this far into the extent (Note [Slot phase])
  uint64_t stored = 0;
  std::vector<uint32_t> crcs;
  bool writing = false;
  unsigned readers = 0;
  bool free_pending = false;
  ReqPtr pending_write;
};


}  // namespace detail

struct Engine::Impl {
  using Chunk = detail::Chunk;
  using Device = detail::Device;
  using SlotMeta = detail::SlotMeta;
  using ReqPtr = detail::ReqPtr;

  EngineOptions opt;
  BackendKind kind = BackendKind::kPosix;
  std::vector<std::unique_ptr<DirectFile>> slabs;
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> slab_device;
  std::unique_ptr<mem::PinnedPool> staging;
  std::atomic<bool> staging_pin_tried{false};
  // The driver of device buffers (EngineOptions::cuda_driver, else the process's).
  mem::cuda::Driver* cuda() const { return opt.cuda_driver != nullptr ? opt.cuda_driver : mem::cuda::driver(); }
  std::mutex cufile_mu;
  std::vector<mem::cufile::Handle> cufile_handles;  // per slab, 0 = not registered
  std::atomic<bool> cufile_off{false};
  std::atomic<uint64_t> bytes_staged{0};  // host bytes that went through staging (stats)
  uint64_t align = 4096;      // slot alignment
  uint64_t dio_align = 0;     // largest O_DIRECT offset alignment (stats)
  uint64_t io_align = 0;      // largest O_DIRECT memory/offset alignment; 0: no direct slab
  uint64_t slab_limit = 0;    // per slab, 0 = none
  uint64_t grow_step = 0;
  uint64_t slab_size = 0;     // every slab holds at least this much
  bool all_direct = true;

  mutable std::mutex mu;
  std::condition_variable drain_cv;
  detail::SlotAllocator alloc{4096};
  std::unordered_map<SlotId, SlotMeta> slots;
  SlotId next_slot = 1;
  bool closing = false, closed = false;
  EngineStats st;

  explicit Impl(EngineOptions o);
  ~Impl();
  void shutdown();

  // Striping (striping.cpp).
  struct StripePos {
    size_t slab;           // index into slabs
    uint64_t file_offset;  // in that slab
  };
  StripePos stripe_pos(uint64_t logical) const;
  void grow_for(uint64_t nbytes);
  std::vector<Chunk*> split(const ReqPtr& req, uint64_t base) const;

  ReqPtr submit(SlotId slot, const mem::Buffer& b, Callback cb, bool write);
  void run_device(Device& d);
  enum class Start { kSubmitted, kDone, kNoStaging };
  Start start(Device& d, Chunk* c);
  static void pad_staging(Chunk* c) {  // zero what the staged block holds besides the data
    std::memset(c->io_buf, 0, c->delta);
    std::memset(c->io_buf + c->delta + c->len, 0, c->io_len - c->delta - c->len);
  }
  void copy_device(Chunk* c, bool to_device);
  bool try_cufile(Chunk* c);
  void on_transferred(Chunk* c, std::exception_ptr err);
  void complete_chunk(Chunk* c, std::exception_ptr err);
  void finalize(const ReqPtr& req);
  void release_slot(std::unordered_map<SlotId, SlotMeta>::iterator it);
  bool cancel(const ReqPtr& req);
  std::string describe() const;
};

}  // namespace ebbtide::io
