#include "shard_io.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <algorithm>
#include <chrono>
#include <thread>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
#include "../io/backend.hpp"

namespace ebbtide::io::detail {
bool query_dio_align(int fd, uint32_t* mem_align, uint32_t* offset_align);  // io/dio_align.cpp
}

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

// Note [Regular files only]
// A checkpoint handed to load() may be hostile: a FIFO in place of a shard
// would block open() and read() forever, a device could be endless, a
// symlink could lead anywhere. Files are read only when the name itself is a
// regular file: O_NOFOLLOW refuses a symlink as the last component (ELOOP),
// O_NONBLOCK makes opening a FIFO return at once, fstat must say S_ISREG, and
// only then is O_NONBLOCK cleared (io_uring would otherwise answer EAGAIN
// instead of waiting for the page cache).
ShardFile::ShardFile(const std::string& path, bool write, bool want_direct) : path_(path) {
  int flags = O_CLOEXEC | (write ? (O_WRONLY | O_CREAT | O_EXCL) : (O_RDONLY | O_NOFOLLOW | O_NONBLOCK));
  fd_ = ::open(path.c_str(), flags, 0644);
  if (fd_ < 0) {
    int e = errno;
    if (!write && e == ELOOP)
      throw InvalidArgument(path + ": checkpoint file is a symbolic link; only regular files are read");
    throw IoError(e, path, -1,
                  e == EROFS    ? "cannot create the checkpoint shard: read-only filesystem"
                  : e == EACCES ? "cannot open the checkpoint shard: permission denied"
                  : e == ENOENT ? (write ? "cannot create the checkpoint shard: no such directory"
                                         : "checkpoint shard does not exist")
                                : (write ? "cannot create the checkpoint shard" : "cannot open the checkpoint shard"));
  }
  if (!write) {
    struct stat st {};
    int fl = ::fcntl(fd_, F_GETFL);
    if (::fstat(fd_, &st) != 0 || fl < 0) {
      int e = errno;
      ::close(fd_);
      fd_ = -1;
      throw_io_error(e, path, -1, "fstat");
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      fd_ = -1;
      throw InvalidArgument(ebbtide::detail::concat(
          path, ": checkpoint file is not a regular file (it is a ",
          S_ISDIR(st.st_mode) ? "directory" : S_ISFIFO(st.st_mode) ? "FIFO" : S_ISSOCK(st.st_mode) ? "socket"
          : S_ISCHR(st.st_mode) ? "character device" : S_ISBLK(st.st_mode) ? "block device" : "special file",
          "); only regular files are read"));
    }
    if (::fcntl(fd_, F_SETFL, fl & ~O_NONBLOCK) != 0) {
      int e = errno;
      ::close(fd_);
      fd_ = -1;
      throw_io_error(e, path, -1, "fcntl(F_SETFL)");
    }
  }
  if (want_direct) enable_direct();
}

