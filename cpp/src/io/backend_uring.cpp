// io_uring backend (liburing): one ring per device worker, staging buffers
// registered with io_uring_register_buffers and used through READ_FIXED /
// WRITE_FIXED; other buffers (aligned user memory) use plain READ / WRITE.
#include <cerrno>
#include <cstring>

#include "backend.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

#ifdef EBBTIDE_HAVE_LIBURING
#include <liburing.h>
#endif

namespace ebbtide::io::detail {

#ifdef EBBTIDE_HAVE_LIBURING
namespace {

class UringBackend final : public Backend {
 public:
  UringBackend(unsigned depth) : depth_(depth) {}
  ~UringBackend() override {
    if (ready_) io_uring_queue_exit(&ring_);
  }

  // Returns 0 or -errno.
  int init(const std::vector<iovec>& fixed) {
    int rc = io_uring_queue_init(depth_, &ring_, 0);
    if (rc < 0) return rc;
    ready_ = true;
    if (!fixed.empty()) {
      int r = io_uring_register_buffers(&ring_, fixed.data(), static_cast<unsigned>(fixed.size()));
      if (r == 0) {
        fixed_ = true;
      } else {
        log::warn_once("io_uring_register_buffers",
                       ebbtide::detail::concat("io_uring: registering ", fixed.size(),
                                      " staging buffers failed (", std::strerror(-r),
                                      "); using unregistered READ/WRITE"));
      }
    }
    return 0;
  }

  const char* name() const override { return "uring"; }
  std::string describe() const override {
    return ebbtide::detail::concat("uring(depth=", depth_, fixed_ ? ", fixed buffers" : "", ")");
  }

  void submit(const IoOp& op) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {  // the caller bounds outstanding ops, so only unsubmitted ones fill it
      flush();
      sqe = io_uring_get_sqe(&ring_);
      EBB_ASSERT(sqe != nullptr, "io_uring submission queue full");
    }
    const auto len = static_cast<unsigned>(op.len);
    if (op.buf_index >= 0 && fixed_) {
      if (op.write) io_uring_prep_write_fixed(sqe, op.fd, op.buf, len, op.offset, op.buf_index);
      else io_uring_prep_read_fixed(sqe, op.fd, op.buf, len, op.offset, op.buf_index);
    } else {
      if (op.write) io_uring_prep_write(sqe, op.fd, op.buf, len, op.offset);
      else io_uring_prep_read(sqe, op.fd, op.buf, len, op.offset);
    }
    io_uring_sqe_set_data64(sqe, op.tag);
    ++unsubmitted_;
  }

  void flush() override {
    while (unsubmitted_ > 0) {
      int rc = io_uring_submit(&ring_);
      if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) continue;
      if (rc < 0) throw_io_error(-rc, "", -1, "io_uring_submit");
      unsubmitted_ -= std::min<unsigned>(unsubmitted_, static_cast<unsigned>(rc));
    }
  }

  void reap(std::vector<IoCompletion>& out, bool block) override {
    io_uring_cqe* cqe = nullptr;
    if (block) {
      for (;;) {
        int rc = io_uring_wait_cqe(&ring_, &cqe);
        if (rc == -EINTR || rc == -EAGAIN) continue;
        if (rc < 0) throw_io_error(-rc, "", -1, "io_uring_wait_cqe");
        break;
      }
    }
    unsigned head, n = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      out.push_back({io_uring_cqe_get_data64(cqe), cqe->res});
      ++n;
    }
    io_uring_cq_advance(&ring_, n);
  }

 private:
  unsigned depth_;
  io_uring ring_{};
  bool ready_ = false;
  bool fixed_ = false;
  unsigned unsubmitted_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(unsigned depth, const std::vector<iovec>& fixed,
                                            std::string* why_not) {
  auto b = std::make_unique<UringBackend>(depth);
  int rc = b->init(fixed);
  if (rc < 0) {
    if (why_not) {
      *why_not = ebbtide::detail::concat("io_uring_queue_init failed: ", std::strerror(-rc), " (errno ", -rc, ")");
      if (rc == -ENOSYS) *why_not += "; the kernel has no io_uring";
      if (rc == -EPERM) *why_not += "; io_uring is disabled (sysctl kernel.io_uring_disabled or seccomp)";
    }
    return nullptr;
  }
  return b;
}

#else

std::unique_ptr<Backend> make_uring_backend(unsigned, const std::vector<iovec>&, std::string* why_not) {
  log::warn_once("no-liburing",
                 "io: this build of ebbtide has no liburing (install liburing-dev, then reinstall ebbtide): "
                 "reads and writes run on the POSIX thread pool");
  if (why_not) *why_not = "this build has no liburing (EBBTIDE_HAVE_LIBURING is off)";
  return nullptr;
}

#endif

}  // namespace ebbtide::io::detail
