// Internal: opening checkpoint files as io::DirectFiles, and helpers around
// the io::TransferLoop transfers of the checkpoint writer and reader.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ebbtide/io/direct_file.hpp"
#include "ebbtide/io/transfer.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::ckpt::detail {

// Opens a checkpoint file: created (O_EXCL) for writing, or a regular file
// for reading (Note [Regular files only] in io/direct_file.cpp); O_DIRECT
// when asked for and the device's alignment fits the format's 4 KiB blocks.
// IoError naming the path and `what` the file is.
std::unique_ptr<io::DirectFile> open_shard(const std::string& path, bool write, bool want_direct,
                                           const char* what = "checkpoint shard");
// Switches an open checkpoint file to O_DIRECT under the same rule.
void enable_direct(io::DirectFile& file);

// Faults in the pages of `ranges` (page-aligned destinations of reads in
// place), in order, on a thread of its own while the reads run (Note
// [Populate ahead] in shard_io.cpp); stops and joins on destruction. The
// ranges must stay mapped until then.
class PagePopulator {
 public:
  explicit PagePopulator(std::vector<std::pair<char*, uint64_t>> ranges);
  ~PagePopulator();
  PagePopulator(const PagePopulator&) = delete;
  PagePopulator& operator=(const PagePopulator&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The CUDA driver for device memory that `what` names (e.g. "tensor 'w' is
// in CUDA device memory"): `given` (a test's simulated one), else the
// process's; InvalidArgument naming it and the reason when none is usable.
template <class... What>
mem::cuda::Driver* device_driver(mem::cuda::Driver* given, const What&... what) {
  if (given != nullptr) return given;
  mem::cuda::Driver* drv = mem::cuda::driver();
  EBB_CHECK(drv != nullptr, what..., " but no CUDA driver is usable: ", mem::cuda::unavailable_reason());
  return drv;
}

// Note [Pinning context]
// Page-locking (cuMemHostRegister) acts in the calling thread's current
// context, and the threads that pin checkpoint memory (the caller of a save
// or load, a background snapshot thread) may have none, or another device's:
// pinning there would make device 0's primary context current, a stray
// context (hundreds of MB) on a GPU the process may not even use. So every
// checkpoint path pins with the context of a device its copies serve bound
// (bind_context_of that device's memory), and restores the caller's after.
// Registrations are PORTABLE: pinned once, the memory serves copies on every
// device. The memory is unregistered in the context that registered it
// (HostMapping).

// Restores the calling thread's CUDA context on scope exit (Note [Caller's
// context] in cache/tensor_cache.cpp): take() notes it before the first
// device call binds another; inert when nothing was taken.
class CallerContext {
 public:
  CallerContext() = default;
  ~CallerContext() {
    if (drv_ == nullptr) return;
    try {
      drv_->set_current_context(ctx_);
    } catch (...) {  // the error in flight, if any, is the one to report
    }
  }
  CallerContext(const CallerContext&) = delete;
  CallerContext& operator=(const CallerContext&) = delete;
  void take(mem::cuda::Driver* drv) {
    if (drv_ != nullptr) return;
    drv_ = drv;
    ctx_ = drv->current_context();
  }

 private:
  mem::cuda::Driver* drv_ = nullptr;
  mem::cuda::Context ctx_ = 0;
};

// Page-locks borrowed staging `pool` when device memory is copied to or
// from it (`device`, the driver copying, non-null) for asynchronous copies,
// with the process-wide driver only: a given driver (`given`, a test's) is
// not used, as the pool may outlive it in the idle cache (Note [Reused
// staging]). `served` is device memory the copies serve (null: none,
// nothing to pin for): its device's context is bound while pinning (Note
// [Pinning context]). Unlocked, the copies stay correct, only slower.
inline void lock_staging(mem::PinnedPool& pool, mem::cuda::Driver* device, const mem::cuda::Driver* given,
                         const void* served) {
  if (device == nullptr || given != nullptr || served == nullptr || pool.registered()) return;
  CallerContext caller;
  caller.take(device);
  device->bind_context_of(reinterpret_cast<mem::cuda::DevicePtr>(served));
  pool.ensure_registered();
}

// Streams that copies of one batch were queued on, each in the context that
// queued it: a stream handle names a stream of the current context only (0
// is each device's own default stream), so a wait is keyed by (context,
// stream) and made with that context current. synchronize() waits for each
// once; the destructor does too (errors dropped), so a batch that fails
// half-way never leaves copies running into memory about to be reused.
// Leaves the last waited-for context current: for worker threads, which bind
// before every copy. Not thread safe.
class StreamWaits {
 public:
  StreamWaits() = default;
  ~StreamWaits() {
    try {
      synchronize();
    } catch (...) {  // the error in flight is the one to report
    }
  }
  StreamWaits(const StreamWaits&) = delete;
  StreamWaits& operator=(const StreamWaits&) = delete;
  // Stream `s` of the calling thread's current context; one driver per batch.
  void add(mem::cuda::Driver* drv, mem::cuda::Stream s) {
    drv_ = drv;
    const std::pair<mem::cuda::Context, mem::cuda::Stream> key{drv->current_context(), s};
    for (const auto& k : streams_)
      if (k == key) return;
    streams_.push_back(key);
  }
  void synchronize() {
    while (!streams_.empty()) {
      const auto [ctx, s] = streams_.back();
      streams_.pop_back();
      drv_->set_current_context(ctx);
      drv_->stream_synchronize(s);
    }
  }

 private:
  mem::cuda::Driver* drv_ = nullptr;
  std::vector<std::pair<mem::cuda::Context, mem::cuda::Stream>> streams_;
};

// The buffers of `pool`, one iovec each (a TransferLoop's fixed buffers).
std::vector<iovec> buffers_of(const mem::PinnedPool& pool);

// One read of a pipelined batch: into `in_place` (the caller's memory, block
// aligned under O_DIRECT) or, when that is null, into a staging buffer.
struct PipelinedRead {
  const io::DirectFile* file;
  uint64_t offset, len;
  char* in_place;
  uint64_t need = 0;  // as TransferLoop::submit's (0: len)
};

// Note [Read pipeline] in reader.cpp. Submits read(0..n-1) in order through
// `loop`; a staged one takes a free buffer of `staging` (registered with the
// loop as its fixed buffers, one per slot; may be null when no read is
// staged), waiting while every buffer is with the kernel or the workers.
// Each finished read goes with its buffer to process(i, buf) on `threads`
// workers, and a staging buffer returns to the ring after. If read(i),
// process or the I/O throws, nothing more is submitted, what is in flight is
// drained, and the first error is rethrown.
void pipelined_reads(size_t n, const std::function<PipelinedRead(size_t)>& read, io::TransferLoop& loop,
                     mem::PinnedPool* staging, unsigned threads,
                     const std::function<void(size_t, const char*)>& process);

// Splits [offset, offset+len) of a contiguous pinned region made of equal
// segments (registered one iovec each) so that no piece crosses a segment.
struct Piece {
  uint64_t offset, len;
  int buf_index;
};
std::vector<Piece> split_by_segment(uint64_t region_offset, uint64_t len, uint64_t segment_bytes,
                                    bool registered);

}  // namespace ebbtide::ckpt::detail
