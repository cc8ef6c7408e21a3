// Errors, logging and small utilities shared by every area.
#include <nanobind/stl/string.h>

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

// Raises `type` (an OSError subclass) with errno, message, filename and offset.
void raise_os_error(PyObject* type, const ebbtide::IoError& e) {
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
  m.attr("IoError") = nb::handle(g_io_error);
  m.attr("ChecksumError") = nb::handle(g_checksum_error);
  m.attr("StateError") = nb::handle(g_state_error);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
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
    }
  });

  m.def("parse_bytes", [](const std::string& s, const std::string& what) {
    return ebbtide::config::parse_bytes(s, what);
  }, nb::arg("text"), nb::arg("what") = "size");
  m.def("format_bytes", &ebbtide::config::format_bytes);
  m.def("crc32c", [](nb::bytes data, uint32_t crc) {
    return ebbtide::crc32c(data.c_str(), data.size(), crc);
  }, nb::arg("data"), nb::arg("crc") = 0);
  m.def("set_log_level", [](const std::string& level) {
    using L = ebbtide::log::Level;
    if (level == "error") ebbtide::log::set_level(L::kError);
    else if (level == "warn" || level == "warning") ebbtide::log::set_level(L::kWarn);
    else if (level == "info") ebbtide::log::set_level(L::kInfo);
    else if (level == "debug") ebbtide::log::set_level(L::kDebug);
    else throw ebbtide::InvalidArgument("log level '" + level + "' is not valid (valid: error, warn, info, debug)");
  });

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
