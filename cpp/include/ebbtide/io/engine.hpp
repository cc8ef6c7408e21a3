// The storage engine: asynchronous writes and reads of host or device buffers
// into slots of slab files, at disk speed.
//
// One slab file per target directory (unlinked at once, O_DIRECT where the
// filesystem allows), striped RAID0-style in `chunk_bytes` units when several
// directories are given; one worker (ring or thread pool) per block device.
// Requests complete asynchronously; every completion carries a status.
// Thread safe: any thread may allocate, submit, wait and cancel.
// See Note [Slot lifecycle] in engine_slots.cpp for the states a slot goes through.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ebbtide/io/faults.hpp"
#include "ebbtide/io/transfer.hpp"
#include "ebbtide/mem/buffer.hpp"
#include "ebbtide/mem/cuda_shim.hpp"

namespace ebbtide::io {

struct EngineOptions {
  std::vector<std::string> dirs;        // >= 1 directory; one slab file each
  BackendKind backend = BackendKind::kAuto;
  uint64_t chunk_bytes = 1ull << 20;    // I/O unit and stripe unit (multiple of alignment)
  unsigned queue_depth = 16;            // requests in flight per device
  uint64_t slab_grow_bytes = 256ull << 20;  // fallocate step when a slab grows
  uint64_t capacity_bytes = 0;          // max slab size per directory; 0 = until the disk is full
  uint64_t staging_bytes = 64ull << 20; // pinned staging pool size (bounded)
  bool checksum = false;                // crc32c per chunk, verified on read
  bool direct = true;                   // O_DIRECT where the filesystem allows it
  bool try_cufile = true;               // AUTO: try cuFile for device buffers
  bool cuda_register = true;            // register staging with CUDA (false: host buffers only)
  mem::cuda::Driver* cuda_driver = nullptr;  // device buffers' driver; nullptr: the process's

  // Returns a copy with EBBTIDE_* environment overrides applied
  // (docs/configuration.md); bad values throw InvalidArgument naming the variable.
  EngineOptions with_env() const;
};

using SlotId = uint64_t;

namespace detail {
struct RequestState;
struct EngineTesting;
}  // namespace detail

// Handle to one submitted write or read. Copyable; all copies share the state.
class Request {
 public:
  Request() = default;
  explicit Request(std::shared_ptr<detail::RequestState> s) : s_(std::move(s)) {}
  bool valid() const { return s_ != nullptr; }
  bool done() const;
  // Blocks until complete; rethrows the request's error (IoError, ChecksumError,
  // StateError "cancelled"). Returns normally only on success.
  void wait() const;
  bool ok() const;         // done and succeeded
  bool cancelled() const;  // done because cancel() won
  std::exception_ptr error() const;  // after done(); nullptr on success
  SlotId slot() const;
  uint64_t nbytes() const;
  bool is_write() const;
  const std::shared_ptr<detail::RequestState>& state() const { return s_; }

 private:
  std::shared_ptr<detail::RequestState> s_;
};

// Runs once when a request completes (done() is true, wait() returns after it),
// on an engine worker thread, or on the thread calling cancel()/free() for a
// cancelled write. It must not block on engine requests (wait(), drain(),
// close()); it may submit new ones. Exceptions it throws are logged and dropped.
using Callback = std::function<void(const Request&)>;

struct EngineStats {
  std::string backend;            // "uring" | "posix" (what AUTO chose)
  uint64_t bytes_written = 0;     // successful writes only
  uint64_t bytes_read = 0;
  uint64_t writes = 0;            // completed successfully
  uint64_t reads = 0;
  uint64_t write_errors = 0;
  uint64_t read_errors = 0;
  uint64_t cancelled = 0;
  uint64_t pending = 0;           // submitted, not complete
  uint64_t slots_live = 0;
  uint64_t bytes_reserved = 0;    // capacity of live slots
  uint64_t bytes_stored = 0;      // true lengths of successfully written live slots
  uint64_t slab_bytes = 0;        // allocated file space, all slabs
  uint64_t bytes_staged = 0;      // host bytes copied through staging (unaligned to the slot)
  uint64_t alignment = 0;         // O_DIRECT alignment used
  bool direct = false;            // O_DIRECT in use on every slab
};

class Engine {
 public:
  // Opens (creates and unlinks) one slab per directory. Throws IoError naming
  // the directory when it does not exist, is not a directory, is read-only or
  // refuses file creation; InvalidArgument for bad options.
  explicit Engine(EngineOptions options);
  ~Engine();  // cancels pending writes, waits for in-flight I/O, closes slabs
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Reserves space for `nbytes` (> 0) in the slabs. With `like`, the slot is
  // laid out so that host buffers at the same address modulo io_alignment()
  // move in place under O_DIRECT (Note [Slot phase] in striping.cpp); any buffer
  // still works. IoError(ENOSPC) when the disk or `capacity_bytes` is exhausted.
  SlotId allocate(uint64_t nbytes, const void* like = nullptr);
  // Returns the slot's space. A slot with a request in flight is freed when the
  // request completes (pending writes are cancelled). StateError on an unknown
  // or already freed slot.
  void free(SlotId slot);

  // Buffers (mem/buffer.hpp): host memory of any alignment (unaligned buffers
  // go through staging); device memory copied on the buffer's stream after the
  // work already queued there. Unsupported for device memory without CUDA.
  // Writes src into the slot (src.nbytes <= slot capacity, > 0). On success the
  // slot's stored length becomes src.nbytes; on failure nothing is counted as
  // stored and the slot stays usable. `on_done` runs on an engine thread.
  Request write(SlotId slot, const mem::Buffer& src, Callback on_done = {});
  // Reads the slot's stored bytes into dst (dst.nbytes must equal the stored
  // length). StateError when the slot was never written successfully.
  Request read(SlotId slot, const mem::Buffer& dst, Callback on_done = {});
  // Cancels a write not yet started; true when it was cancelled (its request
  // completes with cancelled()). Reads and started writes are not cancelled.
  bool cancel(const Request& request);

  // Blocks until every submitted request has completed.
  void drain();
  // Drains and closes; later calls throw StateError. Idempotent.
  void close();
  bool closed() const;

  uint64_t slot_capacity(SlotId slot) const;
  // The alignment buffers must share with a slot's `like` to move in place
  // (largest O_DIRECT memory/offset alignment); 1 when no slab uses O_DIRECT.
  uint64_t io_alignment() const;
  uint64_t stored_bytes(SlotId slot) const;  // 0 when never written
  EngineStats stats() const;
  BackendKind backend() const;               // kUring or kPosix, never kAuto
  const EngineOptions& options() const;
  std::string describe() const;              // one line for logs

 private:
  friend struct detail::EngineTesting;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ebbtide::io
