// Note [Direct files]
// Engine slabs are files without a name: O_TMPFILE (or, where the filesystem
// lacks it, create + unlink right after open), mode 0600, so a killed process
// leaves nothing behind. Checkpoint files are named, created with O_EXCL or
// opened for reading under Note [Regular files only]. O_DIRECT is switched on
// with fcntl(F_SETFL) after opening, which fails with EINVAL exactly where
// open() with O_DIRECT would (tmpfs before 6.6, some FUSE mounts); there the
// file uses buffered I/O and one warning names the directory. The O_DIRECT
// alignment comes from statx(STATX_DIOALIGN) (Linux 6.1+), else the block
// device's logical sector size, else 4096; a caller whose layout fixes the
// alignment (checkpoint blocks of 4 KiB) passes a maximum, and a device that
// needs more gets buffered I/O. grow_to() extends a file with fallocate so
// writes land in allocated extents; where fallocate is unsupported it grows
// with ftruncate (sparse) and says so once.
//
// Note [Regular files only]
// A checkpoint handed to load() may be hostile: a FIFO in place of a shard
// would block open() and read() forever, a device could be endless, a
// symlink could lead anywhere. Files are read only when the name itself is a
// regular file: O_NOFOLLOW refuses a symlink as the last component (ELOOP),
// O_NONBLOCK makes opening a FIFO return at once, fstat must say S_ISREG, and
// only then is O_NONBLOCK cleared (io_uring would otherwise answer EAGAIN
// instead of waiting for the page cache).
#include "ebbtide/io/direct_file.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "dio_align.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io {
namespace {
std::atomic<bool> g_refuse_direct{false};
std::atomic<bool> g_refuse_fallocate{false};

uint64_t block_device_sector_size(dev_t dev) {
  char path[64];
  std::snprintf(path, sizeof path, "/sys/dev/block/%u:%u/queue/logical_block_size", major(dev), minor(dev));
  if (FILE* f = std::fopen(path, "r")) {  // partitions: the parent's queue
    unsigned long v = 0;
    int n = std::fscanf(f, "%lu", &v);
    std::fclose(f);
    if (n == 1 && v >= 512 && (v & (v - 1)) == 0) return v;
  }
  std::snprintf(path, sizeof path, "/dev/block/%u:%u", major(dev), minor(dev));
  int bfd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (bfd >= 0) {
    int ssz = 0;
    int rc = ::ioctl(bfd, BLKSSZGET, &ssz);
    ::close(bfd);
    if (rc == 0 && ssz >= 512 && (ssz & (ssz - 1)) == 0) return static_cast<uint64_t>(ssz);
  }
  return 4096;
}

const char* file_type_name(mode_t m) {
  return S_ISDIR(m) ? "directory" : S_ISFIFO(m) ? "FIFO" : S_ISSOCK(m) ? "socket"
       : S_ISCHR(m) ? "character device" : S_ISBLK(m) ? "block device" : "special file";
}
}  // namespace

void detail::set_refuse_direct_for_tests(bool refuse) { g_refuse_direct = refuse; }
void detail::set_refuse_fallocate_for_tests(bool refuse) { g_refuse_fallocate = refuse; }

DirectFile::DirectFile(const std::string& path, Mode mode, bool want_direct, uint64_t max_direct_align,
                       std::string what)
    : path_(path), label_(path), what_(std::move(what)) {
  const bool write = mode == Mode::kCreate;
  const auto slash = path.rfind('/');
  dir_ = slash == std::string::npos ? "." : path.substr(0, slash);
  int flags = O_CLOEXEC | (write ? (O_WRONLY | O_CREAT | O_EXCL) : (O_RDONLY | O_NOFOLLOW | O_NONBLOCK));
  fd_ = ::open(path.c_str(), flags, 0644);
  if (fd_ < 0) {
    int e = errno;
    if (!write && e == ELOOP)
      throw InvalidArgument(ebbtide::detail::concat(path, ": ", what_, " is a symbolic link; only regular files are read"));
    throw IoError(e, path, -1,
                  e == EROFS    ? ebbtide::detail::concat("cannot create the ", what_, ": read-only filesystem")
                  : e == EACCES ? ebbtide::detail::concat("cannot open the ", what_, ": permission denied")
                  : e == ENOENT ? (write ? ebbtide::detail::concat("cannot create the ", what_, ": no such directory")
                                         : ebbtide::detail::concat(what_, " does not exist"))
                                : ebbtide::detail::concat(write ? "cannot create the " : "cannot open the ", what_));
  }
  struct stat st {};
  if (!write) {  // Note [Regular files only]
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
      throw InvalidArgument(ebbtide::detail::concat(path, ": ", what_, " is not a regular file (it is a ",
                                                    file_type_name(st.st_mode), "); only regular files are read"));
    }
    if (::fcntl(fd_, F_SETFL, fl & ~O_NONBLOCK) != 0) {
      int e = errno;
      ::close(fd_);
      fd_ = -1;
      throw_io_error(e, path, -1, "fcntl(F_SETFL)");
    }
  } else if (::fstat(fd_, &st) != 0) {
    st.st_dev = 0;
  }
  dev_ = st.st_dev;
  if (want_direct) enable_direct(max_direct_align);
}

std::unique_ptr<DirectFile> DirectFile::create_anonymous(const std::string& dir, bool want_direct) {
  std::unique_ptr<DirectFile> f(new DirectFile());
  f->what_ = "slab";
  f->open_anonymous(dir);
  if (want_direct) f->enable_direct();
  return f;
}

