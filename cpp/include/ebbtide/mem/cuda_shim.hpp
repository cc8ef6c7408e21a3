// CUDA driver API loaded at run time with dlopen("libcuda.so.1").
//
// ebbtide never links libcuda: with no driver (CI, CPU machines) driver()
// returns nullptr and every caller takes its host-only path. Types are opaque
// integers here so this header compiles without cuda.h; the implementation
// (compiled with cuda.h when found, EBBTIDE_HAVE_CUDA_H) casts them.
// All calls throw IoError/Unsupported with the CUDA error name on failure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace ebbtide::mem::cuda {

using Stream = uintptr_t;   // CUstream (0 = legacy default stream)
using Event = uintptr_t;    // CUevent
using DevicePtr = uint64_t; // CUdeviceptr
using Context = uintptr_t;  // CUcontext (0 = none)

class Driver {
 public:
  virtual ~Driver() = default;
  // Makes the primary context of the device owning `ptr` current on the calling
  // thread (worker threads call this before copies). Copies, events and
  // streams need a current context; without one they throw, saying so.
  // InvalidArgument when `ptr` is not memory the driver knows.
  virtual void bind_context_of(DevicePtr ptr) = 0;
  // Makes the primary context of device `ordinal` current on the calling thread.
  virtual void bind_device(int ordinal) = 0;
  // The calling thread's current context (0 when none), and setting it back.
  virtual Context current_context() = 0;
  virtual void set_current_context(Context c) = 0;
  // True when `ptr` is device memory (or managed) known to the driver.
  virtual bool is_device_pointer(const void* ptr) = 0;
  virtual void memcpy_dtoh_async(void* dst, DevicePtr src, size_t n, Stream s) = 0;
  virtual void memcpy_htod_async(DevicePtr dst, const void* src, size_t n, Stream s) = 0;
  virtual Event event_create() = 0;       // disable-timing, blocking-sync event (a host wait sleeps)
  virtual void event_destroy(Event e) = 0;
  virtual void event_record(Event e, Stream s) = 0;
  virtual void event_synchronize(Event e) = 0;
  virtual bool event_query(Event e) = 0;  // true when complete
  virtual void stream_wait_event(Stream s, Event e) = 0;
  virtual Stream stream_create() = 0;     // non-blocking stream in the current context
  // The current context's stream priorities (cuCtxGetStreamPriorityRange):
  // {least, greatest}; the greatest is the numerically lowest. Default: {0, 0}.
  virtual std::pair<int, int> stream_priority_range();
  // A non-blocking stream of priority `priority` in the current context
  // (cuStreamCreateWithPriority; out of range: clamped by the driver).
  // Default: stream_create().
  virtual Stream stream_create_with_priority(int priority);
  virtual void stream_destroy(Stream s) = 0;
  virtual void stream_synchronize(Stream s) = 0;
  // True while `s` is being captured into a CUDA graph (cuStreamIsCapturing;
  // legal during a capture). Work enqueued on it then does not run, and host
  // synchronisation, queries and host registration are illegal (Note [Graph
  // capture] in cache/tensor_cache_device.cpp). Default: false.
  virtual bool stream_is_capturing(Stream s);
  // Lets the calling thread make host-synchronising calls while another
  // thread captures a graph in global mode (cuThreadExchangeStreamCaptureMode
  // RELAXED): for worker threads that never touch a capturing stream.
  // Default: nothing.
  virtual void relax_capture_mode();
  // cuThreadExchangeStreamCaptureMode: sets the calling thread's capture
  // mode (kCaptureMode*) and returns the one it had. Default: returns `mode`.
  virtual int exchange_capture_mode(int mode);
  // cuMemHostRegister(PORTABLE) in the calling thread's current context; false
  // (and one warning) when refused. Unregistration belongs in the context that
  // registered (Note [Registration context] in host_mapping.cpp). With no
  // context current both throw IoError (CUDA_ERROR_INVALID_CONTEXT, naming
  // the call) and make none current.
  virtual bool host_register(void* p, size_t n) = 0;
  virtual void host_unregister(void* p) = 0;
  virtual int device_count() = 0;
  virtual std::string device_name(int ordinal) = 0;
  // cuMemAlloc/cuMemFree in the current context (tests and tools; training
  // memory comes from the framework's allocator). Default: Unsupported.
  virtual DevicePtr mem_alloc(size_t n);
  virtual void mem_free(DevicePtr p);
  // An event that records timestamps (for measuring the link), and the
  // milliseconds between two such recorded events once both completed.
  // Default: Unsupported.
  virtual Event event_create_timed();
  virtual float event_elapsed_ms(Event start, Event end);
};

// CUstreamCaptureMode's values.
constexpr int kCaptureModeGlobal = 0;
constexpr int kCaptureModeThreadLocal = 1;
constexpr int kCaptureModeRelaxed = 2;

// The calling thread's capture mode is relaxed for a scope, then restored:
// for queries of events recorded outside any capture, legal while a graph
// is captured (by this thread or another) only in that mode.
class RelaxedCaptureScope {
 public:
  explicit RelaxedCaptureScope(Driver* driver)
      : driver_(driver), previous_(driver->exchange_capture_mode(kCaptureModeRelaxed)) {}
  ~RelaxedCaptureScope();  // restores the mode; a failure is logged once, never thrown
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  Driver* driver_;
  int previous_;
};

// Restores the calling thread's current context when the scope ends, so the
// calls inside may bind another (Note [Caller's context] in
// cache/tensor_cache.cpp); with `c` (from current_context()), makes it
// current now: for releasing, on any thread, what was made in a known context.
class ContextScope {
 public:
  explicit ContextScope(Driver* driver) : driver_(driver), previous_(driver->current_context()) {}
  ContextScope(Driver* driver, Context c) : ContextScope(driver) {
    if (c != previous_) driver_->set_current_context(c);
  }
  ~ContextScope() {
    try {
      driver_->set_current_context(previous_);
    } catch (...) {  // a destructor must not throw; the next call reports a broken driver
    }
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 protected:
  Driver* driver_;
  Context previous_;
};

// Makes device `ordinal`'s primary context current for a scope and restores
// the caller's context after (Note [Caller's context]): calls made on the
// training thread (a pack hook, an unpack) must neither depend on which device
// the thread happens to have current nor change it.
class DeviceScope : public ContextScope {
 public:
  DeviceScope(Driver* driver, int ordinal) : ContextScope(driver) { driver_->bind_device(ordinal); }
};

// The process-wide driver, or nullptr when libcuda.so.1 cannot be loaded, has
// no devices, the build had no cuda.h, or EBBTIDE_CUDA=0. The reason is logged
// once at info level and available from unavailable_reason() ("" when
// available). Initialised once, thread safe; never destroyed (see Note [Shim
// lifetime] in cuda_shim.cpp). A bad EBBTIDE_CUDA value throws InvalidArgument.
Driver* driver();
std::string unavailable_reason();

// One attempt at loading the driver, independent of the process-wide one (for
// tests and diagnostics): reads EBBTIDE_CUDA now. Exactly one of `driver` and
// `reason` is set. Throws InvalidArgument for a bad EBBTIDE_CUDA value.
struct ProbeResult {
  std::unique_ptr<Driver> driver;
  std::string reason;
};
ProbeResult probe();

// "CUDA_ERROR_INVALID_VALUE" for a CUresult, or "CUresult <n>" when no driver
// is loaded or the code is unknown to it.
std::string error_name(int result);

}  // namespace ebbtide::mem::cuda
