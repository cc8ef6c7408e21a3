// A simulated GPU for scheduling tests of the stream-ordered cache.
//
// Note [Simulated GPU]
// "Device memory" is host memory and copies move their bytes at once, but
// every operation also gets a start and end on a virtual clock, as a GPU
// would run it: streams run their operations in order; an operation starts
// no earlier than its stream's previous one ended, than the events its stream
// waits on were reached, and than the host issued it; kernels take the time
// the test gives; device-to-host and host-to-device copies each have one copy
// engine of a given bandwidth (copies in one direction run one at a time).
// The host's clock stays where the test leaves it (a training loop's CPU runs
// ahead of the GPU) and advances only through synchronize calls; an event
// query is true once the host's clock has passed the event. One device.
#pragma once

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::test {

class SimDriver final : public mem::cuda::Driver {
 public:
  SimDriver(double d2h_bytes_per_s, double h2d_bytes_per_s) : d2h_bps_(d2h_bytes_per_s), h2d_bps_(h2d_bytes_per_s) {}

  struct Copy {
    bool d2h = false;
    const void* host = nullptr;
    uint64_t dev = 0;
    size_t n = 0;
    mem::cuda::Stream stream = 0;
    double start = 0;
    double end = 0;
  };

  // A kernel of `seconds` on `s`; returns its start.
  double launch(mem::cuda::Stream s, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    double start = std::max(tail_[s], host_);
    tail_[s] = start + seconds;
    return start;
  }
  // When everything enqueued on `s` so far has run.
  double tail(mem::cuda::Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    return tail_[s];
  }
  double host_time() {
    std::lock_guard<std::mutex> lock(mu_);
    return host_;
  }
  std::vector<Copy> copies() {
    std::lock_guard<std::mutex> lock(mu_);
    return copies_;
  }
  uint64_t waits_on(mem::cuda::Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    return waits_[s];
  }

  void bind_context_of(mem::cuda::DevicePtr) override { current_ = 0; }
  void bind_device(int d) override {
    EBB_CHECK(d == 0, "sim: no device ", d);
    current_ = 0;
  }
  mem::cuda::Context current_context() override { return static_cast<mem::cuda::Context>(current_ + 1); }
  void set_current_context(mem::cuda::Context c) override { current_ = static_cast<int>(c) - 1; }
  bool is_device_pointer(const void*) override { return true; }
  void memcpy_dtoh_async(void* dst, mem::cuda::DevicePtr src, size_t n, mem::cuda::Stream s) override {
    copy(true, dst, src, n, s);
    std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  }
  void memcpy_htod_async(mem::cuda::DevicePtr dst, const void* src, size_t n, mem::cuda::Stream s) override {
    copy(false, src, dst, n, s);
    std::memcpy(reinterpret_cast<void*>(dst), src, n);
  }
  mem::cuda::Event event_create() override {
    need_context("cuEventCreate");
    std::lock_guard<std::mutex> lock(mu_);
    return ++next_event_;
  }
  mem::cuda::Event event_create_timed() override { return event_create(); }
  void event_destroy(mem::cuda::Event) override {}
  void event_record(mem::cuda::Event e, mem::cuda::Stream s) override {
    need_context("cuEventRecord");
    std::lock_guard<std::mutex> lock(mu_);
    events_[e] = tail_[s];
  }
  void event_synchronize(mem::cuda::Event e) override {
    std::lock_guard<std::mutex> lock(mu_);
    host_ = std::max(host_, events_[e]);
  }
  bool event_query(mem::cuda::Event e) override {
    std::lock_guard<std::mutex> lock(mu_);
    return events_[e] <= host_;
  }
  float event_elapsed_ms(mem::cuda::Event a, mem::cuda::Event b) override {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<float>((events_[b] - events_[a]) * 1e3);
  }
  void stream_wait_event(mem::cuda::Stream s, mem::cuda::Event e) override {
    need_context("cuStreamWaitEvent");
    std::lock_guard<std::mutex> lock(mu_);
    tail_[s] = std::max(tail_[s], events_[e]);
    waits_[s] += 1;
  }
  mem::cuda::Stream stream_create() override {
    need_context("cuStreamCreate");
    std::lock_guard<std::mutex> lock(mu_);
    return 100 + ++next_stream_;
  }
  void stream_destroy(mem::cuda::Stream) override {}
  void stream_synchronize(mem::cuda::Stream s) override {
    std::lock_guard<std::mutex> lock(mu_);
    host_ = std::max(host_, tail_[s]);
  }
  // Page-locking succeeds unless a test refuses it (as a container with a
  // small RLIMIT_MEMLOCK would); both calls are counted.
  bool host_register(void*, size_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++registers_;
    return allow_register;
  }
  void host_unregister(void*) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++unregisters_;
  }
  bool allow_register = true;
  int registers() {
    std::lock_guard<std::mutex> lock(mu_);
    return registers_;
  }
  int unregisters() {
    std::lock_guard<std::mutex> lock(mu_);
    return unregisters_;
  }
  int device_count() override { return 1; }
  std::string device_name(int) override { return "sim"; }

 private:
  void copy(bool d2h, const void* host, uint64_t dev, size_t n, mem::cuda::Stream s) {
    need_context(d2h ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync");
    std::lock_guard<std::mutex> lock(mu_);
    double& engine = d2h ? d2h_free_ : h2d_free_;
    const double start = std::max({tail_[s], host_, engine});
    const double end = start + static_cast<double>(n) / (d2h ? d2h_bps_ : h2d_bps_);
    engine = end;
    tail_[s] = end;
    copies_.push_back(Copy{d2h, host, dev, n, s, start, end});
  }
  static void need_context(const char* call) {
    EBB_CHECK(current_ >= 0, "sim ", call, ": CUDA_ERROR_INVALID_CONTEXT (no context current on this thread)");
  }

  double d2h_bps_;
  double h2d_bps_;
  std::mutex mu_;
  std::map<mem::cuda::Stream, double> tail_;
  std::map<mem::cuda::Stream, uint64_t> waits_;
  std::map<mem::cuda::Event, double> events_;
  double host_ = 0;
  double d2h_free_ = 0;
  double h2d_free_ = 0;
  std::vector<Copy> copies_;
  int registers_ = 0;
  int unregisters_ = 0;
  mem::cuda::Event next_event_ = 0;
  mem::cuda::Stream next_stream_ = 0;
  static inline thread_local int current_ = -1;
};

}  // namespace ebbtide::test
