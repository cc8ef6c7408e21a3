#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/host_mapping.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
#include "sim_driver.hpp"
#include "test_utils.hpp"

namespace ebbtide::mem {
namespace {

using test::contains;

TEST(CudaShim, DriverAndReasonAreConsistent) {
  cuda::Driver* d = cuda::driver();
  EXPECT_EQ(cuda::driver(), d);  // one process-wide driver
  if (d == nullptr) {
    EXPECT_FALSE(cuda::unavailable_reason().empty());
  } else {
    EXPECT_EQ(cuda::unavailable_reason(), "");
    EXPECT_GT(d->device_count(), 0);
  }
}

TEST(CudaShim, ProbeAgreesWithTheProcessWideDriver) {
  if (std::getenv("EBBTIDE_CUDA") != nullptr) GTEST_SKIP() << "EBBTIDE_CUDA set by the caller";
  cuda::ProbeResult r = cuda::probe();
  EXPECT_EQ(r.driver == nullptr, cuda::driver() == nullptr);
  EXPECT_EQ(r.driver == nullptr, !r.reason.empty()) << r.reason;
#ifndef EBBTIDE_HAVE_CUDA_H
  EXPECT_EQ(r.reason, "built without cuda.h");
#endif
}

TEST(CudaShim, ProbeHonoursEbbtideCudaZero) {
  for (const char* off : {"0", "false", "off"}) {
    test::ScopedEnv env("EBBTIDE_CUDA", off);
    cuda::ProbeResult r = cuda::probe();
    EXPECT_EQ(r.driver, nullptr);
    EXPECT_TRUE(contains(r.reason, "EBBTIDE_CUDA")) << r.reason;
  }
}

TEST(CudaShim, ProbeRejectsABadSettingNamingIt) {
  test::ScopedEnv env("EBBTIDE_CUDA", "sometimes");
  try {
    cuda::probe();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "EBBTIDE_CUDA")) << e.what();
    EXPECT_TRUE(contains(e.what(), "sometimes")) << e.what();
  }
}

// The process-wide driver is initialised once, so the disabled path of
// driver() itself runs in a fresh process (threadsafe death tests re-execute
// the test binary, running only this test).
TEST(CudaShimDeathTest, ProcessWideDriverHonoursEbbtideCudaZero) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::setenv("EBBTIDE_CUDA", "0", 1);
        bool ok = cuda::driver() == nullptr &&
                  cuda::unavailable_reason() == "disabled by EBBTIDE_CUDA=0";
        std::exit(ok ? 0 : 3);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(CudaShimDeathTest, ProcessWideDriverRejectsABadSettingOnEveryCall) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::setenv("EBBTIDE_CUDA", "maybe", 1);
        int thrown = 0;
        for (int i = 0; i < 2; ++i) {
          try {
            cuda::driver();
          } catch (const InvalidArgument&) {
            ++thrown;
          }
        }
        std::exit(thrown == 2 ? 0 : 3);
      },
      ::testing::ExitedWithCode(0), "");
}

// A capture mode that cannot be restored is said once, never thrown from the
// scope's destructor (it runs as a cache call returns or unwinds).
TEST(CudaShim, RelaxedCaptureScopeSaysWhenItCannotRestore) {
  test::SimDriver drv(1e9, 1e9);
  std::vector<std::string> warnings;
  log::set_sink([&](log::Level level, const std::string& msg) {
    if (level <= log::Level::kWarn) warnings.push_back(msg);
  });
  for (int i = 0; i < 2; ++i) {
    std::optional<cuda::RelaxedCaptureScope> scope;
    scope.emplace(&drv);
    drv.inject_failure("cuThreadExchangeStreamCaptureMode", 1);
    EXPECT_NO_THROW(scope.reset());
  }
  log::set_sink(nullptr);
  ASSERT_EQ(warnings.size(), 1u) << "said once";
  EXPECT_NE(warnings[0].find("restoring the thread's CUDA graph capture mode failed"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("cuThreadExchangeStreamCaptureMode"), std::string::npos) << warnings[0];
}

TEST(CudaShim, ErrorNames) {
  if (cuda::driver() == nullptr) {
    EXPECT_EQ(cuda::error_name(1), "CUresult 1");
  } else {
    EXPECT_EQ(cuda::error_name(0), "CUDA_SUCCESS");
    EXPECT_EQ(cuda::error_name(1), "CUDA_ERROR_INVALID_VALUE");
  }
}

// ---- With a GPU ----------------------------------------------------------

class CudaShimGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    drv_ = cuda::driver();
    if (drv_ == nullptr) GTEST_SKIP() << "no CUDA driver: " << cuda::unavailable_reason();
    drv_->bind_device(0);
  }
  cuda::Driver* drv_ = nullptr;
};

