// Writing one shard (Note [Save pipeline] in writer.cpp): its chunks, through
// the save ring when pipelined, over its stripe files; the header, the
// superblocks, fdatasync and the commit.
//
// Note [Pipelined save]
// A synchronous save (the caller waits anyway and keeps its memory unchanged)
// need not finish the snapshot before writing: the workers copy chunk k into
// the arena (and checksum it while the bytes are in cache) while chunk k-1 is
// being written, so the save costs about max(copy, write) instead of the sum.
// Only blobs without compression (host or device); others take Note [Save pipeline]'s path.
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
#include "writer_impl.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>

#include "ebbtide/util/crc32c.hpp"

namespace ebbtide::ckpt {

// One shard being written (Note [Save pipeline]): its files and their
// cursors, the chunk jobs and the header's chunk table, the raw runs being
// coalesced and the ring of staging buffers. Worker tasks reference it, so
// the destructor waits for every task posted.
struct CheckpointWriter::Impl::ShardWrite {
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
SaveResult CheckpointWriter::Impl::write(const SaveRequest& req, const std::vector<BlobPlan>& plan, bool pipelined,
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
    if (pipelined) {  // every chunk is in the ring: the sources are read no more
      state.mark_copied();
      if (detail::after_copy_hook) detail::after_copy_hook();
    }
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

}  // namespace ebbtide::ckpt