void ShardFile::enable_direct() {
  int fl = ::fcntl(fd_, F_GETFL);
  uint32_t mem = 0, off = 0;
  if (::fcntl(fd_, F_SETFL, fl | O_DIRECT) == 0) {
    direct_ = true;
    // Transfers are at 4 KiB offsets in 4 KiB-aligned buffers: enough unless
    // the device wants more (rare); then buffered I/O keeps the format unchanged.
    if (io::detail::query_dio_align(fd_, &mem, &off) && (off > kBlockBytes || mem > kBlockBytes)) {
      ::fcntl(fd_, F_SETFL, fl);
      direct_ = false;
      log::warn_once("ckpt-dioalign:" + path_, ebbtide::detail::concat("O_DIRECT on ", path_, " needs ", off,
                                                                       "-byte alignment: using buffered I/O"));
    }
  } else {
    std::string dir = path_.substr(0, path_.rfind('/'));
    log::warn_once("ckpt-odirect:" + dir,
                   ebbtide::detail::concat("O_DIRECT refused in ", dir, " (", std::strerror(errno),
                                           "): checkpoint files there use buffered I/O"));
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

// Note [Populate ahead]
// Destinations read in place are usually fresh anonymous memory
// (checkpoint.load and load_safetensors map new storages): the first touch
// of each page is a fault, taken inside io_uring's submission (or the POSIX
// worker) while it pins the pages, in series with the I/O. A populator thread walks the destination ranges in
// submission order and faults their pages in with MADV_POPULATE_WRITE (which
// keeps contents, so it may race the reads) on another core; on a 2-core VM
// this took a 1 GB load from 0.76 to 0.58 s. Kernels without it (EINVAL,
// before 5.14) just skip the step.
PagePopulator::PagePopulator(std::vector<std::pair<char*, uint64_t>> ranges) {
  if (ranges.empty()) return;
  thread_ = std::thread([this, ranges = std::move(ranges)] {
    for (const auto& [p, n] : ranges) {
      if (stop_.load(std::memory_order_relaxed)) return;
#ifdef MADV_POPULATE_WRITE
      if (::madvise(p, n, MADV_POPULATE_WRITE) != 0 && errno == EINVAL)
        return;  // no MADV_POPULATE_WRITE (or not anonymous/file memory): the I/O faults pages in itself
#else
      return;
#endif
    }
  });
}

PagePopulator::~PagePopulator() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
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

// Transfers go through the storage engine's backends (io/backend.hpp):
// io_uring with the arena and staging buffers registered, or the POSIX thread
// pool where io_uring is unavailable. Every completion is checked; short
// transfers are resubmitted for the remainder, EINTR/EAGAIN retried.
struct TransferLoop::Impl {
  struct Op {
    const ShardFile* file;
    bool write;
    char* buf;
    uint64_t len, offset, done, need;
    int buf_index;
    std::function<void()> on_done;
  };
  std::unique_ptr<io::detail::Backend> backend;
  unsigned depth = 1;
  uint64_t next_tag = 1;
  std::unordered_map<uint64_t, Op> inflight;
  std::vector<io::detail::IoCompletion> comps;
  std::exception_ptr error;

  void issue(uint64_t tag, const Op& op) {
    io::detail::IoOp io;
    io.tag = tag;
    io.fd = op.file->fd();
    io.write = op.write;
    io.buf = op.buf + op.done;
    io.len = op.len - op.done;
    io.offset = op.offset + op.done;
    io.buf_index = op.buf_index;
    backend->submit(io);
  }

  void complete(const io::detail::IoCompletion& c) {
    auto it = inflight.find(c.tag);
    EBB_ASSERT(it != inflight.end(), "unknown completion tag ", c.tag);
    Op& op = it->second;
    if (c.res == -EINTR || c.res == -EAGAIN) {
      issue(c.tag, op);
      return;
    }
    if (c.res <= 0) {
      if (!error) {
        int e = c.res < 0 ? static_cast<int>(-c.res) : (op.write ? EIO : ENODATA);
        error = std::make_exception_ptr(IoError(
            e, op.file->path(), static_cast<int64_t>(op.offset + op.done),
            op.write ? (c.res == 0 ? "write wrote nothing" : "checkpoint write failed")
                     : (c.res == 0 ? "unexpected end of file (truncated checkpoint shard)" : "checkpoint read failed")));
      }
      inflight.erase(it);
      return;
    }
    op.done += static_cast<uint64_t>(c.res);
    if (op.done < op.need) {  // short transfer: resubmit the remainder
      issue(c.tag, op);
      return;
    }
    auto cb = std::move(op.on_done);
    inflight.erase(it);
    if (cb && !error) cb();
  }

  void pump(bool block) {
    backend->flush();
    comps.clear();
    backend->reap(comps, block && !inflight.empty());
    for (const auto& c : comps) complete(c);
  }
};

TransferLoop::TransferLoop(unsigned depth, const std::vector<iovec>& fixed, io::BackendKind kind)
    : impl_(std::make_unique<Impl>()) {
  impl_->depth = std::max(1u, depth);
  std::string why;
  if (kind != io::BackendKind::kPosix) {
    impl_->backend = io::detail::make_uring_backend(impl_->depth, fixed, &why);
    if (!impl_->backend && kind == io::BackendKind::kUring)
      throw Unsupported("checkpoint: io backend 'uring' was requested but is unavailable: " + why);
    if (!impl_->backend) log::info("checkpoint: io backend auto -> posix (", why, ")");
  }
  if (!impl_->backend) impl_->backend = io::detail::make_posix_backend(impl_->depth);
}

TransferLoop::~TransferLoop() {
  try {
    while (!impl_->inflight.empty()) impl_->pump(true);
  } catch (...) {
  }
}

void TransferLoop::submit(const ShardFile& file, bool write, void* buf, uint64_t len, uint64_t offset,
                          int buf_index, std::function<void()> on_done, uint64_t need) {
  auto& I = *impl_;
  if (I.error) return;  // drain() reports it
  while (I.inflight.size() >= I.depth) I.pump(true);
  int fe = g_fault_err.load();
  if (write && fe != 0 && offset + len > g_fault_after.load()) {
    if (fe < 0) {  // parked for good: a crash test kills the process here
      log::warn("checkpoint: write of ", file.path(), " at ", offset, " parked by the test hook");
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    }
    g_fault_err = 0;
    if (!I.error) I.error = std::make_exception_ptr(IoError(fe, file.path(), static_cast<int64_t>(offset),
                                                            "checkpoint write failed (injected fault)"));
    return;
  }
  uint64_t tag = I.next_tag++;
  auto [it, ok] = I.inflight.emplace(tag, Impl::Op{&file, write, static_cast<char*>(buf), len, offset, 0,
                                                    need == 0 || write ? len : std::min(need, len), buf_index,
                                                    std::move(on_done)});
  I.issue(tag, it->second);
  if (I.inflight.size() >= I.depth) I.backend->flush();
}

void TransferLoop::poll(bool block) {
  impl_->pump(block);
  if (impl_->error && impl_->inflight.empty()) drain();
}

void TransferLoop::drain() {
  auto& I = *impl_;
  while (!I.inflight.empty()) I.pump(true);
  if (I.error) {
    auto e = I.error;
    I.error = nullptr;
    std::rethrow_exception(e);
  }
}

std::string TransferLoop::describe() const { return impl_->backend->describe(); }

}  // namespace detail
}  // namespace ebbtide::ckpt
