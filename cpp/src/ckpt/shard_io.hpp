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

// Page-locks borrowed staging `pool` when device memory is copied to or
// from it (`device`, the driver copying, non-null) for asynchronous copies,
// with the process-wide driver only: a given driver (`given`, a test's) is
// not used, as the pool may outlive it in the idle cache (Note [Reused
// staging]). Unlocked, the copies stay correct, only slower.
inline void lock_staging(mem::PinnedPool& pool, const mem::cuda::Driver* device, const mem::cuda::Driver* given) {
  if (device != nullptr && given == nullptr) pool.ensure_registered();
}

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
