// Note [Slab files]
// Each target directory holds one slab file that never has a name: O_TMPFILE
// (or, where the filesystem lacks it, create + unlink right after open), mode
// 0600, so a killed process leaves nothing behind. O_DIRECT is switched on with
// fcntl(F_SETFL) after creation, which fails with EINVAL exactly where open()
// with O_DIRECT would (tmpfs before 6.6, some FUSE mounts); there we fall back
// to buffered I/O and warn once naming the directory. The O_DIRECT alignment
// comes from statx(STATX_DIOALIGN) (Linux 6.1+), else the block device's
// logical sector size (BLKSSZGET), else 4096. The slab grows with fallocate in
// slab_grow_bytes steps so writes land in allocated extents; where fallocate
// is unsupported we grow with ftruncate (sparse) and say so once.
#include "slab.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io::detail {

// statx with the kernel's struct layout (glibc 2.36 lacks the DIO fields).
bool query_dio_align(int fd, uint32_t* mem_align, uint32_t* offset_align);

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
}  // namespace

void set_refuse_direct_for_tests(bool refuse) { g_refuse_direct = refuse; }
void set_refuse_fallocate_for_tests(bool refuse) { g_refuse_fallocate = refuse; }

SlabFile::SlabFile(const std::string& dir, bool want_direct) : dir_(dir) {
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
    anonymous_ = false;
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

  if (want_direct) {
    int flags = ::fcntl(fd_, F_GETFL);
    int rc = g_refuse_direct ? (errno = EINVAL, -1) : ::fcntl(fd_, F_SETFL, flags | O_DIRECT);
    if (rc == 0) {
      direct_ = true;
    } else {
      log::warn_once("odirect:" + dir_,
                     ebbtide::detail::concat("O_DIRECT refused in ", dir_, " (", std::strerror(errno),
                                    "): using buffered I/O there (page cache in the way; tmpfs "
                                    "or a filesystem without direct I/O)"));
    }
  }
  if (direct_) {
    uint32_t mem = 0, off = 0;
    if (query_dio_align(fd_, &mem, &off) && off > 0) {
      mem_align_ = std::max<uint64_t>(mem, 512);
      offset_align_ = off;
    } else {
      mem_align_ = offset_align_ = block_device_sector_size(dev_);
    }
  } else {
    mem_align_ = offset_align_ = 1;
  }
}

SlabFile::~SlabFile() {
  if (fd_ >= 0) ::close(fd_);
}

void SlabFile::grow_to(uint64_t new_size) {
  if (new_size <= size_) return;
  int rc = g_refuse_fallocate ? (errno = EOPNOTSUPP, -1)
                               : ::fallocate(fd_, 0, static_cast<off_t>(size_), static_cast<off_t>(new_size - size_));
  if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) {
    log::warn_once("fallocate:" + dir_,
                   ebbtide::detail::concat("fallocate unsupported in ", dir_,
                                  ": growing the slab with ftruncate (sparse; ENOSPC may come at write time)"));
    rc = ::ftruncate(fd_, static_cast<off_t>(new_size));
  }
  if (rc != 0) {
    int e = errno;
    // Give back what a partial fallocate may have taken.
    if (::ftruncate(fd_, static_cast<off_t>(size_)) != 0) { /* best effort */ }
    throw IoError(e, dir_, static_cast<int64_t>(size_),
                  ebbtide::detail::concat("cannot grow the slab in ", dir_, " from ", size_, " to ", new_size,
                                 " bytes", e == ENOSPC ? " (no space left on the device)" : ""));
  }
  size_ = new_size;
}

}  // namespace ebbtide::io::detail
