// Errors, logging and small utilities shared by every area.
#include <map>
#include <string>

#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include "bind.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace nb = nanobind;

namespace {

PyObject* g_io_error = nullptr;
PyObject* g_checksum_error = nullptr;
PyObject* g_state_error = nullptr;

PyObject* g_module = nullptr;

// Note [Errno subclasses]
// Python code catches FileNotFoundError, PermissionError, IsADirectoryError
// ... by errno; OSError(errno, ...) picks those itself, a subclass such as
// IoError does not. So an IoError is raised as a class deriving from both
// IoError and the errno's builtin class (FileNotFoundIoError for ENOENT:
// `except FileNotFoundError` and `except IoError` both catch it), made once
// per errno under the GIL and put in the module so that pickling finds it
// (DCP's checkpoint process sends exceptions back pickled). Errnos without
// a builtin class (EIO, ENOSPC) raise IoError itself.
PyObject* io_error_type(int err) {
  static std::map<int, PyObject*> types;
  if (auto it = types.find(err); it != types.end()) return it->second;
  PyObject* type = g_io_error;
  if (PyObject* probe = PyObject_CallFunction(PyExc_OSError, "is", err, "")) {
    auto* builtin = reinterpret_cast<PyObject*>(Py_TYPE(probe));
    if (builtin != PyExc_OSError) {
      std::string name = reinterpret_cast<PyTypeObject*>(builtin)->tp_name;  // e.g. "FileNotFoundError"
      if (name.size() > 5 && name.compare(name.size() - 5, 5, "Error") == 0) name.resize(name.size() - 5);
      name += "IoError";
      PyObject* bases = PyTuple_Pack(2, g_io_error, builtin);
      PyObject* made = bases ? PyErr_NewException(("ebbtide._core." + name).c_str(), bases, nullptr) : nullptr;
      Py_XDECREF(bases);
      if (made != nullptr && g_module != nullptr && PyObject_SetAttrString(g_module, name.c_str(), made) == 0)
        type = made;
      else
        PyErr_Clear();
    }
    Py_DECREF(probe);
  } else {
    PyErr_Clear();
  }
  types.emplace(err, type);
  return type;
}

// Raises `type` (an OSError subclass) with errno, message, filename and offset.
void raise_os_error(PyObject* type, const ebbtide::IoError& e) {
  if (type == g_io_error) type = io_error_type(e.err());
  PyObject* args = Py_BuildValue("(is)", e.err(), e.what());
  PyObject* exc = args ? PyObject_CallObject(type, args) : nullptr;
  Py_XDECREF(args);
  if (exc == nullptr) return;  // error already set
  if (!e.path().empty()) {
    PyObject* fn = PyUnicode_DecodeFSDefault(e.path().c_str());
    if (fn) PyObject_SetAttrString(exc, "filename", fn);
    Py_XDECREF(fn);
  }
  PyObject* off = PyLong_FromLongLong(e.offset());
  if (off) PyObject_SetAttrString(exc, "offset", off);
  Py_XDECREF(off);
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
}

}  // namespace

