// target "cpu": offloaded bytes in host memory.
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>
#include <algorithm>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::cache {
namespace {

constexpr size_t kBlobAlign = 64;

// Note [Host staging]
// Device tensors go straight into page-locked blobs: each blob of a device
// put is page-aligned and registered with cuMemHostRegister, so one
// cuMemcpyDtoHAsync (and one HtoD on reload) moves it at full PCIe speed,
// with no extra memcpy. Registration costs about as much as pinning the pages
// once; Note [Blob reuse] keeps freed blobs by size, so from the second step
// on every blob is reused already registered. When registration is refused
// (RLIMIT_MEMLOCK in a container), that blob is ordinary memory and its
// copies go chunk by chunk through the staging pool (mem::PinnedPool),
// which is made on the first such copy. Host tensors use plain blobs and
// memcpy: CPU-only runs never pin memory.
constexpr size_t kStagingBuffers = 4;
constexpr size_t kPageBytes = 4096;

class HostStore final : public Store {
 public:
  explicit HostStore(HostStoreOptions o) : opts_(o) {
    EBB_CHECK(o.staging_bytes >= 4096, "host store: staging_bytes ", o.staging_bytes, " is below 4096");
  }
  ~HostStore() override {
    for (auto& [loc, b] : blobs_) release(b.data, b.pinned);
    for (auto& [key, v] : spare_)
      for (void* p : v) release(p, key.second);
  }

  Location put(const mem::Buffer& src, int /*tier*/) override {
    EBB_CHECK(src.nbytes > 0, "host store: empty put");
    reserve(src.nbytes);  // before copying, so concurrent puts respect the cap
    const bool want_pinned = src.on_device() && opts_.driver != nullptr;
    const size_t alloc = alloc_size(src.nbytes, want_pinned);
    auto [data, pinned] = new_blob(alloc, want_pinned);
    if (data == nullptr) {
      unreserve(src.nbytes);
      throw IoError(ENOMEM, "host memory", 0, detail::concat("host store: cannot allocate ", src.nbytes, " bytes"));
    }
    try {
      copy(data, pinned, src, /*to_device=*/false);
    } catch (...) {
      give_spare(data, alloc, pinned);
      unreserve(src.nbytes);
      throw;
    }
    std::lock_guard<std::mutex> lock(mu_);
    Location loc = next_++;
    blobs_.emplace(loc, Blob{data, src.nbytes, alloc, pinned});
    return loc;
  }

  bool has_tier(int tier) const override { return tier == kTierCpu; }
  int tier_of(Location) const override { return kTierCpu; }

  HostSpace reserve_host(uint64_t nbytes) override {
    EBB_CHECK(nbytes > 0, "host store: empty reservation");
    reserve(nbytes);
    const bool want_pinned = opts_.driver != nullptr;
    const size_t alloc = alloc_size(nbytes, want_pinned);
    auto [data, pinned] = new_blob(alloc, want_pinned);
    if (data == nullptr) {
      unreserve(nbytes);
      throw IoError(ENOMEM, "host memory", 0, detail::concat("host store: cannot allocate ", nbytes, " bytes"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    Location loc = next_++;
    blobs_.emplace(loc, Blob{data, nbytes, alloc, pinned});
    return HostSpace{loc, data, pinned};
  }

  void get(Location loc, const mem::Buffer& dst) override {
    Blob b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = blobs_.find(loc);
      EBB_CHECK_STATE(it != blobs_.end(), "host store: location ", loc, " is not stored");
      b = it->second;
    }
    EBB_CHECK(dst.nbytes == b.nbytes, "host store: location ", loc, " holds ", b.nbytes,
              " bytes, destination has ", dst.nbytes);
    copy(b.data, b.pinned, dst, /*to_device=*/true);
  }

  void free(Location loc) override {
    Blob b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = blobs_.find(loc);
      EBB_CHECK_STATE(it != blobs_.end(), "host store: location ", loc, " freed twice or never stored");
      b = it->second;
      held_ -= b.nbytes;
      blobs_.erase(it);
    }
    give_spare(b.data, b.alloc, b.pinned);
  }

  StoreStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return StoreStats{held_, blobs_.size(), opts_.capacity_bytes, {}};
  }

  std::string describe() const override {
    return detail::concat("host memory (capacity ",
                          opts_.capacity_bytes ? config::format_bytes(double(opts_.capacity_bytes)) : "unlimited",
                          opts_.driver ? ", pinned staging" : "", ")");
  }

