// Tensor and Python helpers of ebbtide._torch (hooks.cpp): a storage's
// identity, functorch wrappers, wrapping and unwrapping torch.Tensor, and the
// errors the hooks raise as Python's glue words them. Included by hooks.cpp
// only; nothing here knows the cache.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <vector>

namespace ebbtide::torch_glue {

namespace nb = nanobind;

// The storage's identity, as Python's untyped_storage()._cdata.
inline uint64_t storage_key(const at::TensorBase& t) {
  return reinterpret_cast<uint64_t>(t.storage().unsafeGetStorageImpl());
}

inline bool functorch_wrapped(const at::Tensor& t) {
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::FuncTorchGradWrapper,
                                            c10::DispatchKey::FuncTorchBatched});
  return !(t.unsafeGetTensorImpl()->key_set() & wrapped).empty();
}

inline nb::object wrap(const at::TensorBase& t) { return nb::steal(THPVariable_Wrap(t)); }

// The error Python's glue raises for a saved tensor changed in place (the
// message autograd gives); made there so both paths word it alike.
[[noreturn]] inline void raise_version_error(const at::Tensor& t, uint64_t saved) {
  nb::module_::import_("ebbtide.cache.hooks").attr("_check_version")(
      nb::handle(reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()))),
      nb::cast(std::vector<int64_t>(t.sizes().begin(), t.sizes().end())), saved, t._version());
  throw nb::python_error();  // _check_version always raises on a mismatch
}

[[noreturn]] inline void raise_runtime(const char* msg) {
  PyErr_SetString(PyExc_RuntimeError, msg);
  throw nb::python_error();
}

inline at::Tensor tensor_arg(nb::handle t) {
  if (!THPVariable_Check(t.ptr())) throw nb::type_error("ebbtide._torch: expected a torch.Tensor");
  return THPVariable_Unpack(t.ptr());
}

inline nb::tuple int_tuple(c10::ArrayRef<int64_t> v) {
  nb::list l;
  for (int64_t x : v) l.append(x);
  return nb::tuple(l);
}

}  // namespace ebbtide::torch_glue
