#include "ebbtide/mem/cuda_shim.hpp"

#include <dlfcn.h>

#include <cerrno>
#include <exception>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "ebbtide/util/config.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
#include "detail/loaded_once.hpp"

#ifdef EBBTIDE_HAVE_CUDA_H
#include <cuda.h>
#endif

namespace ebbtide::mem::cuda {

// Note [Shim lifetime]
// The process-wide driver is created on first use and never destroyed, nor is
// libcuda ever dlclose'd: static destructors run in an unspecified order at
// exit, and pools or engines destroyed after the shim would otherwise call into
// an unloaded library. Drivers returned by probe() are ordinary objects; they
// release the primary contexts they retained and drop their dlopen reference.
// dlopen is reference counted, so a probe() beside the process-wide driver
// (or beside PyTorch's own load of libcuda) shares one driver state.

DevicePtr Driver::mem_alloc(size_t) { throw Unsupported("cuda::Driver: mem_alloc not implemented"); }
void Driver::mem_free(DevicePtr) { throw Unsupported("cuda::Driver: mem_free not implemented"); }
Event Driver::event_create_timed() { throw Unsupported("cuda::Driver: timed events not implemented"); }
float Driver::event_elapsed_ms(Event, Event) { throw Unsupported("cuda::Driver: timed events not implemented"); }
bool Driver::stream_is_capturing(Stream) { return false; }
std::pair<int, int> Driver::stream_priority_range() { return {0, 0}; }
Stream Driver::stream_create_with_priority(int) { return stream_create(); }
void Driver::relax_capture_mode() {}

RelaxedCaptureScope::~RelaxedCaptureScope() {
  try {
    driver_->exchange_capture_mode(previous_);
  } catch (const std::exception& ex) {
    try {
      log::warn_once("cuda.capture_mode_restore",
                     detail::concat("ebbtide: restoring the thread's CUDA graph capture mode failed (", ex.what(),
                                    "); the thread stays in the relaxed mode"));
    } catch (...) {  // a destructor must not throw
    }
  } catch (...) {
  }
}
int Driver::exchange_capture_mode(int mode) { return mode; }

namespace {

constexpr const char* kLibrary = "libcuda.so.1";

#ifdef EBBTIDE_HAVE_CUDA_H

// The entry points ebbtide uses, typed from cuda.h (kvikio's shim habit). The
// names given to dlsym are the versioned ABI symbols the cuda.h macros map to
// (cuMemcpyDtoHAsync -> cuMemcpyDtoHAsync_v2, ...), without the per-thread
// default-stream variants: stream 0 means the legacy default stream.
struct Api {
  decltype(&cuInit) init{};
  decltype(&cuDriverGetVersion) driver_get_version{};
  decltype(&cuGetErrorName) get_error_name{};
  decltype(&cuGetErrorString) get_error_string{};
  decltype(&cuDeviceGetCount) device_get_count{};
  decltype(&cuDeviceGet) device_get{};
  decltype(&cuDeviceGetName) device_get_name{};
  decltype(&cuDevicePrimaryCtxRetain) primary_ctx_retain{};
  decltype(&cuDevicePrimaryCtxRelease) primary_ctx_release{};
  decltype(&cuCtxSetCurrent) ctx_set_current{};
  decltype(&cuCtxGetCurrent) ctx_get_current{};
  decltype(&cuPointerGetAttribute) pointer_get_attribute{};
  decltype(&cuMemcpyDtoHAsync) memcpy_dtoh_async{};
  decltype(&cuMemcpyHtoDAsync) memcpy_htod_async{};
  decltype(&cuEventCreate) event_create{};
  decltype(&cuEventDestroy) event_destroy{};
  decltype(&cuEventRecord) event_record{};
  decltype(&cuEventSynchronize) event_synchronize{};
  decltype(&cuEventQuery) event_query{};
  decltype(&cuStreamWaitEvent) stream_wait_event{};
  decltype(&cuStreamCreate) stream_create{};
  decltype(&cuStreamDestroy) stream_destroy{};
  decltype(&cuStreamSynchronize) stream_synchronize{};
  decltype(&cuMemHostRegister) mem_host_register{};
  decltype(&cuMemHostUnregister) mem_host_unregister{};
  decltype(&cuMemAlloc) mem_alloc{};
  decltype(&cuMemFree) mem_free{};
  decltype(&cuEventElapsedTime) event_elapsed_time{};
  decltype(&cuStreamIsCapturing) stream_is_capturing{};
  decltype(&cuThreadExchangeStreamCaptureMode) exchange_capture_mode{};
  decltype(&cuStreamCreateWithPriority) stream_create_with_priority{};
  decltype(&cuCtxGetStreamPriorityRange) ctx_get_stream_priority_range{};
};

// Fills `api` from `lib`; returns the first missing symbol, or "" when all are there.
std::string load_api(void* lib, Api& api) {
  std::string missing;
  auto get = [&](auto& fn, const char* name) {
    void* sym = ::dlsym(lib, name);
    if (sym == nullptr && missing.empty()) missing = name;
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(sym);
  };
  get(api.init, "cuInit");
  get(api.driver_get_version, "cuDriverGetVersion");
  get(api.get_error_name, "cuGetErrorName");
  get(api.get_error_string, "cuGetErrorString");
  get(api.device_get_count, "cuDeviceGetCount");
  get(api.device_get, "cuDeviceGet");
  get(api.device_get_name, "cuDeviceGetName");
  get(api.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
  get(api.primary_ctx_release, "cuDevicePrimaryCtxRelease_v2");
  get(api.ctx_set_current, "cuCtxSetCurrent");
  get(api.ctx_get_current, "cuCtxGetCurrent");
  get(api.pointer_get_attribute, "cuPointerGetAttribute");
  get(api.memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2");
  get(api.memcpy_htod_async, "cuMemcpyHtoDAsync_v2");
  get(api.event_create, "cuEventCreate");
  get(api.event_destroy, "cuEventDestroy_v2");
  get(api.event_record, "cuEventRecord");
  get(api.event_synchronize, "cuEventSynchronize");
  get(api.event_query, "cuEventQuery");
  get(api.stream_wait_event, "cuStreamWaitEvent");
  get(api.stream_create, "cuStreamCreate");
  get(api.stream_destroy, "cuStreamDestroy_v2");
  get(api.stream_synchronize, "cuStreamSynchronize");
  get(api.mem_host_register, "cuMemHostRegister_v2");
  get(api.mem_host_unregister, "cuMemHostUnregister");
  get(api.mem_alloc, "cuMemAlloc_v2");
  get(api.mem_free, "cuMemFree_v2");
  get(api.stream_is_capturing, "cuStreamIsCapturing");
  get(api.exchange_capture_mode, "cuThreadExchangeStreamCaptureMode");
  get(api.stream_create_with_priority, "cuStreamCreateWithPriority");
  get(api.ctx_get_stream_priority_range, "cuCtxGetStreamPriorityRange");
  // Optional (timed events only): _v2 in CUDA 12.8+ headers, the same signature before.
  for (const char* name : {"cuEventElapsedTime_v2", "cuEventElapsedTime"}) {
    if (void* sym = ::dlsym(lib, name)) {
      api.event_elapsed_time = reinterpret_cast<decltype(api.event_elapsed_time)>(sym);
      break;
    }
  }
  return missing;
}

std::string name_of(const Api& api, CUresult r) {
  const char* s = nullptr;
  if (api.get_error_name != nullptr && api.get_error_name(r, &s) == CUDA_SUCCESS && s != nullptr)
    return s;
  return detail::concat("CUresult ", static_cast<int>(r));
}

[[noreturn]] void throw_cuda(const Api& api, CUresult r, const char* call) {
  std::string msg = detail::concat(call, " failed: ", name_of(api, r));
  const char* text = nullptr;
  if (api.get_error_string != nullptr && api.get_error_string(r, &text) == CUDA_SUCCESS &&
      text != nullptr)
    msg += detail::concat(" (", text, ")");
  if (r == CUDA_ERROR_INVALID_CONTEXT)
    msg += "; no CUDA context is current on this thread: call bind_device or bind_context_of first";
  switch (r) {
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED:
    case CUDA_ERROR_NO_DEVICE:
      throw Unsupported(msg);
    case CUDA_ERROR_OUT_OF_MEMORY:
      throw IoError(ENOMEM, "", -1, msg);
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
      throw IoError(EINVAL, "", -1, msg);
    default:
      throw IoError(EIO, "", -1, msg);
  }
}

class DriverImpl final : public Driver {
 public:
  DriverImpl(void* lib, const Api& api, int count) : lib_(lib), api_(api), count_(count) {}
  ~DriverImpl() override {
    std::lock_guard lock(mu_);
    for (auto& [ordinal, ctx] : contexts_) {
      CUdevice dev{};
      if (api_.device_get(&dev, ordinal) == CUDA_SUCCESS) api_.primary_ctx_release(dev);
    }
    ::dlclose(lib_);
  }

  const Api& api() const { return api_; }

  void bind_context_of(DevicePtr ptr) override {
    int ordinal = -1;
    CUresult r = api_.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                            static_cast<CUdeviceptr>(ptr));
    EBB_CHECK(r != CUDA_ERROR_INVALID_VALUE, "bind_context_of: pointer 0x", std::hex, ptr,
              " is not memory known to the CUDA driver");
    check(r, "cuPointerGetAttribute(DEVICE_ORDINAL)");
    bind_device(ordinal);
  }

  void bind_device(int ordinal) override {
    EBB_CHECK(ordinal >= 0 && ordinal < count_, "CUDA device ", ordinal, " does not exist (",
              count_, " devices)");
    check(api_.ctx_set_current(primary_context(ordinal)), "cuCtxSetCurrent");
  }

  Context current_context() override {
    CUcontext cur = nullptr;
    check(api_.ctx_get_current(&cur), "cuCtxGetCurrent");
    return reinterpret_cast<Context>(cur);
  }
  void set_current_context(Context c) override {
    check(api_.ctx_set_current(reinterpret_cast<CUcontext>(c)), "cuCtxSetCurrent");
  }

  bool is_device_pointer(const void* ptr) override {
    if (ptr == nullptr) return false;
    unsigned int type = 0;
    CUresult r = api_.pointer_get_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                            reinterpret_cast<CUdeviceptr>(ptr));
    // Memory the driver never saw (ordinary host memory) is INVALID_VALUE.
    if (r == CUDA_ERROR_INVALID_VALUE) return false;
    check(r, "cuPointerGetAttribute(MEMORY_TYPE)");
    if (type == CU_MEMORYTYPE_DEVICE) return true;
    unsigned int managed = 0;
    r = api_.pointer_get_attribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                   reinterpret_cast<CUdeviceptr>(ptr));
    return r == CUDA_SUCCESS && managed != 0;
  }

