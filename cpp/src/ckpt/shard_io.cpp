#include "shard_io.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/io/faults.hpp"

namespace ebbtide::ckpt {

void inject_write_fault(uint64_t after_bytes, int err) { io::inject_file_write_fault(after_bytes, err); }

namespace detail {

std::unique_ptr<io::DirectFile> open_shard(const std::string& path, bool write, bool want_direct) {
  return std::make_unique<io::DirectFile>(path, write ? io::DirectFile::Mode::kCreate : io::DirectFile::Mode::kRead,
                                          want_direct, kBlockBytes, "checkpoint shard");
}

void enable_direct(io::DirectFile& file) { file.enable_direct(kBlockBytes); }

// Note [Populate ahead]
// Destinations read in place are usually fresh anonymous memory
// (checkpoint.load and load_safetensors map new storages): the first touch
// of each page is a fault, taken inside io_uring's submission (or the POSIX
// worker) while it pins the pages, in series with the I/O. A populator thread walks the destination ranges in
// submission order and faults their pages in with MADV_POPULATE_WRITE (which
// keeps contents, so it may race the reads) on another core,
// so the faults overlap the I/O instead of adding to it. Kernels without it (EINVAL,
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

}  // namespace detail
}  // namespace ebbtide::ckpt
