// NVIDIA cuFile (GPUDirect Storage) loaded at run time with
// dlopen("libcufile.so.0"): file <-> device memory without a host bounce.
//
// Optional everywhere: cufile() returns nullptr (reason in
// unavailable_reason()) when there is no CUDA driver, no libcufile, the
// cuFile driver does not open, EBBTIDE_CUFILE=0, or the nvidia-fs kernel module
// is not loaded and EBBTIDE_CUFILE is unset (Note [cuFile needs nvidia-fs] in
// cufile_shim.cpp; EBBTIDE_CUFILE=1 forces it); callers then stage through
// pinned host memory. Calls are synchronous and thread safe; the calling
// thread must have the buffer's CUDA context current (cuda::Driver::
// bind_context_of). Failures throw IoError naming the call and the offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace ebbtide::mem::cufile {

using Handle = uintptr_t;  // CUfileHandle_t (opaque)

class Driver {
 public:
  virtual ~Driver() = default;
  // Registers an open file (O_DIRECT for the GPUDirect path) with cuFile. The
  // fd must stay open until handle_deregister.
  virtual Handle handle_register(int fd) = 0;
  virtual void handle_deregister(Handle h) = 0;
  // Registers device memory [dev_ptr, dev_ptr + n) for faster transfers
  // (optional: unregistered device memory works, through cuFile's own bounce).
  virtual void buf_register(const void* dev_ptr, size_t n) = 0;
  virtual void buf_deregister(const void* dev_ptr) = 0;
  // Reads up to n bytes at file `offset` into device memory dev_ptr + dev_offset;
  // returns the bytes read (short only at end of file).
  virtual size_t read(Handle h, void* dev_ptr, size_t n, int64_t offset, int64_t dev_offset = 0) = 0;
  // Writes n bytes from dev_ptr + dev_offset at file `offset`; returns bytes written.
  virtual size_t write(Handle h, const void* dev_ptr, size_t n, int64_t offset,
                       int64_t dev_offset = 0) = 0;
};

// The process-wide cuFile driver (opened once, never closed), or nullptr with
// the reason logged once at info level. A bad EBBTIDE_CUFILE throws InvalidArgument.
Driver* cufile();
std::string unavailable_reason();

// One independent attempt (reads EBBTIDE_CUFILE now); the driver it returns
// closes cuFile when destroyed. For tests and diagnostics.
struct ProbeResult {
  std::unique_ptr<Driver> driver;
  std::string reason;
};
ProbeResult probe();

}  // namespace ebbtide::mem::cufile
