// Errors of the ebbtide core.
//
// Every failure the caller can act on is a typed exception whose message names
// the object (file, offset, slot, setting) and the cause. The Python binding
// maps them: InvalidArgument -> ValueError, IoError -> OSError subclass (errno
// kept), ChecksumError -> OSError subclass, StateError -> RuntimeError,
// Unsupported -> NotImplementedError. Internal invariants use EBB_ASSERT.
#pragma once

#include <cerrno>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace ebbtide {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A user mistake: bad size, bad setting, bad handle.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// An operation that is not valid in the object's current state (closed
// engine, slot freed twice, read of a slot never written).
class StateError : public Error {
 public:
  using Error::Error;
};

// Something this build or machine cannot do (no liburing, no CUDA driver).
class Unsupported : public Error {
 public:
  using Error::Error;
};

// A failed system call or I/O: keeps errno, the path and the file offset.
class IoError : public Error {
 public:
  IoError(int err, std::string path, int64_t offset, const std::string& what);
  int err() const noexcept { return err_; }
  const std::string& path() const noexcept { return path_; }
  int64_t offset() const noexcept { return offset_; }
  // `what` as given, without the file, offset and errno text what() adds:
  // for an error that wraps this one with the same file and errno.
  const std::string& cause() const noexcept { return cause_; }

 private:
  int err_;
  std::string path_;
  int64_t offset_;
  std::string cause_;
};

// Data read back does not match the checksum recorded when it was written.
class ChecksumError : public IoError {
 public:
  ChecksumError(std::string path, int64_t offset, uint32_t expected, uint32_t actual);
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
[[noreturn]] void assert_fail(const char* cond, const char* file, int line, const std::string& msg);
}  // namespace detail

// Builds the IoError for `err` (an errno value) on `path` at `offset`;
// `op` names the call ("pwrite", "fallocate").
[[noreturn]] void throw_io_error(int err, const std::string& path, int64_t offset, const char* op);

}  // namespace ebbtide

// EBB_CHECK(cond, parts...): throws InvalidArgument with the parts concatenated.
#define EBB_CHECK(cond, ...)                                                         \
  do {                                                                               \
    if (!(cond)) [[unlikely]] throw ::ebbtide::InvalidArgument(::ebbtide::detail::concat(__VA_ARGS__)); \
  } while (0)

// EBB_CHECK_STATE(cond, parts...): throws StateError.
#define EBB_CHECK_STATE(cond, ...)                                                   \
  do {                                                                               \
    if (!(cond)) [[unlikely]] throw ::ebbtide::StateError(::ebbtide::detail::concat(__VA_ARGS__)); \
  } while (0)

// EBB_SYSCALL(expr, path, offset): runs a call returning -1/errno on failure
// and throws IoError naming the call, the path and the offset. Yields the result.
#define EBB_SYSCALL(expr, path, offset)                                              \
  ([&]() {                                                                           \
    auto ebb_rc_ = (expr);                                                           \
    if (ebb_rc_ < 0) [[unlikely]] ::ebbtide::throw_io_error(errno, (path), (offset), #expr); \
    return ebb_rc_;                                                                  \
  }())

// Internal invariant; failing means a bug in ebbtide, not in the caller.
#define EBB_ASSERT(cond, ...)                                                        \
  do {                                                                               \
    if (!(cond)) [[unlikely]]                                                        \
      ::ebbtide::detail::assert_fail(#cond, __FILE__, __LINE__, ::ebbtide::detail::concat("" __VA_OPT__(,) __VA_ARGS__)); \
  } while (0)
