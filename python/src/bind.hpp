// Binding areas of ebbtide._core. Each python/src/bind_<area>.cpp defines one
// bind_<area>(m); module.cpp calls them in a fixed order.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <exception>
#include <type_traits>
#include <utility>

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

// A capsule owning `owner`, moved onto the heap, and that heap object: what a
// tensor over memory the owner holds (its data, a buffer it keeps) keeps alive.
template <class Owner, class Kept = std::decay_t<Owner>>
std::pair<nb::capsule, Kept*> owning_capsule(Owner&& owner) {
  auto* keep = new Kept(std::forward<Owner>(owner));
  return {nb::capsule(keep, [](void* p) noexcept { delete static_cast<Kept*>(p); }), keep};
}

// `n` T at `data` as a 1-D torch tensor that keeps `owner` (a capsule) alive.
template <class T>
nb::object tensor_1d(T* data, uint64_t n, const nb::capsule& owner) {
  return nb::cast(nb::ndarray<nb::pytorch, T, nb::ndim<1>>(data, {static_cast<size_t>(n)}, owner));
}

}  // namespace ebbtide::py