void DirectFile::open_anonymous(const std::string& dir) {
  dir_ = dir;
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    int e = errno;
    throw IoError(e, dir, -1,
                  e == ENOENT         ? "slab directory does not exist"
                  : e == ENAMETOOLONG ? "slab directory path is too long"
                                      : "cannot access slab directory");
  }
  if (!S_ISDIR(st.st_mode)) throw IoError(ENOTDIR, dir, -1, "slab path is not a directory");
  std::error_code ec;
  auto canon = std::filesystem::canonical(dir, ec);
  if (!ec) dir_ = canon.string();

  fd_ = ::open(dir_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd_ < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    // No O_TMPFILE here: a random name, unlinked as soon as it is open.
    std::random_device rd;
    for (int attempt = 0; attempt < 16 && fd_ < 0; ++attempt) {
      std::string name = ebbtide::detail::concat(dir_, "/.ebbtide-slab-", ::getpid(), "-", rd());
      fd_ = ::open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
      if (fd_ >= 0) ::unlink(name.c_str());
      else if (errno != EEXIST) break;
    }
  }
  if (fd_ < 0) {
    int e = errno;
    throw IoError(e, dir_, -1,
                  e == EROFS    ? "cannot create the slab file: the directory is on a read-only filesystem"
                  : e == EACCES ? "cannot create the slab file: permission denied on the directory"
                                : "cannot create the slab file in the directory");
  }
  label_ = dir_ + "/<ebbtide slab>";
  struct stat fst {};
  if (::fstat(fd_, &fst) == 0) dev_ = fst.st_dev;
}

void DirectFile::enable_direct(uint64_t max_direct_align) {
  const int fl = ::fcntl(fd_, F_GETFL);
  const int rc = g_refuse_direct ? (errno = EINVAL, -1) : ::fcntl(fd_, F_SETFL, fl | O_DIRECT);
  if (rc != 0) {
    log::warn_once("odirect:" + dir_,
                   ebbtide::detail::concat("O_DIRECT refused in ", dir_, " (", std::strerror(errno),
                                           "): using buffered I/O there (page cache in the way; tmpfs "
                                           "or a filesystem without direct I/O)"));
    return;
  }
  uint32_t mem = 0, off = 0;
  uint64_t mem_align = 0, offset_align = 0;
  if (detail::query_dio_align(fd_, &mem, &off) && off > 0) {
    mem_align = std::max<uint64_t>(mem, 512);
    offset_align = off;
  } else {
    mem_align = offset_align = block_device_sector_size(dev_);
  }
  if (max_direct_align > 0 && (mem_align > max_direct_align || offset_align > max_direct_align)) {
    ::fcntl(fd_, F_SETFL, fl);
    log::warn_once("dioalign:" + label_, ebbtide::detail::concat("O_DIRECT on ", label_, " needs ",
                                                                 std::max(mem_align, offset_align),
                                                                 "-byte alignment: using buffered I/O"));
    return;
  }
  direct_ = true;
  mem_align_ = mem_align;
  offset_align_ = offset_align;
}

DirectFile::~DirectFile() {
  if (fd_ >= 0) ::close(fd_);
}

void DirectFile::grow_to(uint64_t new_size) {
  if (new_size <= allocated_) return;
  int rc = g_refuse_fallocate ? (errno = EOPNOTSUPP, -1)
                              : ::fallocate(fd_, 0, static_cast<off_t>(allocated_),
                                            static_cast<off_t>(new_size - allocated_));
  if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) {
    log::warn_once("fallocate:" + dir_,
                   ebbtide::detail::concat("fallocate unsupported in ", dir_,
                                           ": growing the file with ftruncate (sparse; ENOSPC may come at write time)"));
    rc = ::ftruncate(fd_, static_cast<off_t>(new_size));
  }
  if (rc != 0) {
    int e = errno;
    // Give back what a partial fallocate may have taken.
    if (::ftruncate(fd_, static_cast<off_t>(allocated_)) != 0) { /* best effort */ }
    throw IoError(e, dir_, static_cast<int64_t>(allocated_),
                  ebbtide::detail::concat("cannot grow the ", what_, " in ", dir_, " from ", allocated_, " to ",
                                          new_size, " bytes", e == ENOSPC ? " (no space left on the device)" : ""));
  }
  allocated_ = new_size;
}

uint64_t DirectFile::size() const {
  struct stat st {};
  EBB_SYSCALL(::fstat(fd_, &st), label_, -1);
  return static_cast<uint64_t>(st.st_size);
}

void DirectFile::sync() const { EBB_SYSCALL(::fdatasync(fd_), label_, -1); }

void read_exact(const DirectFile& f, void* buf, uint64_t len, uint64_t off) {
  uint64_t done = 0;
  auto* p = static_cast<char*>(buf);
  while (done < len) {
    ssize_t r = ::pread(f.fd(), p + done, len - done, static_cast<off_t>(off + done));
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw_io_error(errno, f.label(), static_cast<int64_t>(off + done), "pread");
    }
    if (r == 0)
      throw IoError(ENODATA, f.label(), static_cast<int64_t>(off + done),
                    ebbtide::detail::concat("unexpected end of file (truncated ", f.what(), ")"));
    done += static_cast<uint64_t>(r);
  }
}

}  // namespace ebbtide::io
