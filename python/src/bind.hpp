// Binding areas of ebbtide._core. Each python/src/bind_<area>.cpp defines one
// bind_<area>(m); module.cpp calls them in a fixed order.
#pragma once

#include <nanobind/nanobind.h>

namespace ebbtide::py {

namespace nb = nanobind;

void bind_util(nb::module_& m);
void bind_mem(nb::module_& m);
void bind_io(nb::module_& m);
void bind_cache(nb::module_& m);
void bind_ckpt(nb::module_& m);
void bind_safetensors(nb::module_& m);
void bind_plan(nb::module_& m);

// Releases the GIL in a scope (blocking C++ calls).
using gil_release = nb::gil_scoped_release;

}  // namespace ebbtide::py
