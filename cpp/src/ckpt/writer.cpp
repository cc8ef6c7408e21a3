// Note [Save pipeline]
// save() runs on the caller's thread only until every blob is copied into the
// snapshot arena: one pinned region (PinnedPool segments, CUDA-registered,
// kept and reused across saves, grown when a state outgrows it) laid out as
// the shard's data image, each blob at a 4 KiB boundary with zeroed padding.
// Host blobs are copied by the worker threads, device blobs with
// cuMemcpyDtoHAsync on their stream. Then a background thread writes:
//  - raw chunks straight from the arena (adjacent ones coalesced into one
//    O_DIRECT write), their crc32c computed just before submission;
//  - compressed chunks through a ring of pinned staging buffers: worker
//    threads compress chunk i into buffer i % N while the ring writes the
//    earlier ones (N >= 2: double buffering), in chunk order, each padded to
//    4 KiB;
//  - the header after the data, fdatasync, the superblock last, fdatasync;
//  - with a commit target: the extra files, fsync and the atomic rename.
// A failure anywhere leaves the temporary directory, never the target.
#include "ebbtide/ckpt/writer.hpp"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
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
  if (auto v = config::env_int("EBBTIDE_CKPT_QUEUE_DEPTH", 1, 1024)) o.queue_depth = static_cast<unsigned>(*v);
  if (auto v = config::env_int("EBBTIDE_CKPT_THREADS", 0, 256)) o.threads = static_cast<unsigned>(*v);
  if (auto v = config::env_int("EBBTIDE_CKPT_ZSTD_LEVEL", -7, 19)) o.zstd_level = static_cast<int>(*v);
  if (auto v = config::env_bool("EBBTIDE_CKPT_DIRECT")) o.direct = *v;
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
};
}  // namespace detail

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
  // results (compressed chunks)
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
  std::unique_ptr<mem::PinnedPool> arena;    // snapshot image
  std::unique_ptr<mem::PinnedPool> staging;  // compressed chunk ring
  std::unique_ptr<detail::TransferLoop> loop;
  std::mutex mu;
  std::thread bg;
  std::shared_ptr<detail::SaveState> inflight;
  std::string inflight_file;

  explicit Impl(const WriterOptions& o)
      : opt(o), workers(o.threads ? o.threads : detail::default_threads()) {}

  uint64_t staging_buffer_bytes() const { return align_up(compress_bound(opt.chunk_bytes), kBlockBytes); }
  unsigned staging_count() const { return std::max(2u, 2 * workers.size()); }

  void ensure_arena(uint64_t bytes) {
    uint64_t segs = std::max<uint64_t>(1, (bytes + kSegmentBytes - 1) / kSegmentBytes);
    if (arena && arena->count() >= segs) return;
    loop.reset();
    arena.reset();
    arena = std::make_unique<mem::PinnedPool>(kSegmentBytes, segs);
    if (!staging) staging = std::make_unique<mem::PinnedPool>(staging_buffer_bytes(), staging_count());
    std::vector<iovec> fixed;
    auto* base = static_cast<char*>(arena->base());
    for (uint64_t i = 0; i < segs; ++i) fixed.push_back({base + i * kSegmentBytes, kSegmentBytes});
    auto* sbase = static_cast<char*>(staging->base());
    for (size_t i = 0; i < staging->count(); ++i)
      fixed.push_back({sbase + i * staging->buffer_bytes(), staging->buffer_bytes()});
    loop = std::make_unique<detail::TransferLoop>(opt.queue_depth, fixed, opt.backend);
  }

  void join_bg() {
    if (bg.joinable()) bg.join();
  }

  // Copies every blob into the arena; returns the arena offset of each.
  std::vector<BlobPlan> snapshot(const SaveRequest& req) {
    std::vector<BlobPlan> plan(req.blobs.size());
    uint64_t off = 0;
    for (size_t i = 0; i < req.blobs.size(); ++i) {
      const auto& b = req.blobs[i];
      EBB_CHECK(b.ptr != nullptr || b.nbytes == 0, "blob '", b.name, "' has a null pointer and ", b.nbytes, " bytes");
      EBB_CHECK(b.elem_bytes > 0, "blob '", b.name, "' has element size 0");
      EBB_CHECK(b.codec == Codec::kNone || have_zstd(), "blob '", b.name, "': codec ", to_string(b.codec),
                " needs zstd, and this build has no libzstd");
      plan[i].arena_offset = off;
      off += align_up(b.nbytes, kBlockBytes);
    }
    ensure_arena(off);
    auto* base = static_cast<char*>(arena->base());
    mem::cuda::Driver* drv = nullptr;
    std::unordered_set<uintptr_t> streams;
    // Device copies are queued first so they run while the host copies do.
    for (size_t i = 0; i < req.blobs.size(); ++i) {
      const auto& b = req.blobs[i];
      if (!b.device || b.nbytes == 0) continue;
      if (drv == nullptr) {
        drv = mem::cuda::driver();
        EBB_CHECK(drv != nullptr, "blob '", b.name, "' is in CUDA device memory but no CUDA driver is usable: ",
                  mem::cuda::unavailable_reason());
      }
      drv->bind_context_of(reinterpret_cast<mem::cuda::DevicePtr>(b.ptr));
      drv->memcpy_dtoh_async(base + plan[i].arena_offset, reinterpret_cast<mem::cuda::DevicePtr>(b.ptr), b.nbytes,
                             b.stream);
      streams.insert(b.stream);
    }
    // Host copies in pieces of <= 8 MiB over the workers.
    struct Piece {
      const char* src;
      char* dst;
      uint64_t n;
    };
    std::vector<Piece> pieces;
    constexpr uint64_t kPiece = 8ull << 20;
    for (size_t i = 0; i < req.blobs.size(); ++i) {
      const auto& b = req.blobs[i];
      char* dst = base + plan[i].arena_offset;
      uint64_t padded = align_up(b.nbytes, kBlockBytes);
      if (padded > b.nbytes) std::memset(dst + b.nbytes, 0, padded - b.nbytes);
      if (b.device) continue;
      for (uint64_t o = 0; o < b.nbytes; o += kPiece)
        pieces.push_back({static_cast<const char*>(b.ptr) + o, dst + o, std::min(kPiece, b.nbytes - o)});
    }
    workers.parallel_for(pieces.size(), [&](size_t k) { std::memcpy(pieces[k].dst, pieces[k].src, pieces[k].n); });
    for (auto s : streams) drv->stream_synchronize(s);
    return plan;
  }

  SaveResult write(const SaveRequest& req, const std::vector<BlobPlan>& plan) {
    auto t0 = Clock::now();
    detail::ShardFile file(req.file, true, opt.direct);
    Header h;
    h.meta = req.meta;
    std::vector<ChunkJob> jobs;
    for (uint32_t i = 0; i < req.blobs.size(); ++i) {
      const auto& b = req.blobs[i];
      BlobEntry be{b.name, b.nbytes, static_cast<uint32_t>(jobs.size()), 0, b.codec, b.elem_bytes};
      for (uint64_t o = 0; o < b.nbytes; o += opt.chunk_bytes) {
        ChunkJob j;
        j.blob = i;
        j.arena_offset = plan[i].arena_offset + o;
        j.raw_offset = o;
        j.raw = static_cast<uint32_t>(std::min<uint64_t>(opt.chunk_bytes, b.nbytes - o));
        j.codec = b.codec;
        j.elem = b.elem_bytes;
        jobs.push_back(j);
      }
      be.chunk_count = static_cast<uint32_t>(jobs.size()) - be.first_chunk;
      h.blobs.push_back(std::move(be));
    }
    h.chunks.resize(jobs.size());

    auto* abase = static_cast<char*>(arena->base());
    const uint64_t arena_segs = arena->count();
    const size_t nstage = staging->count();
    const uint64_t sbytes = staging->buffer_bytes();
    auto* sbase = static_cast<char*>(staging->base());
    std::mutex jmu;
    std::condition_variable jcv;
    std::vector<int> stage_busy(nstage, 0);  // 1 while a write from the buffer is in flight
    uint64_t cursor = kDataStart, stored_total = 0;

    // Raw run: adjacent raw chunks coalesced (same offsets in arena and file).
    uint64_t run_arena = 0, run_len = 0, run_file = 0;
    auto flush_run = [&] {
      if (run_len == 0) return;
      for (auto& p : detail::split_by_segment(run_arena, run_len, kSegmentBytes, true))
        loop->submit(file, true, abase + p.offset, p.len, run_file + (p.offset - run_arena), p.buf_index);
      run_len = 0;
    };
    auto submit_raw = [&](uint64_t aoff, uint64_t len) {
      if (run_len > 0 && (run_arena + run_len != aoff || cursor != run_file + run_len || run_len >= opt.chunk_bytes))
        flush_run();
      if (run_len == 0) {
        run_arena = aoff;
        run_file = cursor;
      }
      run_len += len;
    };

    size_t next_dispatch = 0;
    auto dispatch = [&](size_t i) {
      ChunkJob* j = &jobs[i];
      char* out = sbase + (i % nstage) * sbytes;
      const char* in = abase + j->arena_offset;
      uint64_t bound = sbytes;
      int level = opt.zstd_level;
      workers.post([j, out, in, bound, level, &jmu, &jcv, chunk = opt.chunk_bytes] {
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
        std::lock_guard lock(jmu);
        j->ready = true;
        jcv.notify_all();
      });
    };
    // Tasks posted to workers reference locals; make sure none outlive this frame.
    size_t dispatched_any = 0;
    auto wait_all_dispatched = [&] {
      std::unique_lock lock(jmu);
      for (size_t i = 0; i < next_dispatch; ++i)
        if (jobs[i].codec != Codec::kNone) jcv.wait(lock, [&] { return jobs[i].ready; });
    };
    try {
      for (size_t i = 0; i < jobs.size(); ++i) {
        ChunkJob& j = jobs[i];
        if (j.codec != Codec::kNone) {
          // Keep the ring full: chunk k may use buffer k % nstage once the write from it is done.
          while (next_dispatch < jobs.size() && next_dispatch < i + nstage) {
            if (jobs[next_dispatch].codec == Codec::kNone) {
              ++next_dispatch;
              continue;
            }
            if (stage_busy[next_dispatch % nstage]) {
              flush_run();
              loop->poll(true);
              continue;
            }
            dispatch(next_dispatch++);
            ++dispatched_any;
          }
          {
            std::unique_lock lock(jmu);
            jcv.wait(lock, [&] { return j.ready; });
          }
          if (j.error) std::rethrow_exception(j.error);
        }
        ChunkEntry& ce = h.chunks[i];
        ce.raw_offset = j.raw_offset;
        ce.raw_bytes = j.raw;
        ce.blob = j.blob;
        ce.file_offset = cursor;
        if (j.codec == Codec::kNone || j.used == Codec::kNone) {
          ce.codec = Codec::kNone;
          ce.stored_bytes = j.raw;
          ce.crc = j.codec == Codec::kNone ? crc32c(abase + j.arena_offset, j.raw) : j.crc;
          submit_raw(j.arena_offset, align_up(j.raw, kBlockBytes));
        } else {
          flush_run();
          ce.codec = j.used;
          ce.stored_bytes = j.stored;
          ce.crc = j.crc;
          size_t slot = i % nstage;
          stage_busy[slot] = 1;
          loop->submit(file, true, sbase + slot * sbytes, align_up(j.stored, kBlockBytes), cursor,
                       static_cast<int>(arena_segs + slot), [&stage_busy, slot] { stage_busy[slot] = 0; });
        }
        stored_total += ce.stored_bytes;
        cursor += align_up(ce.stored_bytes, kBlockBytes);
      }
      flush_run();
      loop->drain();
    } catch (...) {
      wait_all_dispatched();
      try {
        loop->drain();
      } catch (...) {
      }
      throw;
    }
    wait_all_dispatched();
    (void)dispatched_any;

    // Header, then superblock last.
    std::string hdr = encode_header(h);
    uint64_t hdr_off = cursor, hdr_padded = align_up(hdr.size(), kBlockBytes);
    uint64_t file_bytes = hdr_off + hdr_padded;
    {
      // The header goes through staging buffer 0 (free: all writes drained) in pieces.
      for (uint64_t o = 0; o < hdr_padded; o += sbytes) {
        uint64_t n = std::min<uint64_t>(sbytes, hdr_padded - o);
        std::memset(sbase, 0, n);
        std::memcpy(sbase, hdr.data() + o, std::min<uint64_t>(n, hdr.size() - std::min<uint64_t>(o, hdr.size())));
        loop->submit(file, true, sbase, n, hdr_off + o, static_cast<int>(arena_segs));
        loop->drain();
      }
    }
    file.sync();
    Superblock sb;
    sb.header_offset = hdr_off;
    sb.header_bytes = hdr.size();
    sb.file_bytes = file_bytes;
    sb.header_crc = crc32c(hdr.data(), hdr.size());
    std::memset(sbase, 0, kBlockBytes);
    encode_superblock(sb, reinterpret_cast<unsigned char*>(sbase));
    loop->submit(file, true, sbase, kBlockBytes, 0, static_cast<int>(arena_segs));
    loop->drain();
    file.sync();

    SaveResult r;
    r.file = req.file;
    for (const auto& b : req.blobs) r.raw_bytes += b.nbytes;
    r.stored_bytes = stored_total;
    r.file_bytes = file_bytes;
    r.backend = loop->describe() + (file.direct() ? " O_DIRECT" : " buffered");
    if (!req.commit_path.empty()) {
      for (const auto& [name, content] : req.extra_files) write_file_durably(req.commit_dir + "/" + name, content);
      commit_directory(req.commit_dir, req.commit_path);
    }
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

CheckpointWriter::~CheckpointWriter() { impl_->join_bg(); }

bool CheckpointWriter::busy() const {
  std::lock_guard lock(impl_->mu);
  if (!impl_->inflight) return false;
  std::lock_guard l2(impl_->inflight->mu);
  return !impl_->inflight->done;
}

uint64_t CheckpointWriter::snapshot_capacity() const {
  std::lock_guard lock(impl_->mu);
  return impl_->arena ? impl_->arena->total_bytes() : 0;
}

SaveHandle CheckpointWriter::save(SaveRequest req, bool block) {
  std::unique_lock lock(impl_->mu);
  if (impl_->inflight) {
    bool done;
    {
      std::lock_guard l2(impl_->inflight->mu);
      done = impl_->inflight->done;
    }
    EBB_CHECK_STATE(done || block, "a checkpoint save to ", impl_->inflight_file,
                    " is still in flight on this writer; wait() for it first or pass block=True");
  }
  impl_->join_bg();
  impl_->inflight.reset();
  EBB_CHECK(!req.file.empty(), "SaveRequest.file is empty");
  {
    std::error_code ec;
    EBB_CHECK(!std::filesystem::exists(req.file, ec), "checkpoint shard ", req.file, " already exists");
  }
  auto t0 = Clock::now();
  auto plan = impl_->snapshot(req);
  double snap = seconds_since(t0);
  auto st = std::make_shared<detail::SaveState>();
  st->result.file = req.file;
  impl_->inflight = st;
  impl_->inflight_file = req.file;
  impl_->bg = std::thread([impl = impl_.get(), st, req = std::move(req), plan = std::move(plan), snap, t0] {
    SaveResult r;
    std::exception_ptr err;
    try {
      r = impl->write(req, plan);
      r.snapshot_seconds = snap;
      r.total_seconds = seconds_since(t0);
    } catch (...) {
      err = std::current_exception();
      if (!req.commit_path.empty()) {  // nothing half-written stays visible
        std::error_code ec;
        std::filesystem::remove_all(req.commit_dir, ec);
      }
    }
    std::lock_guard l(st->mu);
    if (err) st->error = err;
    else st->result = r;
    st->done = true;
    st->cv.notify_all();
  });
  return SaveHandle(st);
}

}  // namespace ebbtide::ckpt
