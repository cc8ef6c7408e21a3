#include "ebbtide/mem/cufile_shim.hpp"

#include <dlfcn.h>
#include <unistd.h>
#include <sys/types.h>

#include <cerrno>
#include <exception>
#include <mutex>
#include <optional>
#include <type_traits>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
#include "detail/loaded_once.hpp"

namespace ebbtide::mem::cufile {

namespace {

// Note [cuFile declarations]
// cufile.h is not installed on the build machines (it ships with GDS, not with
// the CUDA headers), so the few types and entry points used here are declared
// from NVIDIA's public cuFile API reference. Only layouts the reference fixes
// are relied on: CUfileError_t is {CUfileOpError err; CUresult cu_err} (two
// C enums, int sized); CUfileDescr_t is {type, union {int fd; void* handle},
// const CUfileFSOps_t* fs_ops}; CUfileHandle_t is an opaque pointer. cuFileRead
// and cuFileWrite return the byte count, -1 with errno for a system error, or
// the negative CUfileOpError. If a cufile.h ever becomes available, prefer it.
extern "C" {
enum CUfileOpErrorDecl : int { kCuFileSuccess = 0, kCuFileCudaDriverError = 5011 };
struct CUfileError_t {
  int err;     // CUfileOpError
  int cu_err;  // CUresult, meaningful when err == CU_FILE_CUDA_DRIVER_ERROR
};
enum CUfileFileHandleTypeDecl : int { kCuFileHandleTypeOpaqueFd = 1 };
struct CUfileDescr_t {
  int type;  // CUfileFileHandleType
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;  // const CUfileFSOps_t*; nullptr for kernel file systems
};
using CUfileHandle_t = void*;

using DriverOpenFn = CUfileError_t (*)();
using DriverCloseFn = CUfileError_t (*)();
using HandleRegisterFn = CUfileError_t (*)(CUfileHandle_t*, CUfileDescr_t*);
using HandleDeregisterFn = void (*)(CUfileHandle_t);
using BufRegisterFn = CUfileError_t (*)(const void*, size_t, int);
using BufDeregisterFn = CUfileError_t (*)(const void*);
using ReadFn = ssize_t (*)(CUfileHandle_t, void*, size_t, off_t, off_t);
using WriteFn = ssize_t (*)(CUfileHandle_t, const void*, size_t, off_t, off_t);
}

constexpr const char* kLibrary = "libcufile.so.0";

struct Api {
  DriverOpenFn driver_open{};
  DriverCloseFn driver_close{};
  HandleRegisterFn handle_register{};
  HandleDeregisterFn handle_deregister{};
  BufRegisterFn buf_register{};
  BufDeregisterFn buf_deregister{};
  ReadFn read{};
  WriteFn write{};
};

std::string describe(CUfileError_t e) {
  std::string s = detail::concat("cuFile error ", e.err);
  if (e.err == kCuFileCudaDriverError || e.cu_err != 0)
    s += detail::concat(" (", cuda::error_name(e.cu_err), ")");
  return s;
}

// cuFileDriverOpen/Close are process-wide; count our own opens so that a
// probe() beside the process-wide driver never closes cuFile under it.
std::mutex g_open_mu;
int g_opens = 0;

class DriverImpl final : public Driver {
 public:
  DriverImpl(void* lib, const Api& api) : lib_(lib), api_(api) {}
  ~DriverImpl() override {
    {
      std::lock_guard lock(g_open_mu);
      if (--g_opens == 0) api_.driver_close();
    }
    ::dlclose(lib_);
  }

  Handle handle_register(int fd) override {
    EBB_CHECK(fd >= 0, "cuFileHandleRegister: invalid file descriptor ", fd);
    CUfileDescr_t descr{};
    descr.type = kCuFileHandleTypeOpaqueFd;
    descr.handle.fd = fd;
    descr.fs_ops = nullptr;
    CUfileHandle_t h = nullptr;
    CUfileError_t e = api_.handle_register(&h, &descr);
    if (e.err != kCuFileSuccess)
      throw IoError(EIO, detail::concat("fd ", fd), -1,
                    detail::concat("cuFileHandleRegister failed: ", describe(e)));
    return reinterpret_cast<Handle>(h);
  }

  void handle_deregister(Handle h) override {
    if (h != 0) api_.handle_deregister(reinterpret_cast<CUfileHandle_t>(h));
  }

  void buf_register(const void* dev_ptr, size_t n) override {
    CUfileError_t e = api_.buf_register(dev_ptr, n, 0);
    if (e.err != kCuFileSuccess)
      throw IoError(EIO, "", -1,
                    detail::concat("cuFileBufRegister of ", n, " bytes at ", dev_ptr,
                                   " failed: ", describe(e)));
  }

  void buf_deregister(const void* dev_ptr) override {
    CUfileError_t e = api_.buf_deregister(dev_ptr);
    if (e.err != kCuFileSuccess)
      throw IoError(EIO, "", -1,
                    detail::concat("cuFileBufDeregister at ", dev_ptr, " failed: ", describe(e)));
  }

