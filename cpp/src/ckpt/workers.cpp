#include "workers.hpp"

#include <algorithm>
#include <atomic>
#include <exception>

namespace ebbtide::ckpt::detail {

unsigned default_threads() {
  unsigned hw = std::thread::hardware_concurrency();
  return std::clamp(hw, 1u, 4u);
}

Workers::Workers(unsigned n) {
  for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
}

Workers::~Workers() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void Workers::post(std::function<void()> fn) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

void Workers::run() {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

void Workers::parallel_for(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  struct Shared {
    std::atomic<size_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    size_t finished = 0;  // helpers done
    std::exception_ptr error;
  };
  auto sh = std::make_shared<Shared>();
  auto body = [sh, n, &fn] {
    for (size_t i; (i = sh->next.fetch_add(1)) < n;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard lock(sh->mu);
        if (!sh->error) sh->error = std::current_exception();
        sh->next = n;
      }
    }
  };
  size_t helpers = std::min<size_t>(threads_.size(), n - 1);
  for (size_t h = 0; h < helpers; ++h) {
    post([sh, body] {
      body();
      std::lock_guard lock(sh->mu);
      ++sh->finished;
      sh->cv.notify_all();
    });
  }
  body();
  std::unique_lock lock(sh->mu);
  sh->cv.wait(lock, [&] { return sh->finished == helpers; });
  if (sh->error) std::rethrow_exception(sh->error);
}

}  // namespace ebbtide::ckpt::detail
