// Internal: opening checkpoint files as io::DirectFiles, and helpers around
// the io::TransferLoop transfers of the checkpoint writer and reader.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ebbtide/io/direct_file.hpp"
#include "ebbtide/io/transfer.hpp"

namespace ebbtide::ckpt::detail {

// Opens a checkpoint file: created (O_EXCL) for writing, or a regular file
// for reading (Note [Regular files only] in io/direct_file.cpp); O_DIRECT
// when asked for and the device's alignment fits the format's 4 KiB blocks.
// IoError naming the path.
std::unique_ptr<io::DirectFile> open_shard(const std::string& path, bool write, bool want_direct);
// Switches an open checkpoint file to O_DIRECT under the same rule.
void enable_direct(io::DirectFile& file);

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
