// Internal: a small fixed thread pool for snapshot copies, checksums and
// (de)compression of checkpoint chunks.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ebbtide::ckpt::detail {

unsigned default_threads();  // min(4, hardware threads)

class Workers {
 public:
  explicit Workers(unsigned n);
  ~Workers();  // finishes queued tasks
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;
  void post(std::function<void()> fn);
  // Runs fn(0..n-1) on the pool and the calling thread; rethrows the first error.
  void parallel_for(size_t n, const std::function<void(size_t)>& fn);
  unsigned size() const { return static_cast<unsigned>(threads_.size()); }

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace ebbtide::ckpt::detail
