// target "cpu": offloaded bytes in host memory.
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
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

// Note [Host staging]: device copies go through the page-locked staging pool
// (mem::PinnedPool) so cuMemcpy*Async is truly asynchronous on the caller's
// stream; the blobs themselves stay ordinary memory (registering every blob
// costs more than the extra memcpy for the tensor sizes we see). The pool is
// made on the first device copy: CPU-only runs never pin memory.
constexpr size_t kStagingBuffers = 4;

class HostStore final : public Store {
 public:
  explicit HostStore(HostStoreOptions o) : opts_(o) {
    EBB_CHECK(o.staging_bytes >= 4096, "host store: staging_bytes ", o.staging_bytes, " is below 4096");
  }
  ~HostStore() override {
    for (auto& [loc, b] : blobs_) std::free(b.data);
    for (auto& [n, v] : spare_)
      for (void* p : v) std::free(p);
  }

  Location put(const Span& src) override {
    EBB_CHECK(src.nbytes > 0, "host store: empty put");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (opts_.capacity_bytes != 0 && held_ + src.nbytes > opts_.capacity_bytes) {
        throw IoError(ENOSPC, "host memory", static_cast<int64_t>(held_),
                      detail::concat("host store full: ", config::format_bytes(double(held_)), " of ",
                                     config::format_bytes(double(opts_.capacity_bytes)),
                                     " held, cannot add ", src.nbytes, " bytes"));
      }
      held_ += src.nbytes;  // reserve before copying so concurrent puts respect the cap
    }
    size_t alloc = (src.nbytes + kBlobAlign - 1) / kBlobAlign * kBlobAlign;
    void* data = take_spare(alloc);
    if (data == nullptr && ::posix_memalign(&data, kBlobAlign, alloc) != 0) {
      unreserve(src.nbytes);
      throw IoError(ENOMEM, "host memory", 0, detail::concat("host store: cannot allocate ", src.nbytes, " bytes"));
    }
    try {
      copy(data, src, /*to_device=*/false);
    } catch (...) {
      give_spare(data, alloc);
      unreserve(src.nbytes);
      throw;
    }
    std::lock_guard<std::mutex> lock(mu_);
    Location loc = next_++;
    blobs_.emplace(loc, Blob{data, src.nbytes});
    return loc;
  }

  void get(Location loc, const Span& dst) override {
    Blob b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = blobs_.find(loc);
      EBB_CHECK_STATE(it != blobs_.end(), "host store: location ", loc, " is not stored");
      b = it->second;
    }
    EBB_CHECK(dst.nbytes == b.nbytes, "host store: location ", loc, " holds ", b.nbytes,
              " bytes, destination has ", dst.nbytes);
    copy(b.data, dst, /*to_device=*/true);
  }

  void free(Location loc) override {
    void* data = nullptr;
    size_t alloc = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = blobs_.find(loc);
      EBB_CHECK_STATE(it != blobs_.end(), "host store: location ", loc, " freed twice or never stored");
      data = it->second.data;
      alloc = (it->second.nbytes + kBlobAlign - 1) / kBlobAlign * kBlobAlign;
      held_ -= it->second.nbytes;
      blobs_.erase(it);
    }
    give_spare(data, alloc);
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
  };

  // Note [Blob reuse]: training saves the same shapes every step; keeping
  // freed blobs by exact size (up to the most bytes ever held) spares the
  // allocator's mmap/munmap and the page faults of fresh memory each step.
  void* take_spare(size_t alloc) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = spare_.find(alloc);
    if (it == spare_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    spare_bytes_ -= alloc;
    return p;
  }
  void give_spare(void* p, size_t alloc) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      high_water_ = std::max<uint64_t>(high_water_, held_ + alloc);
      if (spare_bytes_ + alloc <= high_water_) {
        spare_[alloc].push_back(p);
        spare_bytes_ += alloc;
        return;
      }
    }
    std::free(p);
  }

  void unreserve(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    held_ -= n;
  }

  // Copies between the host blob and `s` in the direction given.
  void copy(void* blob, const Span& s, bool to_device) {
    if (s.device < 0) {
      if (to_device) std::memcpy(s.ptr, blob, s.nbytes);
      else std::memcpy(blob, s.ptr, s.nbytes);
      return;
    }
    if (opts_.driver == nullptr) throw Unsupported("host store: device span without a CUDA driver");
    auto* drv = opts_.driver;
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
  std::unordered_map<size_t, std::vector<void*>> spare_;
  uint64_t spare_bytes_ = 0;
  uint64_t high_water_ = 0;
};

}  // namespace

std::unique_ptr<Store> make_host_store(HostStoreOptions options) {
  return std::make_unique<HostStore>(options);
}

}  // namespace ebbtide::cache
