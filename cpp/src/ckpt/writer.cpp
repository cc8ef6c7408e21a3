// Note [Save pipeline]
// save() runs on the caller's thread only until every blob is copied into the
// snapshot arena: one mem::HostMapping (CUDA-registered when a save has
// device blobs, kept and reused across saves, grown in 64 MiB segments when a
// state outgrows it; each segment is one registered io buffer) laid out as
// the shard's data image, each blob at a 4 KiB boundary with zeroed padding.
// Host blobs are copied by the worker threads, device blobs with
// cuMemcpyDtoHAsync on their stream. Then a background thread writes:
//  - raw chunks straight from the arena (adjacent ones coalesced into one
//    O_DIRECT write), their crc32c computed by the workers (all raw chunks
//    queued in order at the start, consumed in order);
//  - compressed chunks through a ring of pinned staging buffers: worker
//    threads compress chunk i into buffer i % N while the ring writes the
//    earlier ones (N >= 2: double buffering), in chunk order, each padded to
//    4 KiB;
//  - the header after the data, fdatasync, the superblock last, fdatasync;
//  - with a commit target: the extra files, fsync and the atomic rename.
// A failure anywhere leaves the temporary directory, never the target.
//
// Note [Pipelined save]
// A synchronous save (the caller waits anyway and keeps its memory unchanged)
// need not finish the snapshot before writing: the workers copy chunk k into
// the arena (and checksum it while the bytes are in cache) while chunk k-1 is
// being written, so the save costs about max(copy, write) instead of the sum.
// Only blobs without compression (host or device); others take the path above.
//
// Note [Save ring]
// A pipelined save copies through a ring, not a copy of the whole state: the
// arena is used as a ring of EBBTIDE_CKPT_RING bytes (default max(64 MiB, two
// chunks per write in flight)). The submitting thread places chunk after
// chunk in the ring, each at the next 4 KiB-aligned position (never across
// the ring's end: a chunk that does not fit before it starts again at 0), so
// small blobs stay contiguous and their writes coalesce as before. A chunk is
// placed, and its copy posted, only when the bytes it covers are free: every
// write of the chunks before it in the ring has completed (`written`, set by
// the writes' completions on the submitting thread; the tail is the first
// chunk not yet written). It places chunks ahead until the ring is full, and
// waits for writes only when the chunk it is about to submit has no room.
// So a synchronous save of any size holds one ring, and its first save no
// longer faults in a state-sized arena (on the 2-core VM, fresh memory costs
// 0.3-2.6 s per GB). Device blobs go the same way: a worker copies its
// chunk's device bytes with cuMemcpyDtoHAsync on the blob's stream into the
// ring (page-locked then: 64 MiB, not the state) and waits for that stream
// before the crc, so a synchronous save of GPU state neither page-locks a
// state-sized buffer nor waits for all of it to reach the host before the
// first write. Saves that snapshot first (async, compression) still need the
// whole state in the arena, which grows for them.
//
// Note [Gated commit]
// A request with `gated` writes and syncs everything, then waits before the
// commit (and before done()) until the caller calls approve() or reject() on
// the handle. checkpoint.py uses it for background snapshots
// (snapshot="background"): the snapshot runs on a Python thread, which checks
// that no tensor changed while it was copied (version counters) and only then
// approves; a change rejects the save and nothing is committed. The
// writer's destructor rejects a save still waiting.
//
// Note [Framed blobs]
// A blob may carry `head` and `tail` bytes that are stored around its data,
// contiguously, as one blob: the DCP storage plugin (python/ebbtide/dcp.py)
// frames each tensor's storage with the bytes torch.save writes around it, so
// that an uncompressed item is a torch.load-able byte range of the shard file
// (Note [DCP layout] there). The write path sees ordinary blobs of
// stored_nbytes(); copy_stored() gathers any byte range of that stored form
// from head, data and tail, so a framed blob is snapshotted or pipelined like
// any other (a chunk may begin in the head or end in the tail).
//
// Note [Striping]
// With stripe files, chunk i goes to file i % (1 + stripes) (file 0 is the
// shard file), each file with its own cursor, all written through one ring
// with depth x files in flight. The chunk table's `stripe` field says where a
// chunk lives. Stripe files have a superblock (flag kFlagStripeFile, their
// stripe number and size) and no header; they are made durable, with their
// directories, before the shard file's superblock, which is written last.
// Atomicity across directories comes from the caller (SaveTransaction in
// transaction.hpp): stripe files live in directories named by the checkpoint
// id that nothing refers to until the index directory is committed by rename.
#include "ebbtide/ckpt/writer.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>
#include <utility>

#include <sys/mman.h>

#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/ckpt/transaction.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/host_mapping.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/mem/stream_copy.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
#include "reaper.hpp"
#include "shard_io.hpp"
#include "workers.hpp"

