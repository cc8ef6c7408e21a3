// Internal: CheckpointWriter's Impl and what the files that implement it
// share: writer.cpp (options, handles, claims, save()), writer_arena.cpp (the
// snapshot arena and the copies into it) and writer_shard.cpp (writing one
// shard: chunks, the save ring, stripes, header and superblocks, the commit).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/host_mapping.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/util/error.hpp"
#include "reaper.hpp"
#include "shard_io.hpp"
#include "workers.hpp"

namespace ebbtide::ckpt {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

namespace detail {
struct SaveState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  SaveResult result;
  std::exception_ptr error;
  // Note [Gated commit]
  enum class Gate { kOpen, kPending, kApproved, kRejected } gate = Gate::kOpen;
  std::string reject_reason;
  bool written = false;  // every byte of the sources is written and durable (Note [Uncopied async saves])
  bool copied = false;   // the sources are read no more (SaveHandle::wait_copied())
  void mark_copied() {
    {
      std::lock_guard lock(mu);
      copied = true;
    }
    cv.notify_all();
  }

  // Blocks the writing thread until the caller approves or rejects the
  // commit; a rejection fails the save with StateError(reason).
  // Also marks the data written (wait_written()), gated or not.
  void wait_gate() {
    std::unique_lock lock(mu);
    written = true;
    cv.notify_all();
    cv.wait(lock, [&] { return gate != Gate::kPending; });
    EBB_CHECK_STATE(gate != Gate::kRejected, reject_reason);
  }
  void decide(bool approve, const std::string& why) {
    {
      std::lock_guard lock(mu);
      if (gate != Gate::kPending) return;  // decided already, or not gated
      gate = approve ? Gate::kApproved : Gate::kRejected;
      reject_reason = why;
    }
    cv.notify_all();
  }
};
}  // namespace detail

constexpr uint64_t kSegmentBytes = 64ull << 20;  // arena segment = one registered io buffer

// Bytes [off, off + n) of blob `b` as stored: head, then b.data, then tail
// (Note [Framed blobs]). The range must lie within stored_nbytes(). With
// `crc`, their crc32c is accumulated: of host bytes from the source, which
// the copy has just read into cache (its streamed destination is not); of
// device bytes (copied with `drv` on the blob's stream, which is waited for)
// from the destination.
void copy_stored(const BlobSource& b, uint64_t off, uint64_t n, char* dst, uint32_t* crc = nullptr,
                 mem::cuda::Driver* drv = nullptr);

struct BlobPlan {
  uint64_t arena_offset = 0;
};

struct ChunkJob {
  uint32_t blob = 0;
  uint64_t arena_offset = 0;
  uint64_t raw_offset = 0;
  uint32_t raw = 0;
  Codec codec = Codec::kNone;
  uint16_t elem = 1;
  uint16_t stripe = 0;
  const BlobSource* src = nullptr;  // pipelined: the blob the job copies its range of into the arena
  uint32_t pad = 0;           // pipelined: zero bytes after the blob's last chunk
  uint64_t ring_pos = 0;      // pipelined: position in the ring's unwrapped sequence (Note [Save ring])
  // results
  uint32_t stored = 0;
  uint32_t crc = 0;
  Codec used = Codec::kNone;
  bool ready = false;
  std::exception_ptr error;
};

struct CheckpointWriter::Impl {
  WriterOptions opt;
  detail::Workers workers;
  mem::HostMapping arena;                    // snapshot image, whole segments
  std::atomic<uint64_t> arena_bytes{0};      // arena.size(), read without mu (snapshot_capacity())
  std::unique_ptr<mem::PinnedPool> staging;  // compressed chunk ring
  std::unique_ptr<io::TransferLoop> loop;
  unsigned loop_depth = 0;
  bool loop_has_arena = false;  // the arena's segments are registered buffers of `loop`
  bool arena_used = false;      // a save has written from this arena (Note [Fresh arena])
  mem::cuda::Driver* ring_driver = nullptr;  // a pipelined save's device copies (Note [Save ring])
  std::mutex mu;
  std::thread bg;
  std::shared_ptr<detail::SaveState> inflight;
  std::string replaced;  // previous checkpoint directory, removed after the save is done
  std::string inflight_file;
  bool claimed = false;  // claim(): the next save() is reserved
  std::condition_variable claim_cv;
  detail::Reaper reaper;  // Note [Deferred removal]
  mutable std::mutex staging_mu;  // staging_buf (replaced by reserve_staging) and its page-locking
  StagingBuffer staging_buf;      // Note [Staging buffer]
  std::mutex excp_mu;                      // excp_scratch: one encode at a time
  std::vector<excp::Scratch> excp_scratch;  // the encoder's working memory per runner, kept across tensors

  explicit Impl(const WriterOptions& o)
      : opt(o), workers(o.threads ? o.threads : detail::default_threads()) {}

  uint64_t staging_buffer_bytes() const { return align_up(compress_bound(opt.chunk_bytes), kBlockBytes); }
  unsigned staging_count() const { return std::max(2u, 2 * workers.size()); }

  uint64_t arena_segments() const { return arena.size() / kSegmentBytes; }

  // The driver for device blob `b`: the options' or the process's.
  mem::cuda::Driver* need_driver(const BlobSource& b) const {
    return detail::device_driver(opt.cuda_driver, "blob '", b.name, "' is in CUDA device memory");
  }

  // Note [Save ring]: bytes a pipelined save of `req` copies through.
  uint64_t ring_bytes(const SaveRequest& req) const {
    const uint64_t chunk = opt.chunk_bytes;
    if (opt.ring_bytes != 0) return align_up(std::max(opt.ring_bytes, 2 * chunk), kBlockBytes);
    const uint64_t in_flight = uint64_t{opt.queue_depth} * (1 + req.stripe_files.size()) * chunk;
    return std::max<uint64_t>(64ull << 20, 2 * in_flight);
  }

  void join_bg() {
    if (bg.joinable()) bg.join();
  }

  bool writing() const {  // mu held
    if (!inflight) return false;
    std::lock_guard l(inflight->mu);
    return !inflight->done;
  }

  // Copies every blob into the arena; returns the arena offset of each.
  static bool can_pipeline(const SaveRequest& req) {
    if (!req.pipelined) return false;
    for (const auto& b : req.blobs)
      if (b.codec != Codec::kNone) return false;
    return true;
  }

  // In writer_arena.cpp (Notes [Arena pages], [First async save], [Fresh arena]):
  void ensure_arena(uint64_t bytes, uint64_t huge_bytes);
  void reserve(uint64_t bytes, uint64_t huge_bytes);
  void copy_host(const std::vector<HostCopy>& copies);
  void stage(const std::vector<StageCopy>& copies);
  std::vector<BlobPlan> snapshot(const SaveRequest& req, bool copy);
  void ensure_loop(unsigned depth, bool with_arena);
  // In writer.cpp:
  void await_idle(std::unique_lock<std::mutex>& lock, bool block);
  // In writer_shard.cpp (Notes [Pipelined save], [Save ring], [Striping]):
  struct ShardWrite;
  SaveResult write(const SaveRequest& req, const std::vector<BlobPlan>& plan, bool pipelined,
                   detail::SaveState& state);
};

}  // namespace ebbtide::ckpt
