// Checkpoint shard writer: snapshots caller memory into reusable pinned
// buffers, then writes one shard file in the background (O_DIRECT through the
// storage engine's backends, chunk checksums, optional compression, header
// and superblock last, fsync) and optionally commits its directory by atomic
// rename. See Note [Save pipeline] in writer.cpp and docs/checkpoint-format.md.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ebbtide/mem/fork_origin.hpp"
#include "ebbtide/ckpt/excp.hpp"
#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/io/engine.hpp"
#include "ebbtide/mem/buffer.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/host_mapping.hpp"

namespace ebbtide::ckpt {

struct WriterOptions {
  uint64_t chunk_bytes = 4ull << 20;  // chunk (checksum and compression unit), multiple of 4 KiB
  unsigned queue_depth = 8;           // writes in flight
  unsigned threads = 0;               // snapshot copy and compression threads; 0 = min(4, cores)
  int zstd_level = 1;
  bool direct = true;                 // O_DIRECT where the filesystem allows it
  io::BackendKind backend = io::BackendKind::kAuto;  // engine backend (EBBTIDE_IO_BACKEND)
  // Buffer of a synchronous (pipelined) save, reused round the ring (Note
  // [Save ring] in writer_shard.cpp; EBBTIDE_CKPT_RING): 0 = max(64 MiB, two
  // chunks per write in flight); otherwise at least two chunks.
  uint64_t ring_bytes = 0;
  // Device blobs' copies: null = the process-wide driver (mem::cuda::driver());
  // tests give a simulated one, which must outlive the writer.
  mem::cuda::Driver* cuda_driver = nullptr;
  // Copy with EBBTIDE_CKPT_* environment overrides applied; bad values throw
  // InvalidArgument naming the variable.
  WriterOptions with_env() const;
};

// Memory to save: `data` is read (never written), device memory copied on
// its stream; a null data.ptr only with nbytes 0.
struct BlobSource {
  std::string name;       // named in errors and in the header
  mem::Buffer data;
  uint16_t elem_bytes = 1;
  Codec codec = Codec::kNone;
  // Bytes stored right before and after `data`, in the same
  // blob (Note [Framed blobs] in writer_arena.cpp); the blob is head + data + tail.
  std::string head, tail;
  uint64_t stored_nbytes() const { return head.size() + data.nbytes + tail.size(); }
};

struct SaveRequest {
  std::string file;                   // shard file to create (must not exist)
  std::vector<BlobSource> blobs;
  std::string meta;                   // JSON stored in the header
  // Striping (Note [Striping] in writer_shard.cpp): stripe data files to create
  // (must not exist; their directories must), typically one per extra
  // directory. Chunks go round-robin over `file` and these, written in
  // parallel; the header in `file` records where each chunk lives.
  std::vector<std::string> stripe_files;
  // The caller waits for the save and keeps every blob's memory unchanged
  // until wait() returns: the snapshot then overlaps the writes
  // (Note [Pipelined save]) through a bounded ring (Note [Save ring]), not a
  // copy of the whole state. Blobs without compression only (host or
  // device); other requests fall back to snapshot-then-write.
  bool pipelined = false;
  // The write waits before its commit until approve() or reject() is called
  // on the handle (Note [Gated commit] in writer.cpp).
  bool gated = false;
  // After the save is done, the writer's thread grows the snapshot arena to
  // this many bytes and faults them in, so that the next save that
  // snapshots first (an async one) finds its memory present (Note [First
  // async save] in writer_arena.cpp). 0: no growth.
  uint64_t reserve_arena = 0;
  // When commit_path is set: after the shard is durable, commit commit_dir
  // (the directory holding `file`) to commit_path with `extra_files` written
  // into it (commit_checkpoint()).
  std::string commit_dir, commit_path;
  std::vector<std::pair<std::string, std::string>> extra_files;
};

struct SaveResult {
  std::string file;
  uint64_t raw_bytes = 0;     // sum of blob sizes
  uint64_t stored_bytes = 0;  // sum of stored chunk sizes
  uint64_t file_bytes = 0;
  double snapshot_seconds = 0;  // time save() blocked the caller
  double total_seconds = 0;     // until durable (and committed)
  std::string backend;          // I/O path used, for logs
};

namespace detail {
// Test only: runs on a pipelined save's writing thread once every source
// is copied into the ring, before the writes complete (SaveHandle::wait_copied()).
extern std::function<void()> after_copy_hook;
struct SaveState;
}

// Handle to a background save. Copyable; copies share the state.
class SaveHandle {
 public:
  SaveHandle() = default;
  explicit SaveHandle(std::shared_ptr<detail::SaveState> s) : s_(std::move(s)) {}
  bool valid() const { return s_ != nullptr; }
  bool done() const;
  // Blocks until durable; rethrows the writer's error (IoError, ...).
  SaveResult wait() const;
  // Gated saves (SaveRequest::gated): let the commit go ahead, or fail the
  // save with StateError(why). No effect on other saves or once decided.
  void approve() const;
  void reject(const std::string& why) const;
  // Blocks until every byte of the save's sources is written and durable
  // (a gated save then waits for approve()/reject()), or the save is done.
  void wait_written() const;
  // Blocks until the save no longer reads its sources: a pipelined save's
  // chunks are all copied into its ring (their writes may still run), any
  // other save's once written (its snapshot was taken in save()), or the
  // save is done. The caller may change the sources then.
  void wait_copied() const;

 private:
  std::shared_ptr<detail::SaveState> s_;
};

class SaveTransaction;  // transaction.hpp

// One host-to-host copy of the writer's snapshot (CheckpointWriter::Impl::copy_host).
struct HostCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t nbytes = 0;
};

