#include "ebbtide/util/error.hpp"

#include <cstdio>
#include <cstring>

namespace ebbtide {

namespace {
std::string io_message(int err, const std::string& path, int64_t offset, const std::string& what) {
  std::string msg = what;
  if (!path.empty()) msg += detail::concat(" [file ", path);
  if (offset >= 0) msg += detail::concat(path.empty() ? " [" : ", ", "offset ", offset);
  if (!path.empty() || offset >= 0) msg += "]";
  if (err != 0) msg += detail::concat(": ", std::strerror(err), " (errno ", err, ")");
  return msg;
}
}  // namespace

IoError::IoError(int err, std::string path, int64_t offset, const std::string& what)
    : Error(io_message(err, path, offset, what)), err_(err), path_(std::move(path)), offset_(offset), cause_(what) {}

ChecksumError::ChecksumError(std::string path, int64_t offset, uint32_t expected, uint32_t actual)
    : IoError(EIO, std::move(path), offset,
              detail::concat("crc32c mismatch: stored data is corrupt (expected 0x", std::hex,
                             expected, ", got 0x", actual, ")")) {}

void throw_io_error(int err, const std::string& path, int64_t offset, const char* op) {
  throw IoError(err, path, offset, detail::concat(op, " failed"));
}

namespace detail {
void assert_fail(const char* cond, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "ebbtide: internal error: %s at %s:%d %s\n", cond, file, line, msg.c_str());
  throw Error(concat("ebbtide internal error: ", cond, " at ", file, ":", line, " ", msg));
}
}  // namespace detail

}  // namespace ebbtide