namespace ebbtide::ckpt {

using Clock = std::chrono::steady_clock;
static double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

WriterOptions WriterOptions::with_env() const {
  WriterOptions o = *this;
  if (auto v = config::env_bytes("EBBTIDE_CKPT_CHUNK")) o.chunk_bytes = *v;
  if (auto v = config::env_int("EBBTIDE_CKPT_QUEUE_DEPTH")) o.queue_depth = static_cast<unsigned>(*v);
  if (auto v = config::env_int("EBBTIDE_CKPT_THREADS")) o.threads = static_cast<unsigned>(*v);
  if (auto v = config::env_int("EBBTIDE_CKPT_ZSTD_LEVEL")) o.zstd_level = static_cast<int>(*v);
  if (auto v = config::env_bool("EBBTIDE_CKPT_DIRECT")) o.direct = *v;
  if (auto v = config::env_bytes("EBBTIDE_CKPT_RING")) o.ring_bytes = *v;
  io::EngineOptions eo;
  eo.backend = o.backend;
  o.backend = eo.with_env().backend;
  EBB_CHECK(o.chunk_bytes >= kBlockBytes && o.chunk_bytes % kBlockBytes == 0 && o.chunk_bytes <= (1ull << 30),
            "EBBTIDE_CKPT_CHUNK / chunk_bytes ", o.chunk_bytes, " must be a multiple of 4 KiB between 4 KiB and 1 GiB");
  return o;
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

void SaveHandle::approve() const {
  EBB_CHECK_STATE(s_, "SaveHandle is empty");
  s_->decide(true, "");
}

void SaveHandle::reject(const std::string& why) const {
  EBB_CHECK_STATE(s_, "SaveHandle is empty");
  s_->decide(false, why.empty() ? std::string("the checkpoint save was rejected before its commit") : why);
}

void SaveHandle::wait_written() const {
  EBB_CHECK_STATE(s_, "SaveHandle is empty");
  std::unique_lock lock(s_->mu);
  s_->cv.wait(lock, [&] { return s_->written || s_->done; });
}

bool SaveHandle::done() const {
  EBB_CHECK_STATE(s_, "SaveHandle is empty");
  std::lock_guard lock(s_->mu);
  return s_->done;
}

SaveResult SaveHandle::wait() const {
  EBB_CHECK_STATE(s_, "SaveHandle is empty");
  std::unique_lock lock(s_->mu);
  s_->cv.wait(lock, [&] { return s_->done; });
  if (s_->error) std::rethrow_exception(s_->error);
  return s_->result;
}

namespace {
constexpr uint64_t kSegmentBytes = 64ull << 20;  // arena segment = one registered io buffer

// Bytes [off, off + n) of blob `b` as stored: head, then b.data, then tail
// (Note [Framed blobs]). The range must lie within stored_nbytes(). With
// `crc`, their crc32c is accumulated: of host bytes from the source, which
// the copy has just read into cache (its streamed destination is not); of
// device bytes (copied with `drv` on the blob's stream, which is waited for)
// from the destination.
void copy_stored(const BlobSource& b, uint64_t off, uint64_t n, char* dst, uint32_t* crc = nullptr,
                 mem::cuda::Driver* drv = nullptr) {
  struct Part {
    const char* src;
    uint64_t len;
    bool device;
  };
  const Part parts[] = {{b.head.data(), b.head.size(), false},
                        {static_cast<const char*>(b.data.ptr), b.data.nbytes, b.data.on_device()},
                        {b.tail.data(), b.tail.size(), false}};
  uint64_t start = 0;
  for (const auto& [src, len, device] : parts) {
    const uint64_t lo = std::max(off, start), hi = std::min(off + n, start + len);
    if (lo < hi && device) {
      const auto dev = reinterpret_cast<mem::cuda::DevicePtr>(src) + (lo - start);
      drv->bind_context_of(dev);
      drv->memcpy_dtoh_async(dst + (lo - off), dev, hi - lo, b.data.stream);
      drv->stream_synchronize(b.data.stream);
      if (crc != nullptr) *crc = crc32c(dst + (lo - off), hi - lo, *crc);
    } else if (lo < hi) {
      mem::stream_copy(dst + (lo - off), src + (lo - start), hi - lo);  // read back only by the disk
      if (crc != nullptr) *crc = crc32c(src + (lo - start), hi - lo, *crc);
    }
    start += len;
  }
}

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
}  // namespace

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

  // Note [Arena pages]
  // The arena's first `huge_bytes` (the ring a synchronous save writes
  // through, Note [Save ring]) are advised onto 2 MiB pages: this VM's
  // virtio-blk takes a write from huge pages in far fewer pieces (1.15x
  // faster steady saves). The rest, which only saves that snapshot first
  // (async ones) touch, stays on 4 KiB pages: the async save's caller faults
  // it in during the copy, and with MADV_HUGEPAGE (defrag=madvise: direct
  // compaction in the fault) a fresh 1.3 GB took 2.2-3.2 s there against
  // 0.3-0.4 s on small pages, which made the first async save in a process
  // block 3x as long as a synchronous one. Its writes run in the background.
  void ensure_arena(uint64_t bytes, uint64_t huge_bytes) {
    uint64_t segs = std::max<uint64_t>(1, (bytes + kSegmentBytes - 1) / kSegmentBytes);
    if (arena && arena_segments() >= segs) return;
    loop.reset();  // its registered buffers are the old arena's
    arena = mem::HostMapping();  // unmapped before the larger one is mapped
    arena_used = false;
    // Registered with CUDA only when a save has device blobs (snapshot()):
    // CPU-only checkpoints never initialise CUDA. The compressed-chunk ring is
    // filled from the arena, never by device copies.
    arena_bytes = 0;
    arena = mem::HostMapping(segs * kSegmentBytes, "checkpoint snapshot arena", false, /*huge=*/true);
    arena_bytes = arena.size();
    const uint64_t huge = align_up(std::max<uint64_t>(huge_bytes, 1), kSegmentBytes);
    if (arena.size() > huge)  // advice only (Note [Arena pages])
      (void)::madvise(static_cast<char*>(arena.data()) + huge, arena.size() - huge, MADV_NOHUGEPAGE);
    mem::PinnedPoolOptions host_only;
    host_only.cuda_register = false;
    if (!staging) staging = std::make_unique<mem::PinnedPool>(staging_buffer_bytes(), staging_count(), host_only);
  }

  // Note [First async save]
  // An async save snapshots the whole state into the arena, and the first
  // one in a process finds no arena of that size: its caller would fault in
  // a state's worth of fresh memory inside the copy (on the 2-core VM,
  // 0.3-2.6 s per GB: the hypervisor backs each new page), which made it
  // block 3x as long as a synchronous save. So checkpoint.py saves an async
  // request the arena cannot hold as a pipelined one (through the ring, as
  // a synchronous save does) and returns once its sources are written
  // (SaveHandle::wait_written()); its `reserve_arena` then has this thread,
  // after the save is done, grow the arena to the state's size and fault it
  // in (MADV_POPULATE_WRITE), off the caller's path. The next async save
  // copies into present memory. A later save waits for the growth to end
  // (join_bg()), as it waits for any earlier save's thread.
  void reserve(uint64_t bytes, uint64_t huge_bytes) {
    ensure_arena(bytes, huge_bytes);
    if (::madvise(arena.data(), arena.size(), MADV_POPULATE_WRITE) != 0) {  // Linux 5.14+; else: touch
      auto* p = static_cast<volatile char*>(arena.data());
      for (uint64_t o = 0; o < arena.size(); o += 4096) p[o] = 0;
    }
    arena_used = false;
  }

  void join_bg() {
    if (bg.joinable()) bg.join();
  }

  // Host copies in pieces of <= 8 MiB over the workers, with mem::stream_copy's
  // streaming stores.
  void copy_host(const std::vector<HostCopy>& copies) {
    struct Piece {
      const char* src;
      char* dst;
      uint64_t n;
    };
    std::vector<Piece> pieces;
    constexpr uint64_t kPiece = 8ull << 20;
    for (const auto& c : copies)
      for (uint64_t o = 0; o < c.nbytes; o += kPiece)
        pieces.push_back({static_cast<const char*>(c.src) + o, static_cast<char*>(c.dst) + o,
                          std::min(kPiece, c.nbytes - o)});
    workers.parallel_for(pieces.size(), [&](size_t k) { mem::stream_copy(pieces[k].dst, pieces[k].src, pieces[k].n); });
  }

  bool writing() const {  // mu held
    if (!inflight) return false;
    std::lock_guard l(inflight->mu);
    return !inflight->done;
  }

  // With mu held: a save in flight (claimed, or being written) raises
  // StateError, or with `block` is waited for.
  void await_idle(std::unique_lock<std::mutex>& lock, bool block) {
    EBB_CHECK_STATE(block || (!claimed && !writing()), "a checkpoint save to ", inflight_file,
                    " is still in flight on this writer; wait() for it first or pass block=True");
    claim_cv.wait(lock, [&] { return !claimed; });
    join_bg();
  }

  // Copies every blob into the arena; returns the arena offset of each.
  static bool can_pipeline(const SaveRequest& req) {
    if (!req.pipelined) return false;
    for (const auto& b : req.blobs)
      if (b.codec != Codec::kNone) return false;
    return true;
  }

  // Copies every blob into the arena (with `copy`; else the write's workers
  // copy, Note [Pipelined save]); returns the arena offset of each.
  std::vector<BlobPlan> snapshot(const SaveRequest& req, bool copy) {
    std::vector<BlobPlan> plan(req.blobs.size());
    uint64_t off = 0;
    for (size_t i = 0; i < req.blobs.size(); ++i) {
      const auto& b = req.blobs[i];
      EBB_CHECK(b.data.ptr != nullptr || b.data.nbytes == 0, "blob '", b.name, "' has a null pointer and ", b.data.nbytes,
                " bytes");
      EBB_CHECK(b.elem_bytes > 0, "blob '", b.name, "' has element size 0");
      plan[i].arena_offset = off;
      off += align_up(b.stored_nbytes(), kBlockBytes);
    }
    ensure_arena(copy ? off : std::min(off, ring_bytes(req)), ring_bytes(req));  // Note [Save ring]
    ring_driver = nullptr;
    if (!copy) {  // the workers copy device bytes into the ring: page-locked for async copies
      for (const auto& b : req.blobs)
        if (b.data.on_device() && b.data.nbytes > 0) {
          ring_driver = need_driver(b);
          detail::CallerContext caller;  // Note [Pinning context] in shard_io.hpp
          caller.take(ring_driver);
          ring_driver->bind_context_of(reinterpret_cast<mem::cuda::DevicePtr>(b.data.ptr));
          arena.pin(ring_driver);
          break;
        }
      return plan;
    }
    auto* base = static_cast<char*>(arena.data());
    // Device copies are queued first so they run while the host copies do,
    // each with its blob's device current, and each (context, stream) is
    // waited for once after (detail::StreamWaits: handle 0 is each device's
    // own default stream). The caller's context is restored after (Note
    // [Caller's context] in tensor_cache.cpp), and on any error every queued
    // copy is waited for before the arena can be reused or unmapped.
    detail::CallerContext caller;
    detail::StreamWaits device_copies;
    for (size_t i = 0; i < req.blobs.size(); ++i) {
      const auto& b = req.blobs[i];
      if (!b.data.on_device() || b.data.nbytes == 0) continue;
      mem::cuda::Driver* drv = need_driver(b);
      caller.take(drv);
      drv->bind_context_of(reinterpret_cast<mem::cuda::DevicePtr>(b.data.ptr));
      arena.pin(drv);  // async device copies need page-locked memory (Note [Pinning context])
      drv->memcpy_dtoh_async(base + plan[i].arena_offset + b.head.size(), reinterpret_cast<mem::cuda::DevicePtr>(b.data.ptr),
                             b.data.nbytes, b.data.stream);
      device_copies.add(drv, b.data.stream);
    }
    std::vector<HostCopy> host;
    for (size_t i = 0; i < req.blobs.size(); ++i) {
      const auto& b = req.blobs[i];
      char* dst = base + plan[i].arena_offset;
      const uint64_t stored = b.stored_nbytes(), padded = align_up(stored, kBlockBytes);
      if (padded > stored) std::memset(dst + stored, 0, padded - stored);
      copy_stored(b, 0, b.head.size(), dst);  // Note [Framed blobs]
      copy_stored(b, b.head.size() + b.data.nbytes, b.tail.size(), dst + b.head.size() + b.data.nbytes);
      dst += b.head.size();
      if (!b.data.on_device()) host.push_back({dst, b.data.ptr, b.data.nbytes});
    }
    copy_host(host);
    device_copies.synchronize();
    return plan;
  }

  // Note [Fresh arena]
  // Registering buffers with io_uring pins them, and pinning faults in every
  // page on the calling thread before the first write can start: for a fresh
  // 1 GB arena on huge pages that was 2.3 s of a 2.8 s first save on the
  // 2-core VM (strace). So a pipelined save from an arena no save has written
  // from yet submits its arena writes unregistered: the workers' copies fault
  // the pages in, chunk by chunk, beside the writes. The next save registers
  // the arena, whose pages are then present (and pin in milliseconds). Saves
  // that snapshot first (async ones) have touched their part of the arena
  // before the write starts, so they register at once.
  void ensure_loop(unsigned depth, bool with_arena) {
    if (loop && loop_depth == depth && loop_has_arena == with_arena) return;
    loop.reset();
    std::vector<iovec> fixed;
    auto* base = static_cast<char*>(arena.data());
    if (with_arena)
      for (uint64_t i = 0; i < arena_segments(); ++i) fixed.push_back({base + i * kSegmentBytes, kSegmentBytes});
    for (const iovec& b : detail::buffers_of(*staging)) fixed.push_back(b);
    loop = std::make_unique<io::TransferLoop>(depth, fixed, opt.backend, "checkpoint");
    loop_depth = depth;
    loop_has_arena = with_arena;
  }

  // One shard being written (Note [Save pipeline]): its files and their
  // cursors, the chunk jobs and the header's chunk table, the raw runs being
  // coalesced and the ring of staging buffers. Worker tasks reference it, so
  // the destructor waits for every task posted.
  struct ShardWrite {
    // Adjacent raw chunks coalesced into one write (contiguous in arena and file).
    struct Run {
      uint64_t arena = 0, len = 0, file = 0;
      size_t first_job = 0, last_job = 0;  // the run's chunks, consecutive
    };

    Impl& w;
    const SaveRequest& req;
    const size_t nfiles;
    std::vector<std::unique_ptr<io::DirectFile>> files;
    Header h;
    std::vector<ChunkJob> jobs;
    char* const abase;
    const uint64_t arena_segs;
    const size_t nstage;
    const uint64_t sbytes;
    char* const sbase;
    std::mutex jmu;
    std::condition_variable jcv;
    size_t posted = 0, finished = 0;  // worker tasks referencing this write
    std::vector<int> stage_busy;      // 1 while a write from the staging buffer is in flight
    std::vector<uint64_t> cursor;     // next data offset, per file
    std::vector<Run> runs;            // one per file
    size_t next_dispatch = 0;         // next chunk to hand to a compression worker
    // Note [Save ring] (pipelined saves)
    bool ring = false;
    uint64_t ring_cap = 0;
    uint64_t ring_head = 0;        // where the next chunk may start, unwrapped
    size_t next_ring = 0;          // next chunk to place in the ring
    size_t ring_tail = 0;          // first chunk whose write has not completed
    std::vector<uint8_t> written;  // per chunk: its write completed
    uint64_t stored_total = 0;
    std::string hdr;
    uint64_t hdr_off = 0, file_bytes = 0, total_file_bytes = 0;

    // Creates the shard file and the stripe files; the caller has set up the
    // transfer loop (ensure_loop).
    ShardWrite(Impl& impl, const SaveRequest& r)
        : w(impl),
          req(r),
          nfiles(1 + r.stripe_files.size()),
          abase(static_cast<char*>(impl.arena.data())),
          arena_segs(impl.loop_has_arena ? impl.arena_segments() : 0),
          nstage(impl.staging->count()),
          sbytes(impl.staging->buffer_bytes()),
          sbase(static_cast<char*>(impl.staging->base())),
          stage_busy(nstage, 0),
          cursor(nfiles, kDataStart),
          runs(nfiles) {
      files.push_back(detail::open_shard(req.file, true, w.opt.direct));
      for (const auto& f : req.stripe_files) files.push_back(detail::open_shard(f, true, w.opt.direct));
      h.meta = req.meta;
    }
    ShardWrite(const ShardWrite&) = delete;
    ShardWrite& operator=(const ShardWrite&) = delete;
    ~ShardWrite() {
      std::unique_lock lock(jmu);
      jcv.wait(lock, [&] { return finished == posted; });
    }

    // Splits every blob into chunk jobs, round-robin over the files, and
    // enters the blobs in the header.
    void plan_chunks(const std::vector<BlobPlan>& plan, bool pipelined) {
      for (uint32_t i = 0; i < req.blobs.size(); ++i) {
        const auto& b = req.blobs[i];
        const uint64_t nbytes = b.stored_nbytes();
        BlobEntry be{b.name, nbytes, static_cast<uint32_t>(jobs.size()), 0, b.codec, b.elem_bytes};
        for (uint64_t o = 0; o < nbytes; o += w.opt.chunk_bytes) {
          ChunkJob j;
          j.blob = i;
          j.arena_offset = plan[i].arena_offset + o;
          j.raw_offset = o;
          j.raw = static_cast<uint32_t>(std::min<uint64_t>(w.opt.chunk_bytes, nbytes - o));
          j.codec = b.codec;
          j.elem = b.elem_bytes;
          j.stripe = static_cast<uint16_t>(jobs.size() % nfiles);
          if (pipelined) {
            j.src = &b;
            j.pad = o + j.raw == nbytes ? static_cast<uint32_t>(align_up(j.raw, kBlockBytes) - j.raw) : 0;
          }
          jobs.push_back(j);
        }
        be.chunk_count = static_cast<uint32_t>(jobs.size()) - be.first_chunk;
        h.blobs.push_back(std::move(be));
      }
      h.chunks.resize(jobs.size());
      ring = pipelined;
      ring_cap = pipelined ? std::min<uint64_t>(w.arena.size(), w.ring_bytes(req)) : 0;
      written.assign(pipelined ? jobs.size() : 0, 0);
    }

    void finish_job(ChunkJob* j) {
      std::lock_guard lock(jmu);
      j->ready = true;
      ++finished;
      jcv.notify_all();
    }

    void post(std::function<void()> fn) {
      {
        std::lock_guard lock(jmu);
        ++posted;
      }
      w.workers.post(std::move(fn));
    }

    // Raw chunks of a snapshot: crc32c on the workers, all queued up front in
    // chunk order; submit_chunks consumes them in the same order. Pipelined
    // saves post theirs as they find room in the ring (place_in_ring).
    void post_raw_checksums() {
      if (ring) return;
      for (auto& j : jobs)
        if (j.codec == Codec::kNone) post_raw(&j);
    }

    // Copy (pipelined) and crc32c of one raw chunk on a worker.
    void post_raw(ChunkJob* jp) {
      post([this, jp, abase = abase, drv = w.ring_driver] {
        char* dst = abase + jp->arena_offset;
        try {
          if (jp->src != nullptr) {
            // Copy and checksum in cache-sized pieces: the crc reads the source bytes still in cache.
            // Device bytes: one copy (and one wait for the stream) per chunk.
            const uint64_t step = jp->src->data.on_device() ? jp->raw : uint64_t{256} << 10;
            uint32_t crc = 0;
            for (uint64_t o = 0; o < jp->raw; o += step)
              copy_stored(*jp->src, jp->raw_offset + o, std::min<uint64_t>(step, jp->raw - o), dst + o, &crc, drv);
            if (jp->pad) std::memset(dst + jp->raw, 0, jp->pad);
            jp->crc = crc;
          } else {
            jp->crc = crc32c(dst, jp->raw);
          }
        } catch (...) {
          jp->error = std::current_exception();
        }
        finish_job(jp);
      });
    }

    // Note [Save ring]: places chunks in the ring from next_ring on and posts
    // their copies while there is room; waits for writes only while chunk
    // `need` (the next to submit; every earlier one is submitted) has none.
    void place_in_ring(size_t need) {
      while (next_ring < jobs.size()) {
        ChunkJob& j = jobs[next_ring];
        const uint64_t len = align_up(j.raw, kBlockBytes);
        uint64_t pos = ring_head;
        if (pos % ring_cap + len > ring_cap) pos = (pos / ring_cap + 1) * ring_cap;  // starts again at 0
        while (ring_tail < next_ring && written[ring_tail]) ++ring_tail;
        const uint64_t tail = ring_tail < next_ring ? jobs[ring_tail].ring_pos : pos;
        if (pos + len - tail > ring_cap) {
          if (next_ring > need) return;  // copies are ahead of the writes
          flush_runs();
          w.loop->poll(true);  // a write in flight completes (or its error is thrown)
          continue;
        }
        j.ring_pos = pos;
        j.arena_offset = pos % ring_cap;
        ring_head = pos + len;
        post_raw(&j);
        ++next_ring;
      }
    }

    void flush_run(size_t f) {
      Run& r = runs[f];
      if (r.len == 0) return;
      const auto pieces = detail::split_by_segment(r.arena, r.len, kSegmentBytes, w.loop_has_arena);
      std::function<void()> done;
      if (ring) {  // the run's chunks free their ring bytes once all its pieces are written
        done = [this, left = std::make_shared<size_t>(pieces.size()), first = r.first_job, last = r.last_job] {
          if (--*left == 0) std::fill(written.begin() + first, written.begin() + last + 1, 1);
        };
      }
      for (const auto& p : pieces)
        w.loop->submit(*files[f], true, abase + p.offset, p.len, r.file + (p.offset - r.arena), p.buf_index, done);
      r.len = 0;
    }

    void flush_runs() {
      for (size_t f = 0; f < nfiles; ++f) flush_run(f);
    }

    void submit_raw(size_t f, size_t job, uint64_t aoff, uint64_t len) {
      Run& r = runs[f];
      if (r.len > 0 && (r.arena + r.len != aoff || cursor[f] != r.file + r.len || r.len >= w.opt.chunk_bytes ||
                        job != r.last_job + 1))
        flush_run(f);
      if (r.len == 0) {
        r.arena = aoff;
        r.file = cursor[f];
        r.first_job = job;
      }
      r.last_job = job;
      r.len += len;
    }

    // Compresses chunk i on a worker into staging buffer i % nstage.
    void dispatch_compression(size_t i) {
      ChunkJob* j = &jobs[i];
      char* out = sbase + (i % nstage) * sbytes;
      const char* in = abase + j->arena_offset;
      uint64_t bound = sbytes;
      int level = w.opt.zstd_level;
      post([this, j, out, in, bound, level, chunk = w.opt.chunk_bytes] {
        thread_local std::vector<char> scratch;
        if (scratch.size() < chunk) scratch.resize(chunk);
        try {
          size_t n = compress_chunk(j->codec, j->elem, level, in, j->raw, out, bound, scratch.data());
          if (n == 0) {
            j->used = Codec::kNone;
            j->stored = j->raw;
            j->crc = crc32c(in, j->raw);
          } else {
            j->used = j->codec;
            j->stored = static_cast<uint32_t>(n);
            j->crc = crc32c(out, n);
            uint64_t pad = align_up(n, kBlockBytes) - n;
            if (pad) std::memset(out + n, 0, pad);
          }
        } catch (...) {
          j->error = std::current_exception();
        }
        finish_job(j);
      });
    }

    // Keeps the ring full: chunk k may use buffer k % nstage once the write from it is done.
    void fill_compression_ring(size_t i) {
      while (next_dispatch < jobs.size() && next_dispatch < i + nstage) {
        if (jobs[next_dispatch].codec == Codec::kNone) {
          ++next_dispatch;
          continue;
        }
        if (stage_busy[next_dispatch % nstage]) {
          flush_runs();
          w.loop->poll(true);
          continue;
        }
        dispatch_compression(next_dispatch++);
      }
    }

    void wait_until_ready(ChunkJob& j) {
      std::unique_lock lock(jmu);
      if (j.ready) return;
      lock.unlock();
      flush_runs();  // the disk works while we wait for the workers
      w.loop->poll(false);
      lock.lock();
      jcv.wait(lock, [&] { return j.ready; });
    }

    // Enters chunk i (ready) in the chunk table and submits its write.
    void submit_chunk(size_t i) {
      ChunkJob& j = jobs[i];
      const size_t f = j.stripe;
      ChunkEntry& ce = h.chunks[i];
      ce.raw_offset = j.raw_offset;
      ce.raw_bytes = j.raw;
      ce.blob = j.blob;
      ce.stripe = j.stripe;
      ce.file_offset = cursor[f];
      if (j.codec == Codec::kNone || j.used == Codec::kNone) {
        ce.codec = Codec::kNone;
        ce.stored_bytes = j.raw;
        ce.crc = j.crc;
        submit_raw(f, i, j.arena_offset, align_up(j.raw, kBlockBytes));
      } else {
        flush_run(f);
        ce.codec = j.used;
        ce.stored_bytes = j.stored;
        ce.crc = j.crc;
        size_t slot = i % nstage;
        stage_busy[slot] = 1;
        w.loop->submit(*files[f], true, sbase + slot * sbytes, align_up(j.stored, kBlockBytes), cursor[f],
                       static_cast<int>(arena_segs + slot), [this, slot] { stage_busy[slot] = 0; });
      }
      stored_total += ce.stored_bytes;
      cursor[f] += align_up(ce.stored_bytes, kBlockBytes);
    }

    // Submits every chunk in order; returns once the last one is submitted
    // (the snapshot is complete then), writes possibly still in flight.
    void submit_chunks() {
      for (size_t i = 0; i < jobs.size(); ++i) {
        ChunkJob& j = jobs[i];
        if (ring) place_in_ring(i);
        else if (j.codec != Codec::kNone) fill_compression_ring(i);
        wait_until_ready(j);
        if (j.error) std::rethrow_exception(j.error);
        submit_chunk(i);
      }
    }

    // Header into the shard file after the data, through staging buffer 0
    // (free: all writes drained) in pieces; then fdatasync of every file.
    void write_header() {
      hdr = encode_header(h);
      hdr_off = cursor[0];
      const uint64_t hdr_padded = align_up(hdr.size(), kBlockBytes);
      file_bytes = hdr_off + hdr_padded;
      for (uint64_t o = 0; o < hdr_padded; o += sbytes) {
        uint64_t n = std::min<uint64_t>(sbytes, hdr_padded - o);
        std::memset(sbase, 0, n);
        std::memcpy(sbase, hdr.data() + o, std::min<uint64_t>(n, hdr.size() - std::min<uint64_t>(o, hdr.size())));
        w.loop->submit(*files[0], true, sbase, n, hdr_off + o, static_cast<int>(arena_segs));
        w.loop->drain();
      }
      sync_all();
    }

    // Superblocks: the stripe files' first (durable), the shard file's last of all.
    void write_superblocks() {
      total_file_bytes = file_bytes;
      // The blocks are staged in the first staging buffer, as many at a time as it holds.
      const uint64_t per_buffer = sbytes / kBlockBytes;
      uint64_t staged = 0;
      for (size_t f = nfiles; f-- > 0;) {
        Superblock sb;
        sb.format_version = nfiles > 1 ? kFormatVersion : kFormatVersionUnstriped;
        sb.stripe_count = static_cast<uint16_t>(nfiles);
        sb.stripe_index = static_cast<uint16_t>(f);
        if (f == 0) {
          sb.header_offset = hdr_off;
          sb.header_bytes = hdr.size();
          sb.file_bytes = file_bytes;
          sb.header_crc = crc32c(hdr.data(), hdr.size());
          w.loop->drain();
          sync_all(1);
        } else {
          sb.flags = kFlagStripeFile;
          sb.file_bytes = cursor[f];
          total_file_bytes += cursor[f];
        }
        if (staged == per_buffer) {  // every block of the buffer is in flight: reuse it once written
          w.loop->drain();
          staged = 0;
        }
        char* blk = sbase + staged++ * kBlockBytes;
        std::memset(blk, 0, kBlockBytes);
        encode_superblock(sb, reinterpret_cast<unsigned char*>(blk));
        w.loop->submit(*files[f], true, blk, kBlockBytes, 0, static_cast<int>(arena_segs));
      }
      w.loop->drain();
      files[0]->sync();
    }

    // Stripe directories: their new entries durable before the commit.
    void sync_stripe_directories() {
      for (size_t f = 1; f < nfiles; ++f) {
        std::filesystem::path d = std::filesystem::path(req.stripe_files[f - 1]).parent_path();
        fsync_directory(d.empty() ? "." : d.string());
        if (d.has_parent_path()) fsync_directory(d.parent_path().string());
      }
    }

    // fdatasync of files [first, n), in parallel (one flush per device).
    void sync_all(size_t first = 0) {
      if (files.size() - first <= 1) {
        for (size_t f = first; f < files.size(); ++f) files[f]->sync();
        return;
      }
      std::vector<std::exception_ptr> errs(files.size());
      std::vector<std::thread> ts;
      for (size_t f = first; f < files.size(); ++f)
        ts.emplace_back([&, f] {
          try {
            files[f]->sync();
          } catch (...) {
            errs[f] = std::current_exception();
          }
        });
      for (auto& t : ts) t.join();
      for (auto& e : errs)
        if (e) std::rethrow_exception(e);
    }
  };

  // Writes the shard (data, header, superblocks, all durable), waits for a
  // gated save's decision, then commits when the request names a commit path.
  SaveResult write(const SaveRequest& req, const std::vector<BlobPlan>& plan, bool pipelined,
                   detail::SaveState& state) {
    auto t0 = Clock::now();
    // Note [Fresh arena]
    ensure_loop(opt.queue_depth * static_cast<unsigned>(1 + req.stripe_files.size()), !pipelined || arena_used);
    ShardWrite sw(*this, req);
    sw.plan_chunks(plan, pipelined);
    sw.post_raw_checksums();
    double snapshot_done = 0;
    try {
      sw.submit_chunks();
      snapshot_done = seconds_since(t0);
      sw.flush_runs();
      loop->drain();
      arena_used = true;
    } catch (...) {
      arena_used = true;
      try {
        loop->drain();
      } catch (...) {
      }
      throw;
    }
    sw.write_header();
    sw.write_superblocks();
    sw.sync_stripe_directories();
    state.wait_gate();

    SaveResult r;
    r.file = req.file;
    for (const auto& b : req.blobs) r.raw_bytes += b.stored_nbytes();
    r.stored_bytes = sw.stored_total;
    r.file_bytes = sw.total_file_bytes;
    r.backend = loop->describe() + (sw.files[0]->direct() ? " O_DIRECT" : " buffered") +
                (sw.nfiles > 1 ? ebbtide::detail::concat(", striped over ", sw.nfiles, " files") : std::string()) +
                (pipelined ? ", pipelined snapshot" : "");
    if (pipelined) r.snapshot_seconds = snapshot_done;
    if (!req.commit_path.empty()) replaced = commit_checkpoint(req.commit_dir, req.commit_path, req.extra_files);
    r.total_seconds = seconds_since(t0);
    return r;
  }
};

CheckpointWriter::CheckpointWriter(WriterOptions options)
    : options_(options), impl_(std::make_unique<Impl>(options)) {
  EBB_CHECK(options.chunk_bytes >= kBlockBytes && options.chunk_bytes % kBlockBytes == 0 &&
                options.chunk_bytes <= (1ull << 30),
            "chunk_bytes ", options.chunk_bytes, " must be a multiple of 4 KiB between 4 KiB and 1 GiB");
  EBB_CHECK(options.queue_depth >= 1, "queue_depth must be >= 1");
}

CheckpointWriter::~CheckpointWriter() {
  if (impl_->inflight) impl_->inflight->decide(false, "the checkpoint writer was destroyed before the save was approved");
  impl_->join_bg();
}

void CheckpointWriter::commit(SaveTransaction& txn, const std::vector<std::pair<std::string, std::string>>& files) {
  std::string old = commit_checkpoint(txn.tmp_dir(), txn.path(), files);
  if (!old.empty()) impl_->reaper.remove(std::move(old));  // Note [Deferred removal]
  txn.committed();
}

void CheckpointWriter::copy(const std::vector<HostCopy>& copies) { impl_->copy_host(copies); }

void CheckpointWriter::join() {
  std::lock_guard lock(impl_->mu);
  impl_->join_bg();
  impl_->reaper.drain();
}

bool CheckpointWriter::busy() const {
  std::lock_guard lock(impl_->mu);
  return impl_->claimed || impl_->writing();
}

void CheckpointWriter::claim(const std::string& target, bool block) {
  std::unique_lock lock(impl_->mu);
  impl_->await_idle(lock, block);
  impl_->claimed = true;
  impl_->inflight_file = target;
}

void CheckpointWriter::release_claim() {
  std::lock_guard lock(impl_->mu);
  impl_->claimed = false;
  impl_->claim_cv.notify_all();
}

uint64_t CheckpointWriter::snapshot_capacity() const { return impl_->arena_bytes.load(); }

SaveHandle CheckpointWriter::save(SaveRequest req, bool block) {
  std::unique_lock lock(impl_->mu);
  if (impl_->claimed) {  // this is the claimed save: claim() found the writer idle
    impl_->claimed = false;
    impl_->claim_cv.notify_all();
  } else {
    impl_->await_idle(lock, block);
  }
  impl_->join_bg();
  impl_->inflight.reset();
  EBB_CHECK(!req.file.empty(), "SaveRequest.file is empty");
  {
    std::error_code ec;
    EBB_CHECK(!std::filesystem::exists(req.file, ec), "checkpoint shard ", req.file, " already exists");
    for (const auto& f : req.stripe_files)
      EBB_CHECK(!f.empty() && !std::filesystem::exists(f, ec), "checkpoint stripe file '", f, "' already exists");
    EBB_CHECK(req.stripe_files.size() < 256, "too many stripe files (", req.stripe_files.size(), "; at most 255)");
  }
  for (const auto& b : req.blobs)
    if (b.codec != Codec::kNone && !have_zstd())
      throw Unsupported(ebbtide::detail::concat("checkpoint save: compression needs libzstd, and this build has none "
                                                "(blob '", b.name, "', codec ", to_string(b.codec), ")"));
  auto t0 = Clock::now();
  const bool pipelined = Impl::can_pipeline(req);
  auto plan = impl_->snapshot(req, !pipelined);
  double snap = seconds_since(t0);
  auto st = std::make_shared<detail::SaveState>();
  st->result.file = req.file;
  if (req.gated) st->gate = detail::SaveState::Gate::kPending;
  impl_->inflight = st;
  impl_->inflight_file = req.file;
  impl_->bg = std::thread([impl = impl_.get(), st, req = std::move(req), plan = std::move(plan), snap, t0,
                           pipelined] {
    SaveResult r;
    std::exception_ptr err;
    try {
      r = impl->write(req, plan, pipelined, *st);
      if (!pipelined) r.snapshot_seconds = snap;
      r.total_seconds = seconds_since(t0);
    } catch (...) {
      err = std::current_exception();
      if (!req.commit_path.empty()) {  // nothing half-written stays visible
        std::error_code ec;
        std::filesystem::remove_all(req.commit_dir, ec);
      }
      for (const auto& f : req.stripe_files) {
        std::error_code ec;
        std::filesystem::remove(f, ec);
      }
    }
    {
      std::lock_guard l(st->mu);
      if (err) st->error = err;
      else st->result = r;
      st->done = true;
      st->cv.notify_all();
    }
    // Note [Deferred removal]
    // Deleting the replaced checkpoint (freeing GBs of extents; ~0.15 s per GB
    // on an ext4 mount with `discard`) is not part of making the new one
    // durable: the writer's Reaper thread does it after done(), and neither
    // this save nor the next one waits for it (join() does). A crash before
    // it leaves a PATH.tmp-* directory that the next save of PATH removes;
    // remove_stale_temps() skips directories a Reaper is still removing.
    if (!impl->replaced.empty()) impl->reaper.remove(std::exchange(impl->replaced, std::string()));
    if (req.reserve_arena != 0 && !err) {  // Note [First async save]
      try {
        impl->reserve(req.reserve_arena, impl->ring_bytes(req));
      } catch (const std::exception& e) {  // the next async save maps it then
        log::warn("checkpoint writer: could not reserve ", req.reserve_arena, " bytes of snapshot arena: ", e.what());
      }
    }
  });
  return SaveHandle(st);
}

}  // namespace ebbtide::ckpt
