#include "shard_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>

#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::ckpt {
namespace {
std::atomic<uint64_t> g_fault_after{0};
std::atomic<int> g_fault_err{0};
}  // namespace

void inject_write_fault(uint64_t after_bytes, int err) {
  g_fault_after = after_bytes;
  g_fault_err = err;
}

namespace detail {

ShardFile::ShardFile(const std::string& path, bool write, bool want_direct) : path_(path) {
  int flags = O_CLOEXEC | (write ? (O_WRONLY | O_CREAT | O_EXCL) : O_RDONLY);
  fd_ = ::open(path.c_str(), flags, 0644);
  if (fd_ < 0) {
    int e = errno;
    throw IoError(e, path, -1,
                  e == EROFS    ? "cannot create the checkpoint shard: read-only filesystem"
                  : e == EACCES ? "cannot open the checkpoint shard: permission denied"
                  : e == ENOENT ? (write ? "cannot create the checkpoint shard: no such directory"
                                         : "checkpoint shard does not exist")
                                : (write ? "cannot create the checkpoint shard" : "cannot open the checkpoint shard"));
  }
  if (want_direct) {
    int fl = ::fcntl(fd_, F_GETFL);
    if (::fcntl(fd_, F_SETFL, fl | O_DIRECT) == 0) {
      direct_ = true;
    } else {
      std::string dir = path.substr(0, path.rfind('/'));
      log::warn_once("ckpt-odirect:" + dir,
                     ebbtide::detail::concat("O_DIRECT refused in ", dir, " (", std::strerror(errno),
                                             "): checkpoint files there use buffered I/O"));
    }
  }
}

ShardFile::~ShardFile() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t ShardFile::size() const {
  struct stat st {};
  EBB_SYSCALL(::fstat(fd_, &st), path_, -1);
  return static_cast<uint64_t>(st.st_size);
}

void ShardFile::sync() const { EBB_SYSCALL(::fdatasync(fd_), path_, -1); }

void read_exact(const ShardFile& f, void* buf, uint64_t len, uint64_t off) {
  uint64_t done = 0;
  auto* p = static_cast<char*>(buf);
  while (done < len) {
    ssize_t r = ::pread(f.fd(), p + done, len - done, static_cast<off_t>(off + done));
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw_io_error(errno, f.path(), static_cast<int64_t>(off + done), "pread");
    }
    if (r == 0) throw IoError(ENODATA, f.path(), static_cast<int64_t>(off + done), "unexpected end of file (truncated checkpoint shard)");
    done += static_cast<uint64_t>(r);
  }
}

std::vector<Piece> split_by_segment(uint64_t region_offset, uint64_t len, uint64_t seg, bool registered) {
  std::vector<Piece> out;
  if (!registered || seg == 0) {
    out.push_back({region_offset, len, -1});
    return out;
  }
  while (len > 0) {
    uint64_t idx = region_offset / seg;
    uint64_t n = std::min(len, (idx + 1) * seg - region_offset);
    out.push_back({region_offset, n, static_cast<int>(idx)});
    region_offset += n;
    len -= n;
  }
  return out;
}

// Pre-engine transfer path: blocking pread/pwrite, one at a time.
struct TransferLoop::Impl {
  unsigned depth;
  std::exception_ptr error;

  void transfer(const ShardFile& f, bool write, void* buf, uint64_t len, uint64_t off) {
    uint64_t done = 0;
    auto* p = static_cast<char*>(buf);
    while (done < len) {
      int fe = g_fault_err.load();
      if (write && fe != 0 && off + len > g_fault_after.load()) {
        g_fault_err = 0;
        throw_io_error(fe, f.path(), static_cast<int64_t>(off + done), "pwrite (injected fault)");
      }
      ssize_t r = write ? ::pwrite(f.fd(), p + done, len - done, static_cast<off_t>(off + done))
                        : ::pread(f.fd(), p + done, len - done, static_cast<off_t>(off + done));
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        throw_io_error(errno, f.path(), static_cast<int64_t>(off + done), write ? "pwrite" : "pread");
      }
      if (r == 0) {
        throw IoError(write ? EIO : ENODATA, f.path(), static_cast<int64_t>(off + done),
                      write ? "pwrite wrote nothing" : "unexpected end of file (truncated checkpoint shard)");
      }
      done += static_cast<uint64_t>(r);
    }
  }
};

TransferLoop::TransferLoop(unsigned depth, const std::vector<iovec>&) : impl_(std::make_unique<Impl>()) {
  impl_->depth = depth;
}
TransferLoop::~TransferLoop() = default;

void TransferLoop::submit(const ShardFile& file, bool write, void* buf, uint64_t len, uint64_t offset,
                          int, std::function<void()> on_done) {
  if (impl_->error) return;
  try {
    impl_->transfer(file, write, buf, len, offset);
    if (on_done) on_done();
  } catch (...) {
    impl_->error = std::current_exception();
  }
}

void TransferLoop::poll(bool) { drain(); }

void TransferLoop::drain() {
  if (impl_->error) {
    auto e = impl_->error;
    impl_->error = nullptr;
    std::rethrow_exception(e);
  }
}

std::string TransferLoop::describe() const { return "pwrite"; }

}  // namespace detail
}  // namespace ebbtide::ckpt
