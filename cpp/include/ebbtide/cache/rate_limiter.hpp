// A token bucket bounding a byte rate across threads (the SSD write cap of the
// tensor cache's store workers). acquire() blocks the caller until its bytes
// fit under the rate; bytes beyond the burst are paid for by sleeping. Thread safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace ebbtide::cache {

class RateLimiter {
 public:
  // bytes_per_second 0 = unlimited. InvalidArgument for a negative or non-finite rate.
  explicit RateLimiter(double bytes_per_second = 0);
  void set_rate(double bytes_per_second);
  double rate() const;
  // Takes `nbytes` tokens, sleeping as long as the bucket is in debt.
  // Returns the seconds slept.
  double acquire(uint64_t nbytes);

 private:
  using Clock = std::chrono::steady_clock;
  mutable std::mutex mu_;
  double rate_ = 0;
  double burst_ = 0;
  double tokens_ = 0;  // may go negative: later callers pay the debt
  Clock::time_point last_ = Clock::now();
};

}  // namespace ebbtide::cache
