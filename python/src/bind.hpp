// Binding areas of ebbtide._core. Each python/src/bind_<area>.cpp defines one
// bind_<area>(m); module.cpp calls them in a fixed order.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <exception>

#include "ebbtide/mem/buffer.hpp"

namespace ebbtide::py {

namespace nb = nanobind;

void bind_util(nb::module_& m);
void bind_mem(nb::module_& m);
void bind_io(nb::module_& m);
void bind_cache(nb::module_& m);
void bind_ckpt(nb::module_& m);
void bind_safetensors(nb::module_& m);
void bind_plan(nb::module_& m);

// Sets the Python exception for the exception `p` holds: the core's error
// types as nanobind translates them; with `others`, any other exception too
// (a RuntimeError), else it is rethrown.
void translate_error(const std::exception_ptr& p, bool others);
// ebbtide._core.StateError.
PyObject* state_error_type();

// Releases the GIL in a scope (blocking C++ calls).
using gil_release = nb::gil_scoped_release;

// The memory a Python API names by address, size and a device flag, for core
// calls that find the device from the pointer (io::Engine, checkpoints): a
// device buffer gets ordinal 0 there (mem/buffer.hpp).
inline mem::Buffer pointer_buffer(uintptr_t ptr, uint64_t nbytes, bool device, uintptr_t stream) {
  return {reinterpret_cast<void*>(ptr), nbytes, device ? 0 : mem::kHost, stream};
}

}  // namespace ebbtide::py
