#include "ebbtide/cache/buffer_pool.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "ebbtide/util/error.hpp"

namespace ebbtide::cache {

HostBufferPool::~HostBufferPool() {
  for (auto& [n, v] : spare_)
    for (void* p : v) std::free(p);
  for (auto& [p, n] : out_) std::free(p);
}

void* HostBufferPool::take(size_t nbytes) {
  EBB_CHECK(nbytes > 0, "host buffer pool: empty buffer requested");
  const size_t size = (nbytes + kAlign - 1) / kAlign * kAlign;
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = spare_.find(size);
    if (it != spare_.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      spare_bytes_ -= size;
      ++reused_;
    }
  }
  if (p == nullptr && ::posix_memalign(&p, kAlign, size) != 0) {
    throw IoError(ENOMEM, "host memory", 0, detail::concat("host buffer pool: cannot allocate ", size, " bytes"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  out_.emplace(p, size);
  out_bytes_ += size;
  high_water_ = std::max(high_water_, out_bytes_);
  return p;
}

void HostBufferPool::give(void* p) {
  size_t size = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = out_.find(p);
    EBB_CHECK_STATE(it != out_.end(), "host buffer pool: ", p, " was not handed out by this pool");
    size = it->second;
    out_.erase(it);
    out_bytes_ -= size;
    if (spare_bytes_ + size <= high_water_) {
      spare_[size].push_back(p);
      spare_bytes_ += size;
      return;
    }
  }
  std::free(p);
}

size_t HostBufferPool::out_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return out_bytes_;
}
size_t HostBufferPool::spare_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spare_bytes_;
}
uint64_t HostBufferPool::reused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reused_;
}

HostBufferPool& HostBufferPool::shared() {
  static auto* pool = new HostBufferPool();  // leaked: buffers may die at interpreter exit
  return *pool;
}

}  // namespace ebbtide::cache
