// The I/O benchmark: timed write of total_bytes in request_bytes requests, a
// timed read back, then (untimed) a verifying read. Each 4 KiB block of a
// request carries a stamp (request, block) over random bytes so a misplaced
// or stale block is caught, not only a corrupted one.
//
// Note [Bench buffers]
// How many requests a block device holds at once can depend on how many
// physically separate pieces each request's memory has. virtio-blk without
// indirect descriptors (VIRTIO_RING_F_INDIRECT_DESC) spends one ring
// descriptor per piece: a 1 MiB transfer from 4 KiB pages needs up to 256, so
// the ring holds a request or two and the device runs near queue depth 1
// whatever the engine submits (the block layer requeues the rest).
// So the request buffers ask for transparent huge pages (MADV_HUGEPAGE),
// and the result says whether they got them; a comparison with another
// tool (fio) must give it buffers of the same kind.
#include "ebbtide/io/bench.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/host_mapping.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io {
namespace {

constexpr uint64_t kBlock = 4096;

// Anonymous memory; with `huge`, 2 MiB aligned and advised MADV_HUGEPAGE
// before it is touched (Note [Bench buffers], Note [Huge-page buffers] in
// mem/host_mapping.cpp).
struct MappedBuffer {
  MappedBuffer(uint64_t n, bool huge) : map_(n, "benchmark buffer", false, huge), n_(n) {}
  unsigned char* data() const { return static_cast<unsigned char*>(map_.data()); }
  // Bytes of [data(), data() + n) backed by huge pages now (/proc/self/smaps).
  uint64_t huge_bytes() const {
    std::ifstream smaps("/proc/self/smaps");
    std::string line;
    const auto lo = reinterpret_cast<uintptr_t>(map_.data()), hi = lo + n_;
    bool mine = false;
    uint64_t total = 0;
    while (std::getline(smaps, line)) {
      uintptr_t start = 0, end = 0;
      if (std::sscanf(line.c_str(), "%lx-%lx ", &start, &end) == 2 && line.find(':') > line.find(' ')) {
        mine = start < hi && end > lo;
      } else if (mine && line.rfind("AnonHugePages:", 0) == 0) {
        total += std::stoull(line.substr(14)) << 10;
      }
    }
    return total;
  }
  mem::HostMapping map_;
  uint64_t n_;
};

// Flushes the filesystem of each directory (syncfs); failures only logged:
// the flush only keeps the device's write-back out of the timed read.
void flush_dirs(const std::vector<std::string>& dirs) {
  for (const auto& d : dirs) {
    int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || ::syncfs(fd) != 0) log::warn("bench io: syncfs of ", d, " failed: ", std::strerror(errno));
    if (fd >= 0) ::close(fd);
  }
}

uint64_t stamp_of(uint64_t request, uint64_t block) { return (request << 32) ^ block ^ 0x9e3779b97f4a7c15ull; }

void stamp(unsigned char* buf, uint64_t n, uint64_t request) {
  for (uint64_t off = 0, b = 0; off + 8 <= n; off += kBlock, ++b) {
    uint64_t s = stamp_of(request, b);
    std::memcpy(buf + off, &s, 8);
  }
}

bool check(const unsigned char* buf, const unsigned char* pattern, uint64_t n, uint64_t request) {
  for (uint64_t off = 0, b = 0; off < n; off += kBlock, ++b) {
    const uint64_t len = std::min(kBlock, n - off);
    if (len >= 8) {
      uint64_t s = 0;
      std::memcpy(&s, buf + off, 8);
      if (s != stamp_of(request, b)) return false;
      if (std::memcmp(buf + off + 8, pattern + off + 8, len - 8) != 0) return false;
    } else if (std::memcmp(buf + off, pattern + off, len) != 0) {
      return false;
    }
  }
  return true;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}


// Device->file and file->device through device pointers (the staged CUDA path
// or cuFile), over the same slots, with bufs_in_flight device buffers holding
// `pattern`; verifies the last buffers read back. Leaves res untouched
// without a CUDA driver.
void run_device_passes(Engine& engine, const std::vector<SlotId>& slots,
                       const std::vector<uint64_t>& sizes, size_t bufs_in_flight,
                       const unsigned char* pattern, BenchResult& res) {
  auto* drv = mem::cuda::driver();
  if (drv == nullptr) {
    log::info("bench io: device transfers not measured: ", mem::cuda::unavailable_reason());
    return;
  }
  drv->bind_device(0);
  const uint64_t request = sizes.front();
  std::vector<mem::cuda::DevicePtr> dev(std::min<size_t>(bufs_in_flight, slots.size()));
  for (auto& d : dev) {
    d = drv->mem_alloc(request);
    drv->memcpy_htod_async(d, pattern, request, 0);
  }
  drv->stream_synchronize(0);
  auto pass = [&](bool write) {
    std::deque<Request> inflight;
    auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < slots.size(); ++i) {
      if (inflight.size() == dev.size()) {
        inflight.front().wait();
        inflight.pop_front();
      }
      mem::Buffer b{reinterpret_cast<void*>(dev[i % dev.size()]), sizes[i], 0, 0};
      inflight.push_back(write ? engine.write(slots[i], b) : engine.read(slots[i], b));
    }
    for (auto& r : inflight) r.wait();
    return seconds_since(t0);
  };
  const double total = static_cast<double>(std::accumulate(sizes.begin(), sizes.end(), uint64_t{0}));
  const double w = pass(true);
  const double r = pass(false);
  res.device_write_gbps = w > 0 ? total / w / 1e9 : 0;
  res.device_read_gbps = r > 0 ? total / r / 1e9 : 0;
  std::vector<unsigned char> host(request);
  bool ok = true;
  for (size_t k = 0; k < dev.size(); ++k) {
    const size_t i = slots.size() - 1 - k;  // last requests read went to dev[i % n]
    drv->memcpy_dtoh_async(host.data(), dev[i % dev.size()], sizes[i], 0);
    drv->stream_synchronize(0);
    ok = ok && std::memcmp(host.data(), pattern, sizes[i]) == 0;
  }
  for (auto d : dev) drv->mem_free(d);
  res.device_measured = true;
  res.verified = res.verified && ok;
}

}  // namespace

