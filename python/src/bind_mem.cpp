// mem: whether the CUDA driver and cuFile shims are usable in this process.
#include <nanobind/stl/string.h>

#include "bind.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/cufile_shim.hpp"
#include "ebbtide/mem/fork_origin.hpp"

namespace mem = ebbtide::mem;

void ebbtide::py::bind_mem(nb::module_& m) {
  m.def("fork_generation", &mem::fork_generation,
        "Forks between the first process and this one (Note [Objects across fork]).");
  // First calls load libcuda / libcufile (seconds on some machines): no GIL.
  m.def("cuda_available", [] {
    ebbtide::py::gil_release nogil;
    return mem::cuda::driver() != nullptr;
  }, "True when the CUDA driver shim loaded (libcuda.so.1, >= 1 device, EBBTIDE_CUDA not 0).");
  m.def("cuda_unavailable_reason", [] {
    ebbtide::py::gil_release nogil;
    return mem::cuda::unavailable_reason();
  }, "Why the CUDA shim is unavailable; '' when it is available.");
  m.def("cufile_available", [] {
    ebbtide::py::gil_release nogil;
    return mem::cufile::cufile() != nullptr;
  }, "True when cuFile (libcufile.so.0) opened; needs the CUDA shim and EBBTIDE_CUFILE not 0.");
  m.def("cufile_unavailable_reason", [] {
    ebbtide::py::gil_release nogil;
    return mem::cufile::unavailable_reason();
  }, "Why cuFile is unavailable; '' when it is available.");
}
