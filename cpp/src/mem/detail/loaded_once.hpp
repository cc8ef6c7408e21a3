// Internal: the process-wide, load-once driver behind cuda::driver() and
// cufile::cufile() (Note [Shim lifetime] in cuda_shim.cpp).
#pragma once

#include <exception>
#include <mutex>
#include <string>
#include <utility>

#include "ebbtide/util/log.hpp"

namespace ebbtide::detail {

// `probe()` returns {unique_ptr<Driver> driver, string reason}. The first
// get() runs it once; the driver is leaked on purpose (never unloaded while
// other static destructors may still use it). A probe that throws (a bad
// setting) is rethrown by every get(), so it is never silently ignored.
template <class Driver>
class LoadedOnce {
 public:
  template <class Probe>
  Driver* get(Probe&& probe, const char* what) {
    std::call_once(once_, [&] {
      try {
        auto r = probe();
        driver_ = r.driver.release();
        reason_ = std::move(r.reason);
        if (driver_ == nullptr) log::info(what, " unavailable: ", reason_);
        else log::info(what, " loaded");
      } catch (...) {
        config_error_ = std::current_exception();
      }
    });
    if (config_error_) std::rethrow_exception(config_error_);
    return driver_;
  }
  const std::string& reason() const { return reason_; }  // after get() returned nullptr

 private:
  std::once_flag once_;
  Driver* driver_ = nullptr;
  std::string reason_;
  std::exception_ptr config_error_;
};

}  // namespace ebbtide::detail
