#include "shard_io.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <mutex>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/io/faults.hpp"
#include "ebbtide/util/error.hpp"
#include "workers.hpp"

namespace ebbtide::ckpt {

void inject_write_fault(uint64_t after_bytes, int err) { io::inject_file_write_fault(after_bytes, err); }

namespace detail {

std::unique_ptr<io::DirectFile> open_shard(const std::string& path, bool write, bool want_direct, const char* what) {
  return std::make_unique<io::DirectFile>(path, write ? io::DirectFile::Mode::kCreate : io::DirectFile::Mode::kRead,
                                          want_direct, kBlockBytes, what);
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

std::vector<iovec> buffers_of(const mem::PinnedPool& pool) {
  std::vector<iovec> v;
  for (size_t i = 0; i < pool.count(); ++i) v.push_back({pool.buffer(i), pool.buffer_bytes()});
  return v;
}

void pipelined_reads(size_t n, const std::function<PipelinedRead(size_t)>& read, io::TransferLoop& loop,
                     mem::PinnedPool* staging, unsigned threads,
                     const std::function<void(size_t, const char*)>& process) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> free_slots;
  for (int i = staging ? static_cast<int>(staging->count()) - 1 : -1; i >= 0; --i) free_slots.push_back(i);
  size_t pending = 0;     // reads with the workers
  size_t slots_held = 0;  // staging buffers among them
  std::exception_ptr error;
  {
    Workers pool(threads);
    auto hand_off = [&](size_t i, int slot, const char* buf) {
      {
        std::lock_guard lock(mu);
        ++pending;
        if (slot >= 0) ++slots_held;
      }
      pool.post([&, i, slot, buf] {
        std::exception_ptr e;
        try {
          process(i, buf);
        } catch (...) {
          e = std::current_exception();
        }
        std::lock_guard lock(mu);
        if (e && !error) error = e;
        if (slot >= 0) {
          free_slots.push_back(slot);
          --slots_held;
        }
        --pending;
        cv.notify_all();
      });
    };
    try {
      for (size_t i = 0; i < n; ++i) {
        const PipelinedRead r = read(i);
        {
          std::lock_guard lock(mu);
          if (error) std::rethrow_exception(error);
        }
        if (r.in_place != nullptr) {
          char* dst = r.in_place;
          loop.submit(*r.file, false, dst, r.len, r.offset, -1, [&, i, dst] { hand_off(i, -1, dst); }, r.need);
          continue;
        }
        EBB_CHECK(staging != nullptr, "pipelined_reads: a staged read without staging buffers");
        int slot = -1;
        for (;;) {
          {
            std::unique_lock lock(mu);
            if (error) std::rethrow_exception(error);
            if (!free_slots.empty()) {
              slot = free_slots.back();
              free_slots.pop_back();
              break;
            }
            if (slots_held > 0) {  // buffers are with the workers
              cv.wait(lock, [&] { return !free_slots.empty() || error; });
              continue;
            }
          }
          loop.poll(true);
        }
        char* buf = static_cast<char*>(staging->buffer(static_cast<size_t>(slot)));
        loop.submit(*r.file, false, buf, r.len, r.offset, slot, [&, i, slot, buf] { hand_off(i, slot, buf); }, r.need);
      }
      loop.drain();
    } catch (...) {
      std::lock_guard lock(mu);
      if (!error) error = std::current_exception();
    }
    try {
      loop.drain();
    } catch (...) {
    }
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return pending == 0; });
  }
  if (error) std::rethrow_exception(error);
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
