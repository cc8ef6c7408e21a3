// target "cpu": offloaded bytes in host memory.
#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::cache {
namespace {

constexpr size_t kBlobAlign = 64;

// Note [Host staging]: device copies go through page-locked staging buffers so
// cuMemcpy*Async is truly asynchronous on the caller's stream; the blobs
// themselves stay ordinary memory (registering every blob costs more than the
// extra memcpy for the tensor sizes we see).
class Staging {
 public:
  Staging(mem::cuda::Driver* driver, size_t bytes) : driver_(driver), bytes_(bytes) {}
  ~Staging() {
    for (void* p : all_) {
      if (registered_) driver_->host_unregister(p);
      ::munmap(p, bytes_);
    }
  }
  void* acquire() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      void* p = free_.back();
      free_.pop_back();
      return p;
    }
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw_io_error(errno, "host staging", 0, "mmap");
    registered_ = driver_->host_register(p, bytes_);
    all_.push_back(p);
    return p;
  }
  void release(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(p);
  }
  size_t bytes() const { return bytes_; }

 private:
  mem::cuda::Driver* driver_;
  size_t bytes_;
  std::mutex mu_;
  std::vector<void*> free_;
  std::vector<void*> all_;
  bool registered_ = false;
};

class HostStore final : public Store {
 public:
  explicit HostStore(HostStoreOptions o) : opts_(o) {
    EBB_CHECK(o.staging_bytes >= 4096, "host store: staging_bytes ", o.staging_bytes, " is below 4096");
    if (o.driver != nullptr) staging_ = std::make_unique<Staging>(o.driver, o.staging_bytes);
  }
  ~HostStore() override {
    for (auto& [loc, b] : blobs_) std::free(b.data);
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
    void* data = nullptr;
    size_t alloc = (src.nbytes + kBlobAlign - 1) / kBlobAlign * kBlobAlign;
    if (::posix_memalign(&data, kBlobAlign, alloc) != 0) {
      unreserve(src.nbytes);
      throw IoError(ENOMEM, "host memory", 0, detail::concat("host store: cannot allocate ", src.nbytes, " bytes"));
    }
    try {
      copy(data, src, /*to_device=*/false);
    } catch (...) {
      std::free(data);
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = blobs_.find(loc);
      EBB_CHECK_STATE(it != blobs_.end(), "host store: location ", loc, " freed twice or never stored");
      data = it->second.data;
      held_ -= it->second.nbytes;
      blobs_.erase(it);
    }
    std::free(data);
  }

  StoreStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return StoreStats{held_, blobs_.size(), opts_.capacity_bytes};
  }

  std::string describe() const override {
    return detail::concat("host memory (capacity ",
                          opts_.capacity_bytes ? config::format_bytes(double(opts_.capacity_bytes)) : "unlimited",
                          staging_ ? ", pinned staging" : "", ")");
  }

 private:
  struct Blob {
    void* data = nullptr;
    uint64_t nbytes = 0;
  };

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
    if (!staging_) throw Unsupported("host store: device span without a CUDA driver");
    auto* drv = opts_.driver;
    void* stage = staging_->acquire();
    try {
      auto* host = static_cast<unsigned char*>(blob);
      auto dev = reinterpret_cast<mem::cuda::DevicePtr>(s.ptr);
      for (uint64_t off = 0; off < s.nbytes; off += staging_->bytes()) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(staging_->bytes(), s.nbytes - off));
        if (to_device) {
          // The staging buffer is reused at the next chunk: wait for this copy.
          std::memcpy(stage, host + off, n);
          drv->memcpy_htod_async(dev + off, stage, n, s.stream);
          drv->stream_synchronize(s.stream);
        } else {
          drv->memcpy_dtoh_async(stage, dev + off, n, s.stream);
          drv->stream_synchronize(s.stream);
          std::memcpy(host + off, stage, n);
        }
      }
    } catch (...) {
      staging_->release(stage);
      throw;
    }
    staging_->release(stage);
  }

  HostStoreOptions opts_;
  std::unique_ptr<Staging> staging_;
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
