// Freeing, in a forked child, the instances the parent made without running
// their destructors (Note [Objects across fork] in ebbtide/mem/fork_origin.hpp);
// used by ebbtide._core and ebbtide._torch.
#pragma once

#include <nanobind/nanobind.h>

namespace ebbtide::py {

namespace nb = nanobind;

// An instance of T (a mem::ForkOrigin, or with its made_in_this_process())
// that another process made is marked "no destructor" and then goes to
// nanobind's own dealloc, which frees its memory and keeps nanobind's
// bookkeeping (its map of live instances) right.
// Instances made here, and those whose __init__ never ran, are untouched.
// Call once per class, after nb::class_<T>(...).
template <class T>
struct ForkSafeDealloc {
  static inline destructor nanobind_dealloc = nullptr;
  static void dealloc(PyObject* self) {
    const nb::handle h(self);
    const auto [ready, destruct] = nb::inst_state(h);
    if (ready && destruct && !nb::inst_ptr<T>(h)->made_in_this_process()) {
      nb::inst_set_state(h, true, false);
      // What the skipped destructor would have released (the Python objects
      // it holds) stays referenced: a leak on purpose, which nanobind would
      // list at this process's exit. Only a forked child gets here.
      nb::set_leak_warnings(false);
    }
    nanobind_dealloc(self);
  }
};
template <class T>
void leak_in_forked_children(nb::handle cls) {
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  if (type->tp_dealloc == &ForkSafeDealloc<T>::dealloc) return;
  ForkSafeDealloc<T>::nanobind_dealloc = type->tp_dealloc;
  type->tp_dealloc = &ForkSafeDealloc<T>::dealloc;
}

}  // namespace ebbtide::py
