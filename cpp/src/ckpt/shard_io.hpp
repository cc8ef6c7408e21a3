// Internal: shard files and the loop that drives asynchronous transfers for
// the checkpoint writer and reader (depth-bounded, short transfers resumed,
// errors collected and rethrown naming the file and offset).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ebbtide/io/engine.hpp"

namespace ebbtide::ckpt::detail {

// An open shard file; O_DIRECT when asked for and the filesystem allows it.
class ShardFile {
 public:
  // write: creates `path` (O_EXCL); read: opens it. IoError naming the path.
  ShardFile(const std::string& path, bool write, bool want_direct);
  ~ShardFile();
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;
  int fd() const { return fd_; }
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }
  uint64_t size() const;
  void sync() const;  // fdatasync; IoError naming the path
  // Switches to O_DIRECT where the filesystem allows it (logs once where it
  // does not); what the constructor does with `want_direct`.
  void enable_direct();

 private:
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
};

class TransferLoop {
 public:
  // `fixed`: pinned buffers registered with the ring (buf_index refers to them).
  // kAuto tries io_uring and falls back to the POSIX pool; kUring throws
  // Unsupported when io_uring is unavailable.
  TransferLoop(unsigned depth, const std::vector<iovec>& fixed, io::BackendKind kind);
  ~TransferLoop();  // waits for transfers in flight
  TransferLoop(const TransferLoop&) = delete;
  TransferLoop& operator=(const TransferLoop&) = delete;

  // Queues one transfer; blocks while `depth` are outstanding. `on_done` runs
  // on the calling thread (inside submit/drain) when it completes successfully.
  // `need` (reads; 0 = len): the transfer is complete once that many bytes
  // are in, so an O_DIRECT read of a file's last block may ask for the whole
  // block and stop at the end of the file.
  void submit(const ShardFile& file, bool write, void* buf, uint64_t len, uint64_t offset,
              int buf_index, std::function<void()> on_done = {}, uint64_t need = 0);
  // Runs the callbacks of finished transfers; with `block`, waits for at
  // least one when any is outstanding. Rethrows the first error.
  void poll(bool block);
  // Waits for every transfer; rethrows the first error (IoError naming file and offset).
  void drain();
  std::string describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Reads exactly `len` bytes at `offset` (pread, any thread); IoError naming
// the file and offset, ENODATA at end of file.
void read_exact(const ShardFile& file, void* buf, uint64_t len, uint64_t offset);

// Faults in the pages of `ranges` (page-aligned destinations of reads in
// place), in order, on a thread of its own while the reads run (Note
// [Populate ahead] in shard_io.cpp); stops and joins on destruction. The
// ranges must stay mapped until then.
class PagePopulator {
 public:
  explicit PagePopulator(std::vector<std::pair<char*, uint64_t>> ranges);
  ~PagePopulator();
  PagePopulator(const PagePopulator&) = delete;
  PagePopulator& operator=(const PagePopulator&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Splits [offset, offset+len) of a contiguous pinned region made of equal
// segments (registered one iovec each) so that no piece crosses a segment.
struct Piece {
  uint64_t offset, len;
  int buf_index;
};
std::vector<Piece> split_by_segment(uint64_t region_offset, uint64_t len, uint64_t segment_bytes,
                                    bool registered);

}  // namespace ebbtide::ckpt::detail
