// One file moved with direct I/O: O_DIRECT where the filesystem allows it,
// buffered I/O (and one warning naming the directory) where it does not. The
// engine's slabs and the checkpoint files are both DirectFiles. See Note
// [Direct files] in direct_file.cpp. Not thread safe except fd() and the
// const readers, which any thread may use while no one grows the file.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

namespace ebbtide::io {

class DirectFile {
 public:
  enum class Mode {
    kCreate,  // a new file (O_EXCL), write only
    kRead,    // an existing regular file (Note [Regular files only]), read only
  };

  // Opens `path`. `what` names the file in errors ("checkpoint shard").
  // O_DIRECT when `want_direct` and the filesystem allows it with offset and
  // memory alignment <= `max_direct_align` (0: any). IoError naming the path;
  // InvalidArgument when a file to read is a symlink or not a regular file.
  DirectFile(const std::string& path, Mode mode, bool want_direct, uint64_t max_direct_align = 0,
             std::string what = "file");
  // Creates a file without a name in `dir` (O_TMPFILE, else created and
  // unlinked at once), read-write. IoError naming the directory.
  static std::unique_ptr<DirectFile> create_anonymous(const std::string& dir, bool want_direct);
  ~DirectFile();
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;

  // Switches to O_DIRECT where the filesystem allows it (what the constructor
  // does with `want_direct`); logs once per directory where it does not.
  void enable_direct(uint64_t max_direct_align = 0);
  // Extends the file to `new_size` bytes (fallocate, or ftruncate where
  // fallocate is unsupported). IoError(ENOSPC) naming the directory.
  void grow_to(uint64_t new_size);
  void sync() const;      // fdatasync; IoError naming the file
  uint64_t size() const;  // fstat; IoError naming the file

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }    // "" for an anonymous file
  const std::string& dir() const { return dir_; }      // canonical for an anonymous file
  const std::string& label() const { return label_; }  // the file in error messages
  const std::string& what() const { return what_; }
  bool anonymous() const { return path_.empty(); }
  dev_t device() const { return dev_; }
  bool direct() const { return direct_; }
  uint64_t mem_align() const { return mem_align_; }     // 1 when buffered
  uint64_t offset_align() const { return offset_align_; }
  uint64_t allocated() const { return allocated_; }     // what grow_to reached

 private:
  DirectFile() = default;
  void open_anonymous(const std::string& dir);

  std::string path_, dir_, label_, what_;
  int fd_ = -1;
  dev_t dev_ = 0;
  bool direct_ = false;
  uint64_t mem_align_ = 1, offset_align_ = 1;
  uint64_t allocated_ = 0;
};

// Reads exactly `len` bytes at `offset` (pread, any thread); IoError naming
// the file and offset, ENODATA at end of file.
void read_exact(const DirectFile& file, void* buf, uint64_t len, uint64_t offset);

namespace detail {
// Test hook: pretend every filesystem refuses O_DIRECT (EINVAL), as tmpfs did
// before Linux 6.6.
void set_refuse_direct_for_tests(bool refuse);
// Test hook: pretend fallocate is unsupported (EOPNOTSUPP): files grow sparse.
void set_refuse_fallocate_for_tests(bool refuse);
}  // namespace detail

}  // namespace ebbtide::io
