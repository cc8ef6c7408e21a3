// Internal: one slab file per target directory. See Note [Slab files] in slab.cpp.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace ebbtide::io::detail {

class SlabFile {
 public:
  // Creates the anonymous slab in `dir`. Throws IoError naming the directory.
  SlabFile(const std::string& dir, bool want_direct);
  ~SlabFile();
  SlabFile(const SlabFile&) = delete;
  SlabFile& operator=(const SlabFile&) = delete;

  // Extends the file to `new_size` bytes (fallocate, or ftruncate where
  // fallocate is unsupported). IoError(ENOSPC) naming the directory.
  void grow_to(uint64_t new_size);

  const std::string& dir() const { return dir_; }
  const std::string& label() const { return label_; }  // for error messages
  int fd() const { return fd_; }
  dev_t device() const { return dev_; }
  bool direct() const { return direct_; }
  uint64_t mem_align() const { return mem_align_; }
  uint64_t offset_align() const { return offset_align_; }
  uint64_t size() const { return size_; }
  bool anonymous() const { return anonymous_; }

 private:
  std::string dir_, label_;
  int fd_ = -1;
  dev_t dev_ = 0;
  bool direct_ = false;
  bool anonymous_ = true;  // O_TMPFILE (else created and unlinked at once)
  uint64_t mem_align_ = 4096, offset_align_ = 4096;
  uint64_t size_ = 0;
};

// Test hook: pretend every filesystem refuses O_DIRECT (EINVAL), as tmpfs did
// before Linux 6.6.
void set_refuse_direct_for_tests(bool refuse);
// Test hook: pretend fallocate is unsupported (EOPNOTSUPP): slabs grow sparse.
void set_refuse_fallocate_for_tests(bool refuse);

}  // namespace ebbtide::io::detail