// The Python exception for a core error; `others` also turns any other C++
// exception into a RuntimeError (callers outside nanobind's own translation).
void ebbtide::py::translate_error(const std::exception_ptr& p, bool others) {
  try {
    std::rethrow_exception(p);
  } catch (const ebbtide::ChecksumError& e) {
    raise_os_error(g_checksum_error, e);
  } catch (const ebbtide::IoError& e) {
    raise_os_error(g_io_error, e);
  } catch (const ebbtide::InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const ebbtide::StateError& e) {
    PyErr_SetString(g_state_error, e.what());
  } catch (const ebbtide::Unsupported& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what());
  } catch (nb::python_error& e) {
    if (!others) throw;
    e.restore();
  } catch (const std::exception& e) {
    if (!others) throw;
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

PyObject* ebbtide::py::state_error_type() { return g_state_error; }

namespace {

// Python value -> config::Value (bool before int: bool is an int in Python).
ebbtide::config::Value to_value(nb::handle v) {
  if (nb::isinstance<nb::bool_>(v)) return nb::cast<bool>(v);
  if (nb::isinstance<nb::int_>(v)) return nb::cast<int64_t>(v);
  if (nb::isinstance<nb::float_>(v)) return nb::cast<double>(v);
  if (nb::isinstance<nb::str>(v)) return nb::cast<std::string>(v);
  throw ebbtide::InvalidArgument("a setting's value must be a bool, int, float or str, not " +
                                 nb::cast<std::string>(nb::str(v.type())));
}

nb::object to_python(const ebbtide::config::Value& v) {
  return std::visit([](const auto& x) -> nb::object { return nb::cast(x); }, v);
}

}  // namespace

void ebbtide::py::bind_util(nb::module_& m) {
  g_io_error = PyErr_NewExceptionWithDoc(
      "ebbtide._core.IoError",
      "An I/O or system call failed; errno, filename and offset name the cause.", PyExc_OSError,
      nullptr);
  g_checksum_error = PyErr_NewExceptionWithDoc(
      "ebbtide._core.ChecksumError", "Data read back failed its crc32c checksum.", g_io_error,
      nullptr);
  g_state_error = PyErr_NewExceptionWithDoc(
      "ebbtide._core.StateError", "An operation is not valid in the object's current state.",
      PyExc_RuntimeError, nullptr);
  g_module = m.ptr();  // the module lives as long as the process
  m.attr("IoError") = nb::handle(g_io_error);
  m.attr("ChecksumError") = nb::handle(g_checksum_error);
  m.attr("StateError") = nb::handle(g_state_error);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) { translate_error(p, false); });

  m.def("parse_bytes", [](const std::string& s, const std::string& what) {
    return ebbtide::config::parse_bytes(s, what);
  }, nb::arg("text"), nb::arg("what") = "size");
  m.def("format_bytes", &ebbtide::config::format_bytes);

  using ebbtide::config::Setting;
  nb::class_<Setting>(m, "Setting", "One EBBTIDE_* setting: a row of the core's settings table.")
      .def_prop_ro("name", [](const Setting& s) { return std::string(s.name); })
      .def_prop_ro("kind", [](const Setting& s) { return std::string(ebbtide::config::to_string(s.kind)); })
      .def_prop_ro("section", [](const Setting& s) { return std::string(s.section); })
      .def_prop_ro("default", [](const Setting& s) { return std::string(s.default_text); })
      .def_prop_ro("meaning", [](const Setting& s) { return std::string(s.meaning); })
      .def_ro("min", &Setting::min)
      .def_ro("max", &Setting::max)
      .def_prop_ro("choices", [](const Setting& s) {
        return std::vector<std::string>(s.choices.begin(), s.choices.end());
      });
  m.def("settings", &ebbtide::config::settings, nb::rv_policy::reference,
        "Every EBBTIDE_* setting, in documentation order.");
  m.def("env_setting", [](const std::string& name) -> nb::object {
    auto v = ebbtide::config::env_value(name);
    return v ? to_python(*v) : nb::none();
  }, nb::arg("name"), "The variable's value parsed as its kind; None when unset; ValueError naming it when bad.");
  m.def("check_setting", [](const std::string& name, nb::handle value, const std::string& what) {
    return to_python(ebbtide::config::check_argument(name, to_value(value), what));
  }, nb::arg("name"), nb::arg("value"), nb::arg("what"),
     "An argument backing setting `name`, checked against its row; ValueError naming `what` when bad.");
  m.def("crc32c", [](nb::bytes data, uint32_t crc) {
    return ebbtide::crc32c(data.c_str(), data.size(), crc);
  }, nb::arg("data"), nb::arg("crc") = 0);
  m.def("set_log_level", [](const std::string& level) {
    ebbtide::log::set_level(ebbtide::log::parse_level(level, "ebbtide.set_log_level"));
  }, nb::arg("level"), "error, warn, info or debug (the choices of EBBTIDE_LOG_LEVEL).");

  nb::dict build;
#ifdef EBBTIDE_HAVE_LIBURING
  build["liburing"] = true;
#else
  build["liburing"] = false;
#endif
#ifdef EBBTIDE_HAVE_CUDA_H
  build["cuda_shim"] = true;
#else
  build["cuda_shim"] = false;
#endif
#ifdef EBBTIDE_HAVE_ZSTD
  build["zstd"] = true;
#else
  build["zstd"] = false;
#endif
  m.attr("build_info") = build;
}