TEST_F(CudaShimGpu, DeviceQueries) {
  EXPECT_GT(drv_->device_count(), 0);
  EXPECT_FALSE(drv_->device_name(0).empty());
  EXPECT_THROW(drv_->bind_device(-1), InvalidArgument);
  EXPECT_THROW(drv_->bind_device(drv_->device_count()), InvalidArgument);
  EXPECT_THROW(drv_->device_name(drv_->device_count()), InvalidArgument);
}

TEST_F(CudaShimGpu, RoundTripThroughRegisteredPinnedBuffersWithEventsAndStreamWait) {
  constexpr size_t kBytes = 4 << 20;
  PinnedPool pool(kBytes, 2);
  EXPECT_TRUE(pool.registered());
  auto up = pool.acquire();
  auto down = pool.acquire();
  auto data = test::random_bytes(kBytes, 42);
  std::memcpy(up.data(), data.data(), kBytes);
  std::memset(down.data(), 0, kBytes);

  cuda::DevicePtr dev = drv_->mem_alloc(kBytes);
  EXPECT_TRUE(drv_->is_device_pointer(reinterpret_cast<const void*>(dev)));
  EXPECT_FALSE(drv_->is_device_pointer(data.data()));
  EXPECT_FALSE(drv_->is_device_pointer(up.data()));  // registered host memory is not device memory
  EXPECT_FALSE(drv_->is_device_pointer(nullptr));

  cuda::Stream s1 = drv_->stream_create();
  cuda::Stream s2 = drv_->stream_create();
  cuda::Event uploaded = drv_->event_create();
  cuda::Event downloaded = drv_->event_create();
  // s2 (non-blocking, independent of s1) must wait for the upload on s1.
  drv_->memcpy_htod_async(dev, up.data(), kBytes, s1);
  drv_->event_record(uploaded, s1);
  drv_->stream_wait_event(s2, uploaded);
  drv_->memcpy_dtoh_async(down.data(), dev, kBytes, s2);
  drv_->event_record(downloaded, s2);
  drv_->event_synchronize(downloaded);
  EXPECT_TRUE(drv_->event_query(downloaded));
  EXPECT_TRUE(drv_->event_query(uploaded));
  EXPECT_EQ(std::memcmp(down.data(), data.data(), kBytes), 0);

  // Legacy default stream and stream_synchronize.
  std::memset(down.data(), 0, kBytes);
  drv_->memcpy_dtoh_async(down.data(), dev, kBytes, 0);
  drv_->stream_synchronize(0);
  EXPECT_EQ(std::memcmp(down.data(), data.data(), kBytes), 0);

  drv_->event_destroy(uploaded);
  drv_->event_destroy(downloaded);
  drv_->stream_destroy(s1);
  drv_->stream_destroy(s2);
  drv_->mem_free(dev);
}

