#include "ebbtide/mem/host_mapping.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <limits>
#include <utility>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::mem {

// Note [Pinned staging memory]
// Staging and snapshot memory is anonymous private mappings, not
// cudaHostAlloc memory: io_uring buffer registration (IORING_REGISTER_BUFFERS)
// pins pages itself and refuses driver-allocated pinned memory on some
// kernels, while an ordinary mapping that is then cuMemHostRegister'ed works
// for both. Registration is a separate step (pin()), taken only by callers
// that copy to or from a device, so CPU-only work never initialises CUDA.

size_t HostMapping::page_size() {
  static const size_t kPage = [] {
    long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return kPage;
}

HostMapping::HostMapping(size_t bytes, std::string_view owner, bool populate) {
  const size_t page = page_size();
  EBB_CHECK(bytes > 0, owner, ": cannot map 0 bytes");
  EBB_CHECK(bytes <= std::numeric_limits<size_t>::max() - (page - 1), owner, ": ", bytes,
            " bytes is too large to map");
  const size_t size = (bytes + page - 1) / page * page;
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (populate) flags |= MAP_POPULATE;
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw IoError(err, "host memory", -1, detail::concat(owner, ": mmap of ", size, " bytes failed"));
  }
  data_ = p;
  size_ = size;
}

HostMapping::~HostMapping() { release(); }

HostMapping::HostMapping(HostMapping&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      pinned_by_(std::exchange(o.pinned_by_, nullptr)),
      pin_tried_(std::exchange(o.pin_tried_, false)) {}

HostMapping& HostMapping::operator=(HostMapping&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    pinned_by_ = std::exchange(o.pinned_by_, nullptr);
    pin_tried_ = std::exchange(o.pin_tried_, false);
  }
  return *this;
}

bool HostMapping::pin(cuda::Driver* driver) {
  if (driver != nullptr && data_ != nullptr && !pin_tried_) {
    pin_tried_ = true;
    if (driver->host_register(data_, size_)) pinned_by_ = driver;
  }
  return pinned();
}

void HostMapping::release() noexcept {
  if (data_ == nullptr) return;
  if (pinned_by_ != nullptr) {
    try {
      pinned_by_->host_unregister(data_);
    } catch (const std::exception& e) {
      log::warn("host memory: unregistering ", size_, " bytes from CUDA failed: ", e.what());
    }
  }
  if (::munmap(data_, size_) != 0) log::warn("host memory: munmap of ", size_, " bytes failed (errno ", errno, ")");
  data_ = nullptr;
  size_ = 0;
  pinned_by_ = nullptr;
  pin_tried_ = false;
}

}  // namespace ebbtide::mem