  size_t read(Handle h, void* dev_ptr, size_t n, int64_t offset, int64_t dev_offset) override {
    EBB_CHECK(offset >= 0 && dev_offset >= 0, "cuFileRead: negative offset");
    ssize_t r = api_.read(reinterpret_cast<CUfileHandle_t>(h), dev_ptr, n, off_t(offset),
                          off_t(dev_offset));
    check(r, errno, "cuFileRead", offset);
    return static_cast<size_t>(r);
  }

  size_t write(Handle h, const void* dev_ptr, size_t n, int64_t offset, int64_t dev_offset) override {
    EBB_CHECK(offset >= 0 && dev_offset >= 0, "cuFileWrite: negative offset");
    ssize_t r = api_.write(reinterpret_cast<CUfileHandle_t>(h), dev_ptr, n, off_t(offset),
                           off_t(dev_offset));
    check(r, errno, "cuFileWrite", offset);
    return static_cast<size_t>(r);
  }

 private:
  static void check(ssize_t r, int err, const char* call, int64_t offset) {
    if (r >= 0) return;
    if (r == -1) throw IoError(err != 0 ? err : EIO, "", offset, detail::concat(call, " failed"));
    throw IoError(EIO, "", offset, detail::concat(call, " failed: cuFile error ", -r));
  }

  void* lib_;
  Api api_;
};

ebbtide::detail::LoadedOnce<Driver>& global() {
  static auto* g = new ebbtide::detail::LoadedOnce<Driver>();  // leaked on purpose, as the CUDA shim's
  return *g;
}

}  // namespace

// Note [cuFile needs nvidia-fs]
// Without the GPUDirect Storage kernel module (nvidia-fs) cuFile can only run
// in its compatibility mode, a POSIX path through cuFile's own bounce buffers:
// no faster than the engine's pinned staging, and on the lent H100 (a VM with
// libcufile but no nvidia-fs, 2026-11-23) cuFileHandleRegister failed (error
// 5027) on every file. So cuFile is used only when the module is loaded,
// unless EBBTIDE_CUFILE=1. (The crash that followed that failure there came
// from the module's build, not from cuFile: scripts/gpu_check.sh.)
constexpr const char* kNvidiaFs = "/proc/driver/nvidia-fs";

ProbeResult probe() {
  ProbeResult out;
  const std::optional<bool> setting = config::env_bool("EBBTIDE_CUFILE");
  if (setting == false) {
    out.reason = "disabled by EBBTIDE_CUFILE=" + config::env_string("EBBTIDE_CUFILE").value_or("0");
    return out;
  }
  // cuFile runs on top of the CUDA driver; without one it cannot work.
  if (cuda::driver() == nullptr) {
    out.reason = "no CUDA driver: " + cuda::unavailable_reason();
    return out;
  }
  if (!setting && ::access(kNvidiaFs, F_OK) != 0) {
    out.reason = detail::concat("GPUDirect Storage kernel module not loaded (no ", kNvidiaFs,
                                "); EBBTIDE_CUFILE=1 forces cuFile's compatibility mode");
    return out;
  }
  ::dlerror();
  void* lib = ::dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = ::dlerror();
    out.reason = detail::concat("cannot load ", kLibrary, " (GPUDirect Storage not installed?): ",
                                e != nullptr ? e : "unknown dlopen error");
    return out;
  }
  Api api;
  std::string missing;
  auto get = [&](auto& fn, const char* name) {
    void* sym = ::dlsym(lib, name);
    if (sym == nullptr && missing.empty()) missing = name;
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(sym);
  };
  get(api.driver_open, "cuFileDriverOpen");
  // Newer libcufile versions the close call; cufile.h maps the name to _v2.
  api.driver_close = reinterpret_cast<DriverCloseFn>(::dlsym(lib, "cuFileDriverClose_v2"));
  if (api.driver_close == nullptr) get(api.driver_close, "cuFileDriverClose");
  get(api.handle_register, "cuFileHandleRegister");
  get(api.handle_deregister, "cuFileHandleDeregister");
  get(api.buf_register, "cuFileBufRegister");
  get(api.buf_deregister, "cuFileBufDeregister");
  get(api.read, "cuFileRead");
  get(api.write, "cuFileWrite");
  if (!missing.empty()) {
    ::dlclose(lib);
    out.reason = detail::concat(kLibrary, " lacks ", missing);
    return out;
  }
  {
    std::lock_guard lock(g_open_mu);
    if (g_opens == 0) {
      CUfileError_t e = api.driver_open();
      if (e.err != kCuFileSuccess) {
        ::dlclose(lib);
        out.reason = detail::concat("cuFileDriverOpen failed: ", describe(e));
        return out;
      }
    }
    ++g_opens;
  }
  out.driver = std::make_unique<DriverImpl>(lib, api);
  return out;
}

Driver* cufile() { return global().get(probe, "cuFile driver"); }

std::string unavailable_reason() {
  if (cufile() != nullptr) return {};
  return global().reason();
}

}  // namespace ebbtide::mem::cufile
