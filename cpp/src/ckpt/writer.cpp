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
// Note [Gated commit]
// A request with `gated` writes and syncs everything, then waits before the
// commit (and before done()) until the caller calls approve() or reject() on
// the handle. checkpoint/native_save.py uses it for background snapshots
// (snapshot="background"): the snapshot runs on a Python thread, which checks
// that no tensor changed while it was copied (version counters) and only then
// approves; a change rejects the save and nothing is committed. The
// writer's destructor rejects a save still waiting.
#include "writer_impl.hpp"

#include <filesystem>
#include <utility>

#include "ebbtide/ckpt/transaction.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::ckpt {

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

std::function<void()> detail::after_copy_hook;

void SaveHandle::wait_copied() const {
  EBB_CHECK_STATE(s_, "SaveHandle is empty");
  std::unique_lock lock(s_->mu);
  s_->cv.wait(lock, [&] { return s_->copied || s_->written || s_->done; });
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

// With mu held: a save in flight (claimed, or being written) raises
// StateError, or with `block` is waited for.
void CheckpointWriter::Impl::await_idle(std::unique_lock<std::mutex>& lock, bool block) {
  EBB_CHECK_STATE(block || (!claimed && !writing()), "a checkpoint save to ", inflight_file,
                  " is still in flight on this writer; wait() for it first or pass block=True");
  claim_cv.wait(lock, [&] { return !claimed; });
  join_bg();
}

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

void CheckpointWriter::stage(const std::vector<StageCopy>& copies) { impl_->stage(copies); }

std::vector<excp::Encoded> CheckpointWriter::encode_deltas(const std::vector<excp::Job>& jobs) {
  std::lock_guard lock(impl_->excp_mu);
  return excp::encode_batch(
      jobs, impl_->workers.size() + 1,
      [this](size_t n, const std::function<void(size_t)>& fn) { impl_->workers.parallel_for(n, fn); },
      &impl_->excp_scratch);
}

StagingBuffer CheckpointWriter::staging_buffer() const {
  std::lock_guard lock(impl_->staging_mu);
  return impl_->staging_buf;
}

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