// One copy of CheckpointWriter::stage(): `src.nbytes` bytes of `src` (host
// memory, or CUDA device memory copied on src.stream) to `dst`.
struct StageCopy {
  void* dst = nullptr;
  mem::Buffer src;
};

// Host memory a caller stages a state into before its save (the DCP
// plugin's staged copy, Note [Staging buffer] in writer_arena.cpp): the
// writer keeps it for the next save; views of it keep it alive.
using StagingBuffer = std::shared_ptr<mem::HostMapping>;

class CheckpointWriter : public mem::ForkOrigin {
 public:
  explicit CheckpointWriter(WriterOptions options = WriterOptions{}.with_env());
  ~CheckpointWriter();  // waits for the save in flight (errors are dropped)
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Copies every blob into the snapshot buffers, then returns while the
  // shard is written by a background thread. One save at a time: with a save
  // in flight, `block` waits for it first, otherwise StateError. Snapshot
  // errors (bad request, device copy) throw here and leave no file behind.
  SaveHandle save(SaveRequest request, bool block = false);
  // Claims the writer for the next save() before its request exists (its
  // directories are reserved first, its snapshot may start later on another
  // thread), naming its `target` in errors: until that save() or
  // release_claim(), the writer is busy and other claims and saves see a save
  // in flight. With a save in flight, `block` waits for it, otherwise
  // StateError.
  void claim(const std::string& target, bool block = false);
  void release_claim();
  bool busy() const;
  // Waits until the background thread is idle: the save in flight is done
  // and the previous checkpoint it replaced is removed (Note [Deferred removal]).
  void join();
  // Commits a save `txn` reserved whose files its caller wrote (a distributed
  // save's rank 0, the DCP plugin's coordinator): commit_checkpoint() of
  // txn.tmp_dir() with `files`, then txn.committed(). The checkpoint it
  // replaces is removed on this writer's thread, as after save() (Note
  // [Deferred removal]), so the caller does not wait for the filesystem to
  // free it. IoError from the commit.
  void commit(SaveTransaction& txn, const std::vector<std::pair<std::string, std::string>>& files = {});
  // Maps `bytes` of staging memory and faults every page in, on the calling
  // thread (one off the caller's training thread: Note [Staging buffer]),
  // then makes it staging_buffer(); the one it replaces lives on while views
  // of it do. With `device` >= 0 (a CUDA device the staged copies come from)
  // it is page-locked too, in that device's primary context (Note [Pinning
  // context] in shard_io.hpp). InvalidArgument for 0 bytes, IoError when
  // the memory cannot be mapped. Thread safe.
  StagingBuffer reserve_staging(uint64_t bytes, int device = mem::kHost);
  // The last reserve_staging()'s buffer, or null. Never waits.
  StagingBuffer staging_buffer() const;
  // Copies a state into staging memory the way save() snapshots blobs: the
  // device sources first, with cuMemcpyDtoHAsync on their streams (their
  // destinations must lie in staging_buffer(), page-locked then for the
  // copies), the host ones over this writer's threads (8 MiB pieces,
  // streaming stores), and returns once every copy has landed. Ranges must
  // not overlap and must stay valid until it returns; safe beside a save in
  // flight. InvalidArgument for a device copy outside the staging buffer.
  void stage(const std::vector<StageCopy>& copies);
  // ExCP delta encoding of weights (excp::encode_batch) on this writer's
  // threads and the caller: a delta save's encoding runs where its copies
  // and compression do. Safe beside a save in flight.
  std::vector<excp::Encoded> encode_deltas(const std::vector<excp::Job>& jobs);
  const WriterOptions& options() const { return options_; }
  uint64_t snapshot_capacity() const;  // bytes of reusable snapshot (or save ring) buffers held

 private:
  struct Impl;
  WriterOptions options_;
  std::unique_ptr<Impl> impl_;
};

// Durable directory commit (Note [Commit by rename] in commit.cpp).
// Creates an empty PATH.tmp-XXXXXX beside `path` (the parent must exist).
std::string make_temp_dir(const std::string& path);
// The commit of a checkpoint directory, the one place it happens: writes
// `files` (name, content) into `tmp_dir` durably, fsyncs `tmp_dir` and its
// files, then atomically replaces `path` by it (renameat2 RENAME_EXCHANGE, or
// rename when `path` does not exist) and fsyncs the parent. Leaves the
// previous contents for the caller to remove: returns their directory (named
// PATH.tmp-* or PATH.old-*, so a crash before the removal leaves them to
// remove_stale_temps), or "" when `path` was new. IoError naming the paths.
using NamedContent = std::pair<std::string, std::string>;
std::string commit_checkpoint(const std::string& tmp_dir, const std::string& path,
                              const std::vector<NamedContent>& files = {});
// fsyncs a directory (its entries become durable). IoError naming it.
void fsync_directory(const std::string& dir);
// Writes a small file durably (write + fsync). IoError naming it.
void write_file_durably(const std::string& path, const std::string& content);
// Removes PATH.tmp-* and PATH.old-* left by a killed save of `path`.
void remove_stale_temps(const std::string& path);

// Test hook (process-wide): the next write of shard data at or beyond
// `after_bytes` of any shard fails with errno `err`; err = 0 clears it;
// err < 0 parks the writing thread there for good instead (crash tests kill
// the process while a save is half written).
void inject_write_fault(uint64_t after_bytes, int err);

}  // namespace ebbtide::ckpt
