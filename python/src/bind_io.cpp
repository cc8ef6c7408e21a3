// Bindings of the storage engine (ebbtide/io/engine.hpp) and its benchmark.
// Python buffers passed to write()/read() stay referenced until their request
// is done: the engine wrapper keeps them in a list swept on every call, so no
// engine thread ever touches Python objects or the GIL.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <mutex>
#include <vector>

#include "fork_safe.hpp"
#include "bind.hpp"
#include "ebbtide/mem/fork_origin.hpp"
#include "ebbtide/io/bench.hpp"
#include "ebbtide/io/engine.hpp"
#include "ebbtide/util/error.hpp"

namespace nb = nanobind;
namespace io = ebbtide::io;

namespace {

// A Python buffer held for the lifetime of one request.
struct HeldBuffer {
  Py_buffer view{};
  bool held = false;
  HeldBuffer() = default;
  HeldBuffer(const HeldBuffer&) = delete;
  ~HeldBuffer() {
    if (held) PyBuffer_Release(&view);  // callers hold the GIL
  }
};

class PyEngine : public ebbtide::mem::ForkOrigin {
 public:
  explicit PyEngine(io::EngineOptions o) : engine_(std::move(o)) {}
  ~PyEngine() {
    {
      nb::gil_scoped_release nogil;
      try {
        engine_.close();
      } catch (...) {
      }
    }
    held_.clear();
  }

  io::Request write(io::SlotId slot, nb::handle obj) { return submit(slot, obj, true); }
  io::Request read(io::SlotId slot, nb::handle obj) { return submit(slot, obj, false); }

  io::Request submit_ptr(io::SlotId slot, uintptr_t ptr, uint64_t nbytes, bool device, uintptr_t stream,
                         bool write) {
    sweep();
    const ebbtide::mem::Buffer b = ebbtide::py::pointer_buffer(ptr, nbytes, device, stream);
    return write ? engine_.write(slot, b) : engine_.read(slot, b);
  }

  io::Engine& engine() { return engine_; }

  void sweep() {
    std::erase_if(held_, [](const auto& h) { return h.first.done(); });
  }
  void drain() {
    {
      nb::gil_scoped_release nogil;
      engine_.drain();
    }
    sweep();
  }
  void close() {
    {
      nb::gil_scoped_release nogil;
      engine_.close();
    }
    held_.clear();
  }
  size_t held() const { return held_.size(); }

 private:
  io::Request submit(io::SlotId slot, nb::handle obj, bool write) {
    sweep();
    auto h = std::make_unique<HeldBuffer>();
    int flags = PyBUF_C_CONTIGUOUS | (write ? 0 : PyBUF_WRITABLE);
    if (PyObject_GetBuffer(obj.ptr(), &h->view, flags) != 0) {
      PyErr_Clear();
      throw ebbtide::InvalidArgument(ebbtide::detail::concat(
          write ? "write" : "read", " of slot ", slot, ": expected a ", write ? "" : "writable ",
          "C-contiguous buffer (bytes, bytearray, memoryview, numpy array), got ",
          nb::inst_name(obj).c_str()));
    }
    h->held = true;
    ebbtide::mem::Buffer b{h->view.buf, static_cast<uint64_t>(h->view.len)};
    io::Request r = write ? engine_.write(slot, b) : engine_.read(slot, b);
    held_.emplace_back(r, std::move(h));
    return r;
  }

  io::Engine engine_;
  std::vector<std::pair<io::Request, std::unique_ptr<HeldBuffer>>> held_;
};

nb::dict stats_dict(const io::EngineStats& s) {
  nb::dict d;
  d["backend"] = s.backend;
  d["bytes_written"] = s.bytes_written;
  d["bytes_read"] = s.bytes_read;
  d["writes"] = s.writes;
  d["reads"] = s.reads;
  d["write_errors"] = s.write_errors;
  d["read_errors"] = s.read_errors;
  d["cancelled"] = s.cancelled;
  d["pending"] = s.pending;
  d["slots_live"] = s.slots_live;
  d["bytes_reserved"] = s.bytes_reserved;
  d["bytes_stored"] = s.bytes_stored;
  d["slab_bytes"] = s.slab_bytes;
  d["alignment"] = s.alignment;
  d["direct"] = s.direct;
  return d;
}

}  // namespace

