// target "cpu": offloaded bytes in host memory.
#include <cerrno>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <algorithm>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/mem/buffer_pool.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::cache {
namespace {

constexpr size_t kBlobAlign = 64;

// Note [Host staging]
// Device tensors go straight into page-locked blobs: each blob of a device
// put is a pinned buffer of the store's mem::HostBufferPool, so one
// cuMemcpyDtoHAsync (and one HtoD on reload) moves it at full PCIe speed,
// with no extra memcpy. Registration costs about as much as pinning the pages
// once; the pool keeps freed blobs in size classes (Note [Buffer reuse] in
// mem/buffer_pool.cpp), so once the largest sizes have been seen every blob
// is reused already registered, also when sizes vary from step to step
// (StoreStats::host_registrations counts the registrations). When
// registration is refused (RLIMIT_MEMLOCK in a container), that blob is
// ordinary memory and its copies go chunk by chunk through the staging pool
// (mem::PinnedPool), which is made on the first such copy. Host tensors use
// plain blobs and memcpy: CPU-only runs never pin memory. Memory is pinned
// in the context of the device it serves, which the caller has bound (the
// tensor cache binds the entry's device around reserve_host and on its
// workers; put() and get() of device buffers run with it bound), never in
// one made up for it (Note [Registration context] in mem/host_mapping.cpp).
constexpr size_t kStagingBuffers = 4;

class HostStore final : public Store {
 public:
  explicit HostStore(HostStoreOptions o)
      : opts_(o), blob_pool_(mem::HostBufferPoolOptions{kBlobAlign, o.driver, "host store"}) {
    EBB_CHECK(o.staging_bytes >= 4096, "host store: staging_bytes ", o.staging_bytes, " is below 4096");
  }

  Location put(const mem::Buffer& src, int /*tier*/) override {
    EBB_CHECK(src.nbytes > 0, "host store: empty put");
    reserve(src.nbytes);  // before copying, so concurrent puts respect the cap
    mem::HostBufferPool::Buffer blob;
    try {
      blob = blob_pool_.take(src.nbytes, /*pin=*/src.on_device() && opts_.driver != nullptr);
      copy(blob.data, blob.pinned, src, /*to_device=*/false);
    } catch (...) {
      if (blob.data != nullptr) blob_pool_.give(blob.data);
      unreserve(src.nbytes);
      throw;
    }
    std::lock_guard<std::mutex> lock(mu_);
    Location loc = next_++;
    blobs_.emplace(loc, Blob{blob.data, src.nbytes, blob.pinned});
    return loc;
  }

  bool has_tier(int tier) const override { return tier == kTierCpu; }
  int tier_of(Location) const override { return kTierCpu; }

  HostSpace reserve_host(uint64_t nbytes) override {
    EBB_CHECK(nbytes > 0, "host store: empty reservation");
    reserve(nbytes);
    mem::HostBufferPool::Buffer blob;
    try {
      blob = blob_pool_.take(nbytes, /*pin=*/opts_.driver != nullptr);
    } catch (...) {
      unreserve(nbytes);
      throw;
    }
    std::lock_guard<std::mutex> lock(mu_);
    Location loc = next_++;
    blobs_.emplace(loc, Blob{blob.data, nbytes, blob.pinned});
    return HostSpace{loc, blob.data, blob.pinned};
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
    blob_pool_.give(b.data);
  }

  StoreStats stats() const override {
    StoreStats out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      out.bytes_held = held_;
      out.blobs = blobs_.size();
      out.capacity = opts_.capacity_bytes;
    }
    out.host_registrations = blob_pool_.registrations();
    return out;
  }

  std::string describe() const override {
    return detail::concat("host memory (capacity ",
                          opts_.capacity_bytes ? config::format_bytes(double(opts_.capacity_bytes)) : "unlimited",
                          opts_.driver ? ", pinned staging" : "", ")");
  }

 private:
  struct Blob {
    void* data = nullptr;  // from blob_pool_
    uint64_t nbytes = 0;
    bool pinned = false;  // registered with the CUDA driver (Note [Host staging])
  };

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

  // Made, and registered in the context bound for the copy, on first need.
  mem::PinnedPool& staging() {
    std::lock_guard<std::mutex> lock(staging_mu_);
    if (!staging_) {
      mem::PinnedPoolOptions o;
      o.driver = opts_.driver;
      staging_ = std::make_unique<mem::PinnedPool>(opts_.staging_bytes, kStagingBuffers, o);
    }
    return *staging_;
  }

  HostStoreOptions opts_;
  std::mutex staging_mu_;
  std::unique_ptr<mem::PinnedPool> staging_;
  mem::HostBufferPool blob_pool_;  // every blob, handed out or spare
  mutable std::mutex mu_;
  std::unordered_map<Location, Blob> blobs_;
  Location next_ = 1;
  uint64_t held_ = 0;
};

}  // namespace

std::unique_ptr<Store> make_host_store(HostStoreOptions options) {
  return std::make_unique<HostStore>(options);
}

}  // namespace ebbtide::cache
