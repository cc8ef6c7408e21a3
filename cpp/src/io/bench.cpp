// The I/O benchmark: timed write of total_bytes in request_bytes requests, a
// timed read back, then (untimed) a verifying read. Each 4 KiB block of a
// request carries a stamp (request, block) over random bytes so a misplaced
// or stale block is caught, not only a corrupted one.
#include "ebbtide/io/bench.hpp"

#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <deque>

#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io {
namespace {

constexpr uint64_t kBlock = 4096;

struct MappedBuffer {
  explicit MappedBuffer(uint64_t n) : n_(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw_io_error(errno, "", -1, "mmap (benchmark buffer)");
    p_ = static_cast<unsigned char*>(p);
  }
  ~MappedBuffer() { ::munmap(p_, n_); }
  MappedBuffer(const MappedBuffer&) = delete;
  MappedBuffer& operator=(const MappedBuffer&) = delete;
  unsigned char* data() const { return p_; }
  unsigned char* p_;
  uint64_t n_;
};

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
  MappedBuffer pattern(request);
  {
    uint64_t x = 0x243f6a8885a308d3ull;
    for (uint64_t i = 0; i + 8 <= request; i += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::memcpy(pattern.data() + i, &x, 8);
    }
  }
  std::vector<std::unique_ptr<MappedBuffer>> bufs;
  for (uint64_t i = 0; i < std::min(nbuf, nreq); ++i) {
    bufs.push_back(std::make_unique<MappedBuffer>(request));
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
      Buffer buf{b.data(), sizes[i]};
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
  res.bytes = o.total_bytes;
  res.write_gbps = res.write_seconds > 0 ? o.total_bytes / res.write_seconds / 1e9 : 0;
  res.read_gbps = res.read_seconds > 0 ? o.total_bytes / res.read_seconds / 1e9 : 0;
  // Device transfers need the CUDA staging path (mem area); without it the
  // device columns stay unmeasured rather than guessed.
  res.device_measured = false;
  for (auto s : slots) engine.free(s);
  return res;
}

}  // namespace ebbtide::io