// Note [Priority loads] (cache/tensor_cache_device.cpp): a stream of the
// device's highest priority copies like any other; timed events around a
// wait read its device time; the capture mode swaps and comes back.
TEST_F(CudaShimGpu, PriorityStreamsTimedWaitsAndCaptureModes) {
  constexpr size_t kBytes = 4 << 20;
  auto [least, greatest] = drv_->stream_priority_range();
  EXPECT_LE(greatest, least);
  cuda::Stream hi = drv_->stream_create_with_priority(greatest);
  cuda::Stream lo = drv_->stream_create();
  PinnedPool pool(kBytes, 1);
  auto host = pool.acquire();
  cuda::DevicePtr dev = drv_->mem_alloc(kBytes);
  cuda::Event copied = drv_->event_create();
  cuda::Event t0 = drv_->event_create_timed(), t1 = drv_->event_create_timed();
  drv_->memcpy_htod_async(dev, host.data(), kBytes, hi);
  drv_->event_record(copied, hi);
  drv_->event_record(t0, lo);
  drv_->stream_wait_event(lo, copied);
  drv_->event_record(t1, lo);
  drv_->event_synchronize(t1);
  EXPECT_TRUE(drv_->event_query(copied));
  EXPECT_GE(drv_->event_elapsed_ms(t0, t1), 0.0f);
  EXPECT_THROW(drv_->event_elapsed_ms(copied, t1), IoError) << "an untimed event has no time";
  const int before = drv_->exchange_capture_mode(cuda::kCaptureModeRelaxed);
  EXPECT_EQ(drv_->exchange_capture_mode(before), cuda::kCaptureModeRelaxed);
  for (cuda::Event e : {copied, t0, t1}) drv_->event_destroy(e);
  drv_->stream_destroy(hi);
  drv_->stream_destroy(lo);
  drv_->mem_free(dev);
}

TEST_F(CudaShimGpu, WorkerThreadsBindTheContextOfAPointer) {
  cuda::DevicePtr dev = drv_->mem_alloc(4096);
  std::string error;
  std::thread worker([&] {
    try {
      // A fresh thread has no current context: creating an event must fail
      // with a message saying what to do.
      try {
        drv_->event_create();
        error = "event_create succeeded without a context";
        return;
      } catch (const Error& e) {
        if (!contains(e.what(), "cuEventCreate failed: CUDA_ERROR_INVALID_CONTEXT") ||
            !contains(e.what(), "bind_context_of")) {
          error = std::string("unexpected message: ") + e.what();
          return;
        }
      }
      drv_->bind_context_of(dev);
      std::vector<unsigned char> host(4096, 7);
      drv_->memcpy_htod_async(dev, host.data(), host.size(), 0);
      drv_->stream_synchronize(0);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  worker.join();
  EXPECT_EQ(error, "");
  drv_->mem_free(dev);
}

// Note [Registration context]: host registration uses the calling thread's
// context and never makes one current; memory pinned on one thread is
// unregistered on another that has none, and that thread is left without one.
TEST_F(CudaShimGpu, HostRegistrationUsesTheCurrentContextOnly) {
  std::vector<std::string> warnings;
  log::set_sink([&](log::Level level, const std::string& msg) {
    if (level <= log::Level::kWarn) warnings.push_back(msg);
  });
  HostMapping m(1 << 20, "test");
  std::string error;
  std::thread([&] {
    try {
      if (drv_->current_context() != 0) throw std::runtime_error("a fresh thread has a context");
      try {
        drv_->host_register(m.data(), m.size());
        error = "host_register succeeded without a context";
      } catch (const IoError& e) {
        if (!contains(e.what(), "cuMemHostRegister") || !contains(e.what(), "CUDA_ERROR_INVALID_CONTEXT"))
          error = std::string("unexpected message: ") + e.what();
      }
      if (drv_->current_context() != 0) error += "; host_register made a context current";
    } catch (const std::exception& e) {
      error = e.what();
    }
  }).join();
  EXPECT_EQ(error, "");
  EXPECT_TRUE(m.pin(drv_));  // device 0, bound by SetUp
  std::thread([&] {
    try {
      m = HostMapping();
      if (drv_->current_context() != 0) error = "unregistering left a context current";
    } catch (const std::exception& e) {
      error = e.what();
    }
  }).join();
  log::set_sink(nullptr);
  EXPECT_EQ(error, "");
  EXPECT_TRUE(warnings.empty()) << warnings.front();
}

TEST_F(CudaShimGpu, FailuresNameTheCallAndTheCudaError) {
  // An allocation no device has: a synchronous, non-sticky failure (a bad
  // copy could poison the context for the tests after this one).
  try {
    drv_->mem_alloc(size_t{1} << 60);
    FAIL() << "a 1 EiB device allocation succeeded";
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), ENOMEM);
    EXPECT_TRUE(contains(e.what(), "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY")) << e.what();
  }
  std::vector<unsigned char> host(64);
  EXPECT_THROW(drv_->bind_context_of(reinterpret_cast<uintptr_t>(host.data())), InvalidArgument);
}

}  // namespace
}  // namespace ebbtide::mem