BenchResult run_io_bench(const BenchOptions& o) {
  EBB_CHECK(!o.dirs.empty(), "bench io: at least one directory is needed");
  EBB_CHECK(o.total_bytes > 0, "bench io: size must be positive");
  EBB_CHECK(o.request_bytes > 0, "bench io: request size must be positive");
  EBB_CHECK(o.queue_depth > 0, "bench io: queue depth must be positive");

  EngineOptions eo;
  eo.dirs = o.dirs;
  eo.backend = o.backend;
  eo.chunk_bytes = o.chunk_bytes;
  eo.queue_depth = o.queue_depth;
  eo.checksum = o.checksum;
  const uint64_t per_dir = (o.total_bytes + o.dirs.size() - 1) / o.dirs.size();
  eo.slab_grow_bytes = std::max<uint64_t>(o.chunk_bytes, per_dir);  // one fallocate, before timing
  Engine engine(eo);

  const uint64_t request = std::min(o.request_bytes, o.total_bytes);
  const uint64_t nreq = (o.total_bytes + request - 1) / request;
  std::vector<SlotId> slots;
  std::vector<uint64_t> sizes;
  for (uint64_t i = 0; i < nreq; ++i) {
    sizes.push_back(std::min(request, o.total_bytes - i * request));
    slots.push_back(engine.allocate(sizes.back()));
  }

  // Enough buffers to keep every device's queue full across request boundaries.
  const uint64_t want = 2 * o.queue_depth * o.chunk_bytes * o.dirs.size();
  const uint64_t nbuf = std::clamp<uint64_t>((want + request - 1) / request + 1, 2, 64);
  MappedBuffer pattern(request, false);
  {
    uint64_t x = 0x243f6a8885a308d3ull;
    for (uint64_t i = 0; i + 8 <= request; i += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::memcpy(pattern.data() + i, &x, 8);
    }
  }
  std::vector<std::unique_ptr<MappedBuffer>> bufs;
  for (uint64_t i = 0; i < std::min(nbuf, nreq); ++i) {
    bufs.push_back(std::make_unique<MappedBuffer>(request, o.huge_pages));
    std::memcpy(bufs.back()->data(), pattern.data(), request);
  }

  // Runs requests 0..nreq-1 with up to bufs.size() in flight; `before` prepares
  // buffer b for request i, `after` inspects it once request i completed.
  auto pass = [&](bool write, auto&& before, auto&& after) {
    std::deque<std::pair<uint64_t, Request>> inflight;  // request index, handle
    for (uint64_t i = 0; i < nreq; ++i) {
      if (inflight.size() == bufs.size()) {
        auto [j, r] = inflight.front();
        inflight.pop_front();
        r.wait();
        after(j, *bufs[j % bufs.size()]);
      }
      auto& b = *bufs[i % bufs.size()];
      before(i, b);
      mem::Buffer buf{b.data(), sizes[i]};
      inflight.emplace_back(i, write ? engine.write(slots[i], buf) : engine.read(slots[i], buf));
    }
    while (!inflight.empty()) {
      auto [j, r] = inflight.front();
      inflight.pop_front();
      r.wait();
      after(j, *bufs[j % bufs.size()]);
    }
  };
  auto nothing = [](uint64_t, MappedBuffer&) {};

  BenchResult res;
  auto t0 = std::chrono::steady_clock::now();
  pass(true, [&](uint64_t i, MappedBuffer& b) { stamp(b.data(), sizes[i], i); }, nothing);
  res.write_seconds = seconds_since(t0);
  flush_dirs(o.dirs);

  t0 = std::chrono::steady_clock::now();
  pass(false, nothing, nothing);
  res.read_seconds = seconds_since(t0);

  if (o.verify) {
    bool ok = true;
    pass(false, [](uint64_t, MappedBuffer& b) { std::memset(b.data(), 0, b.n_); },
         [&](uint64_t i, MappedBuffer& b) { ok = ok && check(b.data(), pattern.data(), sizes[i], i); });
    res.verified = ok;
  }

  auto st = engine.stats();
  res.backend = st.backend;
  res.describe = engine.describe();
  res.direct = st.direct;
  res.alignment = st.alignment;
  res.huge_pages = o.huge_pages && std::all_of(bufs.begin(), bufs.end(), [](const auto& b) {
    const uint64_t want = b->n_ / mem::HostMapping::kHugePage * mem::HostMapping::kHugePage;
    return want > 0 && b->huge_bytes() >= want;
  });
  res.bytes = o.total_bytes;
  res.write_gbps = res.write_seconds > 0 ? o.total_bytes / res.write_seconds / 1e9 : 0;
  res.read_gbps = res.read_seconds > 0 ? o.total_bytes / res.read_seconds / 1e9 : 0;
  if (o.device) run_device_passes(engine, slots, sizes, bufs.size(), pattern.data(), res);
  for (auto s : slots) engine.free(s);
  return res;
}

}  // namespace ebbtide::io
