// The transfer loop: asynchronous reads and writes of DirectFiles on one
// backend (io_uring, or the POSIX thread pool), used by the engine's device
// workers and by the checkpoint reader and writer. See Note [Transfer loop]
// in transfer.cpp. Driven by one thread at a time (not thread safe).
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ebbtide::io {

class DirectFile;

enum class BackendKind { kAuto, kUring, kPosix };
std::string_view to_string(BackendKind kind);
// "auto" | "uring" | "posix" (case-insensitive); InvalidArgument otherwise.
BackendKind parse_backend(std::string_view text);

class TransferLoop {
 public:
  // Outcome of one transfer: nullptr on success, else the IoError naming the
  // file and offset. Runs on the thread driving the loop.
  using Handler = std::function<void(std::exception_ptr)>;

  // `fixed`: pinned buffers registered with the ring (buf_index refers to
  // them). kAuto tries io_uring and falls back to the POSIX pool (logged as
  // `who`); kUring throws Unsupported when io_uring is unavailable.
  TransferLoop(unsigned depth, const std::vector<iovec>& fixed, BackendKind kind, std::string_view who);
  ~TransferLoop();  // waits for transfers in flight
  TransferLoop(const TransferLoop&) = delete;
  TransferLoop& operator=(const TransferLoop&) = delete;

  // Queues one transfer without waiting; the caller keeps in_flight() within
  // depth. `need` (reads; 0 = len): the transfer is complete once that many
  // bytes are in, so an O_DIRECT read of a file's last block may ask for the
  // whole block and stop at the end of the file. `done` may run inside start()
  // (an injected fault). `file` and `buf` must outlive the transfer.
  void start(const DirectFile& file, bool write, void* buf, uint64_t len, uint64_t offset, int buf_index,
             Handler done, uint64_t need = 0);
  // Hands queued transfers to the kernel / the threads.
  void flush();
  // Runs the handlers of finished transfers (resubmitting short ones); with
  // `block`, waits for at least one when any is in flight.
  void reap(bool block);
  unsigned in_flight() const;

  // The collecting interface: submit() blocks while `depth` transfers are in
  // flight; `on_done` runs only on success; the first error is kept and
  // rethrown by poll() (once nothing is in flight) or drain().
  void submit(const DirectFile& file, bool write, void* buf, uint64_t len, uint64_t offset, int buf_index,
              std::function<void()> on_done = {}, uint64_t need = 0);
  void poll(bool block);
  void drain();

  BackendKind backend() const;  // kUring or kPosix, never kAuto
  const char* name() const;
  std::string describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ebbtide::io