  void memcpy_dtoh_async(void* dst, DevicePtr src, size_t n, Stream s) override {
    check(api_.memcpy_dtoh_async(dst, static_cast<CUdeviceptr>(src), n, stream(s)),
          "cuMemcpyDtoHAsync");
  }
  void memcpy_htod_async(DevicePtr dst, const void* src, size_t n, Stream s) override {
    check(api_.memcpy_htod_async(static_cast<CUdeviceptr>(dst), src, n, stream(s)),
          "cuMemcpyHtoDAsync");
  }

  Event event_create() override {
    CUevent e = nullptr;
    // Blocking sync: a host thread waiting on it sleeps instead of spinning
    // on a core the training process needs (Note [Spill readiness] in tensor_cache_workers.cpp).
    check(api_.event_create(&e, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC), "cuEventCreate");
    return reinterpret_cast<Event>(e);
  }
  Event event_create_timed() override {
    CUevent e = nullptr;
    check(api_.event_create(&e, CU_EVENT_DEFAULT), "cuEventCreate");
    return reinterpret_cast<Event>(e);
  }
  float event_elapsed_ms(Event start, Event end) override {
    if (api_.event_elapsed_time == nullptr) throw Unsupported("libcuda.so.1 lacks cuEventElapsedTime");
    float ms = 0;
    check(api_.event_elapsed_time(&ms, event(start), event(end)), "cuEventElapsedTime");
    return ms;
  }
  void event_destroy(Event e) override { check(api_.event_destroy(event(e)), "cuEventDestroy"); }
  void event_record(Event e, Stream s) override {
    check(api_.event_record(event(e), stream(s)), "cuEventRecord");
  }
  void event_synchronize(Event e) override {
    check(api_.event_synchronize(event(e)), "cuEventSynchronize");
  }
  bool event_query(Event e) override {
    CUresult r = api_.event_query(event(e));
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, "cuEventQuery");
    return true;
  }
  void stream_wait_event(Stream s, Event e) override {
    check(api_.stream_wait_event(stream(s), event(e), 0), "cuStreamWaitEvent");
  }
  Stream stream_create() override {
    CUstream s = nullptr;
    check(api_.stream_create(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    return reinterpret_cast<Stream>(s);
  }
  std::pair<int, int> stream_priority_range() override {
    int least = 0, greatest = 0;
    check(api_.ctx_get_stream_priority_range(&least, &greatest), "cuCtxGetStreamPriorityRange");
    return {least, greatest};
  }
  Stream stream_create_with_priority(int priority) override {
    CUstream s = nullptr;
    check(api_.stream_create_with_priority(&s, CU_STREAM_NON_BLOCKING, priority), "cuStreamCreateWithPriority");
    return reinterpret_cast<Stream>(s);
  }
  void stream_destroy(Stream s) override { check(api_.stream_destroy(stream(s)), "cuStreamDestroy"); }
  void stream_synchronize(Stream s) override {
    check(api_.stream_synchronize(stream(s)), "cuStreamSynchronize");
  }
  bool stream_is_capturing(Stream s) override {
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    check(api_.stream_is_capturing(stream(s), &status), "cuStreamIsCapturing");
    return status != CU_STREAM_CAPTURE_STATUS_NONE;
  }
  void relax_capture_mode() override { exchange_capture_mode(kCaptureModeRelaxed); }
  int exchange_capture_mode(int mode) override {
    auto m = static_cast<CUstreamCaptureMode>(mode);
    check(api_.exchange_capture_mode(&m), "cuThreadExchangeStreamCaptureMode");
    return static_cast<int>(m);
  }

  // In the calling thread's context, never one made up for the call (Note
  // [Registration context] in host_mapping.cpp): without one, an error, not
  // a refusal.
  bool host_register(void* p, size_t n) override {
    need_context("cuMemHostRegister");
    CUresult r = api_.mem_host_register(p, n, CU_MEMHOSTREGISTER_PORTABLE);
    if (r == CUDA_SUCCESS) return true;
    // Refusals (RLIMIT_MEMLOCK in containers, already registered, ...) cost
    // only asynchrony: copies from pageable memory still work, synchronously.
    log::warn_once("cuda.host_register",
                   detail::concat("cuMemHostRegister of ", config::format_bytes(double(n)),
                                  " refused (", name_of(api_, r),
                                  "): staging buffers stay pageable, device copies will not overlap"));
    return false;
  }
  void host_unregister(void* p) override {
    need_context("cuMemHostUnregister");
    check(api_.mem_host_unregister(p), "cuMemHostUnregister");
  }

  int device_count() override { return count_; }

  DevicePtr mem_alloc(size_t n) override {
    CUdeviceptr p = 0;
    check(api_.mem_alloc(&p, n), "cuMemAlloc");
    return static_cast<DevicePtr>(p);
  }
  void mem_free(DevicePtr p) override { check(api_.mem_free(static_cast<CUdeviceptr>(p)), "cuMemFree"); }

  std::string device_name(int ordinal) override {
    EBB_CHECK(ordinal >= 0 && ordinal < count_, "CUDA device ", ordinal, " does not exist (",
              count_, " devices)");
    CUdevice dev{};
    check(api_.device_get(&dev, ordinal), "cuDeviceGet");
    char name[256] = {};
    check(api_.device_get_name(name, sizeof name - 1, dev), "cuDeviceGetName");
    return name;
  }

 private:
  void check(CUresult r, const char* call) const {
    if (r != CUDA_SUCCESS) [[unlikely]] throw_cuda(api_, r, call);
  }
  // CUDA_ERROR_INVALID_CONTEXT for `call` when the calling thread has no current context.
  void need_context(const char* call) const {
    CUcontext cur = nullptr;
    check(api_.ctx_get_current(&cur), "cuCtxGetCurrent");
    if (cur == nullptr) throw_cuda(api_, CUDA_ERROR_INVALID_CONTEXT, call);
  }
  static CUstream stream(Stream s) { return reinterpret_cast<CUstream>(s); }
  static CUevent event(Event e) { return reinterpret_cast<CUevent>(e); }

  CUcontext primary_context(int ordinal) {
    std::lock_guard lock(mu_);
    auto it = contexts_.find(ordinal);
    if (it != contexts_.end()) return it->second;
    CUdevice dev{};
    check(api_.device_get(&dev, ordinal), "cuDeviceGet");
    CUcontext ctx = nullptr;
    check(api_.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    contexts_.emplace(ordinal, ctx);
    return ctx;
  }

  void* lib_;
  Api api_;
  int count_;
  std::mutex mu_;
  std::unordered_map<int, CUcontext> contexts_;
};

#endif  // EBBTIDE_HAVE_CUDA_H

ebbtide::detail::LoadedOnce<Driver>& global() {
  static auto* g = new ebbtide::detail::LoadedOnce<Driver>();  // leaked on purpose: Note [Shim lifetime]
  return *g;
}

}  // namespace

ProbeResult probe() {
  ProbeResult out;
  if (!config::env_bool("EBBTIDE_CUDA").value_or(true)) {
    out.reason = "disabled by EBBTIDE_CUDA=" + config::env_string("EBBTIDE_CUDA").value_or("0");
    return out;
  }
#ifndef EBBTIDE_HAVE_CUDA_H
  out.reason = "built without cuda.h";
  return out;
#else
  ::dlerror();
  void* lib = ::dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = ::dlerror();
    out.reason = detail::concat("cannot load ", kLibrary, " (no NVIDIA driver?): ",
                                e != nullptr ? e : "unknown dlopen error");
    return out;
  }
  Api api;
  std::string missing = load_api(lib, api);
  if (!missing.empty()) {
    ::dlclose(lib);
    out.reason = detail::concat(kLibrary, " lacks ", missing, " (driver too old)");
    return out;
  }
  CUresult r = api.init(0);
  if (r != CUDA_SUCCESS) {
    out.reason = detail::concat("cuInit failed: ", name_of(api, r));
    ::dlclose(lib);
    return out;
  }
  int count = 0;
  r = api.device_get_count(&count);
  if (r != CUDA_SUCCESS || count <= 0) {
    out.reason = r != CUDA_SUCCESS ? detail::concat("cuDeviceGetCount failed: ", name_of(api, r))
                                   : std::string("no CUDA devices");
    ::dlclose(lib);
    return out;
  }
  out.driver = std::make_unique<DriverImpl>(lib, api, count);
  return out;
#endif
}

Driver* driver() { return global().get(probe, "CUDA driver (without it: host-only mode)"); }

std::string unavailable_reason() {
  if (driver() != nullptr) return {};
  return global().reason();
}

std::string error_name(int result) {
#ifdef EBBTIDE_HAVE_CUDA_H
  Driver* d = nullptr;
  try {
    d = driver();
  } catch (const std::exception&) {
  }
  if (d != nullptr)
    return name_of(static_cast<DriverImpl*>(d)->api(), static_cast<CUresult>(result));
#endif
  return detail::concat("CUresult ", result);
}

}  // namespace ebbtide::mem::cuda