 private:
  struct Blob {
    void* data = nullptr;
    uint64_t nbytes = 0;
    size_t alloc = 0;     // bytes allocated (the spare list it returns to)
    bool pinned = false;  // registered with the CUDA driver (Note [Host staging])
  };
  static size_t alloc_size(uint64_t nbytes, bool page) {
    const size_t a = page ? kPageBytes : kBlobAlign;
    return (nbytes + a - 1) / a * a;
  }
  // A spare blob of `alloc` bytes or a new one: (nullptr, false) when out of
  // memory. With `want_pinned`, a plain blob left by an earlier refused
  // registration is reused before a new one is allocated and registered.
  std::pair<void*, bool> new_blob(size_t alloc, bool want_pinned) {
    if (void* p = take_spare(alloc, want_pinned)) return {p, want_pinned};
    if (want_pinned)
      if (void* p = take_spare(alloc, false)) return {p, false};
    void* p = nullptr;
    if (::posix_memalign(&p, want_pinned ? kPageBytes : kBlobAlign, alloc) != 0) return {nullptr, false};
    return {p, want_pinned && opts_.driver->host_register(p, alloc)};  // a refusal is warned once by the shim
  }

  // Note [Blob reuse]: training saves the same shapes every step; keeping
  // freed blobs by exact size (up to the most bytes ever held) spares the
  // allocator's mmap/munmap and the page faults of fresh memory each step.
  void* take_spare(size_t alloc, bool pinned) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = spare_.find({alloc, pinned});
    if (it == spare_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    spare_bytes_ -= alloc;
    return p;
  }
  void give_spare(void* p, size_t alloc, bool pinned) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      high_water_ = std::max<uint64_t>(high_water_, held_ + alloc);
      if (spare_bytes_ + alloc <= high_water_) {
        spare_[{alloc, pinned}].push_back(p);
        spare_bytes_ += alloc;
        return;
      }
    }
    release(p, pinned);
  }
  void release(void* p, bool pinned) {
    if (pinned) {
      try {
        opts_.driver->host_unregister(p);
      } catch (const std::exception& e) {
        log::error("host store: cuMemHostUnregister failed: ", e.what());
      }
    }
    std::free(p);
  }

  // Counts `n` bytes against the capacity; IoError(ENOSPC) past it.
  void reserve(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    if (opts_.capacity_bytes != 0 && held_ + n > opts_.capacity_bytes) {
      throw IoError(ENOSPC, "host memory", static_cast<int64_t>(held_),
                    detail::concat("host store full: ", config::format_bytes(double(held_)), " of ",
                                   config::format_bytes(double(opts_.capacity_bytes)), " held, cannot add ", n,
                                   " bytes"));
    }
    held_ += n;
  }

  void unreserve(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    held_ -= n;
  }

  // Copies between the host blob and `s` in the direction given.
  void copy(void* blob, bool pinned, const mem::Buffer& s, bool to_device) {
    if (!s.on_device()) {
      if (to_device) std::memcpy(s.ptr, blob, s.nbytes);
      else std::memcpy(blob, s.ptr, s.nbytes);
      return;
    }
    if (opts_.driver == nullptr) throw Unsupported("host store: device buffer without a CUDA driver");
    auto* drv = opts_.driver;
    if (pinned) {  // one copy at full speed, on the worker's side stream
      auto dev = reinterpret_cast<mem::cuda::DevicePtr>(s.ptr);
      if (to_device) drv->memcpy_htod_async(dev, blob, s.nbytes, s.stream);
      else drv->memcpy_dtoh_async(blob, dev, s.nbytes, s.stream);
      drv->stream_synchronize(s.stream);
      return;
    }
    mem::PinnedPool& pool = staging();
    mem::PinnedPool::Lease stage = pool.acquire();
    auto* host = static_cast<unsigned char*>(blob);
    auto dev = reinterpret_cast<mem::cuda::DevicePtr>(s.ptr);
    for (uint64_t off = 0; off < s.nbytes; off += stage.size()) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(stage.size(), s.nbytes - off));
      // The staging buffer is reused at the next chunk: wait for each copy.
      if (to_device) {
        std::memcpy(stage.data(), host + off, n);
        drv->memcpy_htod_async(dev + off, stage.data(), n, s.stream);
        drv->stream_synchronize(s.stream);
      } else {
        drv->memcpy_dtoh_async(stage.data(), dev + off, n, s.stream);
        drv->stream_synchronize(s.stream);
        std::memcpy(host + off, stage.data(), n);
      }
    }
  }

  mem::PinnedPool& staging() {
    std::lock_guard<std::mutex> lock(staging_mu_);
    if (!staging_) staging_ = std::make_unique<mem::PinnedPool>(opts_.staging_bytes, kStagingBuffers);
    return *staging_;
  }

  HostStoreOptions opts_;
  std::mutex staging_mu_;
  std::unique_ptr<mem::PinnedPool> staging_;
  mutable std::mutex mu_;
  std::unordered_map<Location, Blob> blobs_;
  Location next_ = 1;
  uint64_t held_ = 0;
  std::map<std::pair<size_t, bool>, std::vector<void*>> spare_;  // (bytes, pinned) -> free blobs
  uint64_t spare_bytes_ = 0;
  uint64_t high_water_ = 0;
};

}  // namespace

std::unique_ptr<Store> make_host_store(HostStoreOptions options) {
  return std::make_unique<HostStore>(options);
}

}  // namespace ebbtide::cache
