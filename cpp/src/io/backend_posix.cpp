// POSIX backend: a pool of threads issuing pread/pwrite, used where io_uring
// is absent or refused. Each op is carried to completion (short transfers
// continued, EINTR/EAGAIN retried) before its result is posted.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "backend.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::io::detail {
namespace {

int64_t transfer(const IoOp& op) {
  uint64_t done = 0;
  auto* p = static_cast<char*>(op.buf);
  while (done < op.len) {
    ssize_t r = op.write ? ::pwrite(op.fd, p + done, op.len - done, static_cast<off_t>(op.offset + done))
                         : ::pread(op.fd, p + done, op.len - done, static_cast<off_t>(op.offset + done));
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return -errno;
    }
    if (r == 0) break;  // end of file on read; the worker reports the short transfer
    done += static_cast<uint64_t>(r);
  }
  return static_cast<int64_t>(done);
}

class PosixBackend final : public Backend {
 public:
  explicit PosixBackend(unsigned depth) : depth_(depth) {
    threads_.reserve(depth);
    for (unsigned i = 0; i < depth; ++i) threads_.emplace_back([this] { run(); });
  }
  ~PosixBackend() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  const char* name() const override { return "posix"; }
  std::string describe() const override { return ebbtide::detail::concat("posix(threads=", depth_, ")"); }

  void submit(const IoOp& op) override { staged_.push_back(op); }
  void flush() override {
    if (staged_.empty()) return;
    {
      std::lock_guard lock(mu_);
      for (auto& op : staged_) work_.push_back(op);
      outstanding_ += staged_.size();
    }
    staged_.clear();
    work_cv_.notify_all();
  }
  void reap(std::vector<IoCompletion>& out, bool block) override {
    std::unique_lock lock(mu_);
    if (block && outstanding_ > 0) done_cv_.wait(lock, [&] { return !done_.empty(); });
    outstanding_ -= done_.size();
    for (auto& c : done_) out.push_back(c);
    done_.clear();
  }

 private:
  void run() {
    for (;;) {
      IoOp op;
      {
        std::unique_lock lock(mu_);
        work_cv_.wait(lock, [&] { return stop_ || !work_.empty(); });
        if (work_.empty()) return;
        op = work_.front();
        work_.pop_front();
      }
      IoCompletion c{op.tag, transfer(op)};
      {
        std::lock_guard lock(mu_);
        done_.push_back(c);
      }
      done_cv_.notify_one();
    }
  }

  unsigned depth_;
  std::vector<IoOp> staged_;  // worker thread only
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<IoOp> work_;
  std::vector<IoCompletion> done_;
  size_t outstanding_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<Backend> make_posix_backend(unsigned depth) {
  return std::make_unique<PosixBackend>(depth);
}

}  // namespace ebbtide::io::detail
