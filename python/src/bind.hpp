// Registration of binding areas. Each python/src/bind_<area>.cpp declares
//   EBB_BIND(area, order) { ... m.def(...) ... }
// and module.cpp runs them in `order` (lower first: errors before users of
// them). This keeps areas independent: adding one edits no shared file.
#pragma once

#include <nanobind/nanobind.h>

#include <functional>

namespace ebbtide::py {

namespace nb = nanobind;

using BindFn = void (*)(nb::module_&);
struct BindRegistrar {
  BindRegistrar(const char* name, int order, BindFn fn);
};

// Releases the GIL in a scope (blocking C++ calls).
using gil_release = nb::gil_scoped_release;

}  // namespace ebbtide::py

#define EBB_BIND(area, order)                                                      \
  static void ebb_bind_##area(::nanobind::module_& m);                             \
  static ::ebbtide::py::BindRegistrar ebb_bind_registrar_##area(#area, order, &ebb_bind_##area); \
  static void ebb_bind_##area([[maybe_unused]] ::nanobind::module_& m)
