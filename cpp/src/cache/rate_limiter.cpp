#include "ebbtide/cache/rate_limiter.hpp"

#include <algorithm>
#include <cmath>
#include <thread>

#include "ebbtide/util/error.hpp"

namespace ebbtide::cache {

// Note [Write cap]
// A token bucket: tokens accrue at `rate` bytes/s up to a burst of 10 ms of
// traffic (64 KiB..4 MiB), and a put takes its size in tokens before it
// writes. The balance may go negative; the caller then sleeps until the debt
// is paid, so over any interval T at most burst + rate * T bytes start, from
// however many worker threads. The sleep happens inside the store's put, so
// the tier's meter (busy time) sees the capped rate and the planner's
// re-plan check compares like with like.
namespace {
double burst_for(double rate) { return std::clamp(rate * 0.01, 64.0 * 1024, 4.0 * 1024 * 1024); }
}  // namespace

RateLimiter::RateLimiter(double bytes_per_second) { set_rate(bytes_per_second); }

void RateLimiter::set_rate(double bytes_per_second) {
  EBB_CHECK(std::isfinite(bytes_per_second) && bytes_per_second >= 0,
            "write cap must be a non-negative number of bytes/s, got ", bytes_per_second);
  std::lock_guard<std::mutex> lock(mu_);
  rate_ = bytes_per_second;
  burst_ = rate_ > 0 ? burst_for(rate_) : 0;
  tokens_ = std::min(tokens_, burst_);
  if (rate_ > 0 && tokens_ < 0) tokens_ = 0;  // forgive debt run up under the old rate
  last_ = Clock::now();
}

double RateLimiter::rate() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rate_;
}

double RateLimiter::acquire(uint64_t nbytes) {
  double wait = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rate_ <= 0) return 0;
    const auto now = Clock::now();
    tokens_ = std::min(burst_, tokens_ + std::chrono::duration<double>(now - last_).count() * rate_);
    last_ = now;
    tokens_ -= static_cast<double>(nbytes);
    if (tokens_ < 0) wait = -tokens_ / rate_;
  }
  if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
  return wait;
}

}  // namespace ebbtide::cache
