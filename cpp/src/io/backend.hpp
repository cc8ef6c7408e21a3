// Internal: the asynchronous I/O backends behind the engine (io_uring, POSIX
// thread pool). A backend moves bytes for one device worker; it is driven by
// that worker thread only (not thread safe). Results are raw: bytes moved or
// -errno; the worker resubmits short transfers and retries -EAGAIN/-EINTR.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ebbtide::io::detail {

struct IoOp {
  uint64_t tag = 0;   // returned in the completion
  int fd = -1;
  bool write = false;
  void* buf = nullptr;
  uint64_t len = 0;
  uint64_t offset = 0;
  int buf_index = -1;  // registered staging buffer holding buf, or -1
};

struct IoCompletion {
  uint64_t tag = 0;
  int64_t res = 0;  // bytes transferred, or -errno
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Queues `op`; the caller keeps at most `depth` ops outstanding.
  virtual void submit(const IoOp& op) = 0;
  // Hands queued ops to the kernel / the threads.
  virtual void flush() = 0;
  // Appends finished ops to `out`; waits for at least one when `block`.
  virtual void reap(std::vector<IoCompletion>& out, bool block) = 0;
  virtual std::string describe() const = 0;
};

// nullptr with *why_not set when io_uring cannot be used (no liburing in this
// build, ENOSYS, EPERM under seccomp, io_uring_disabled).
std::unique_ptr<Backend> make_uring_backend(unsigned depth, const std::vector<iovec>& fixed_buffers,
                                            std::string* why_not);
std::unique_ptr<Backend> make_posix_backend(unsigned depth);

}  // namespace ebbtide::io::detail