void ebbtide::py::bind_io(nb::module_& m) {
  nb::class_<io::Request>(m, "Request", "Handle to one submitted write or read.")
      .def("wait", [](const io::Request& r) {
        nb::gil_scoped_release nogil;
        r.wait();
      }, "Blocks (without the GIL) until done; raises the request's error (OSError subclass, or "
         "StateError when cancelled).")
      .def("done", &io::Request::done)
      .def("ok", &io::Request::ok)
      .def("cancelled", &io::Request::cancelled)
      .def_prop_ro("slot", &io::Request::slot)
      .def_prop_ro("nbytes", &io::Request::nbytes)
      .def_prop_ro("is_write", &io::Request::is_write);

  nb::class_<PyEngine>(m, "Engine", "Asynchronous storage engine over slab files (see ebbtide.io).")
      .def("__init__",
           [](PyEngine* self, std::vector<std::string> dirs, const std::string& backend, uint64_t chunk_bytes,
              unsigned queue_depth, uint64_t capacity_bytes, bool checksum, bool direct, uint64_t staging_bytes) {
             io::EngineOptions o;
             o.dirs = std::move(dirs);
             o.backend = io::parse_backend(backend);
             o.chunk_bytes = chunk_bytes;
             o.queue_depth = queue_depth;
             o.capacity_bytes = capacity_bytes;
             o.checksum = checksum;
             o.direct = direct;
             o.staging_bytes = staging_bytes;
             o = o.with_env();
             nb::gil_scoped_release nogil;
             new (self) PyEngine(std::move(o));
           },
           nb::arg("dirs"), nb::arg("backend") = "auto", nb::arg("chunk_bytes") = 1u << 20,
           nb::arg("queue_depth") = 16, nb::arg("capacity_bytes") = 0, nb::arg("checksum") = false,
           nb::arg("direct") = true, nb::arg("staging_bytes") = 64u << 20)
      .def("allocate", [](PyEngine& e, uint64_t n) { return e.engine().allocate(n); }, nb::arg("nbytes"))
      .def("free", [](PyEngine& e, io::SlotId s) { e.engine().free(s); }, nb::arg("slot"))
      .def("write", &PyEngine::write, nb::arg("slot"), nb::arg("buffer"))
      .def("read", &PyEngine::read, nb::arg("slot"), nb::arg("buffer"))
      .def("write_ptr",
           [](PyEngine& e, io::SlotId slot, uintptr_t ptr, uint64_t n, bool device, uintptr_t stream) {
             return e.submit_ptr(slot, ptr, n, device, stream, true);
           },
           nb::arg("slot"), nb::arg("ptr"), nb::arg("nbytes"), nb::arg("device") = false, nb::arg("stream") = 0)
      .def("read_ptr",
           [](PyEngine& e, io::SlotId slot, uintptr_t ptr, uint64_t n, bool device, uintptr_t stream) {
             return e.submit_ptr(slot, ptr, n, device, stream, false);
           },
           nb::arg("slot"), nb::arg("ptr"), nb::arg("nbytes"), nb::arg("device") = false, nb::arg("stream") = 0)
      .def("cancel", [](PyEngine& e, const io::Request& r) { return e.engine().cancel(r); }, nb::arg("request"))
      .def("drain", &PyEngine::drain)
      .def("close", &PyEngine::close)
      .def("closed", [](PyEngine& e) { return e.engine().closed(); })
      .def("slot_capacity", [](PyEngine& e, io::SlotId s) { return e.engine().slot_capacity(s); })
      .def("stored_bytes", [](PyEngine& e, io::SlotId s) { return e.engine().stored_bytes(s); })
      .def("stats", [](PyEngine& e) { return stats_dict(e.engine().stats()); })
      .def_prop_ro("backend", [](PyEngine& e) { return std::string(io::to_string(e.engine().backend())); })
      .def("describe", [](PyEngine& e) { return e.engine().describe(); })
      .def("_held_buffers", &PyEngine::held)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyEngine& e, nb::args) { e.close(); });

  m.def("bench_io",
        [](std::vector<std::string> dirs, uint64_t size, uint64_t chunk, unsigned qd, const std::string& backend,
           uint64_t request, bool checksum, bool device, bool verify, bool huge_pages) {
          io::BenchOptions o;
          o.dirs = std::move(dirs);
          o.total_bytes = size;
          o.chunk_bytes = chunk;
          o.queue_depth = qd;
          o.backend = io::parse_backend(backend);
          o.request_bytes = request;
          o.checksum = checksum;
          o.device = device;
          o.verify = verify;
          o.huge_pages = huge_pages;
          io::BenchResult r;
          {
            nb::gil_scoped_release nogil;
            r = io::run_io_bench(o);
          }
          nb::dict d;
          d["backend"] = r.backend;
          d["describe"] = r.describe;
          d["bytes"] = r.bytes;
          d["write_gbps"] = r.write_gbps;
          d["read_gbps"] = r.read_gbps;
          d["write_seconds"] = r.write_seconds;
          d["read_seconds"] = r.read_seconds;
          d["device_measured"] = r.device_measured;
          d["device_write_gbps"] = r.device_write_gbps;
          d["device_read_gbps"] = r.device_read_gbps;
          d["direct"] = r.direct;
          d["verified"] = r.verified;
          d["huge_pages"] = r.huge_pages;
          return d;
        },
        nb::arg("dirs"), nb::arg("size"), nb::arg("chunk") = 1u << 20, nb::arg("qd") = 16,
        nb::arg("backend") = "auto", nb::arg("request") = 64u << 20, nb::arg("checksum") = false,
        nb::arg("device") = true, nb::arg("verify") = true, nb::arg("huge_pages") = true,
        "Writes then reads back `size` bytes through the engine; returns GB/s and what was used.");
  leak_in_forked_children<PyEngine>(m.attr("Engine"));  // Note [Objects across fork]
}
