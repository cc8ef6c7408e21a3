// safetensors bindings: the Python glue (ebbtide/checkpoint/safetensors.py) maps torch
// dtypes and allocates tensors; parsing, validation and I/O are the core's.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "fork_safe.hpp"
#include "bind.hpp"
#include "ebbtide/ckpt/safetensors.hpp"

namespace nb = nanobind;
namespace st = ebbtide::ckpt::safetensors;

namespace {

st::IoOptions io_options(std::optional<bool> direct) {
  st::IoOptions o = st::IoOptions::from_env();
  if (direct) o.direct = *direct;
  return o;
}

// (name, dtype, shape, ptr, nbytes, device, stream)
using SaveTuple = std::tuple<std::string, std::string, std::vector<uint64_t>, uintptr_t, uint64_t, bool, uintptr_t>;
// (tensor index, ptr, nbytes, device, stream, own_blocks)
using ReadTuple = std::tuple<size_t, uintptr_t, uint64_t, bool, uintptr_t, bool>;

}  // namespace

void ebbtide::py::bind_safetensors(nb::module_& m) {
  m.def("safetensors_dtype_bits", [](const std::string& d) { return st::dtype_bits(d); }, nb::arg("dtype"));

  nb::class_<st::Reader>(m, "SafetensorsReader")
      .def("__init__",
           [](st::Reader* self, const std::string& path, std::optional<bool> direct) {
             st::IoOptions o = io_options(direct);
             ebbtide::py::gil_release g;
             new (self) st::Reader(path, o);
           },
           nb::arg("path"), nb::arg("direct") = nb::none())
      .def_prop_ro("path", &st::Reader::path)
      .def_prop_ro("file_bytes", &st::Reader::file_bytes)
      .def_prop_ro("direct", &st::Reader::direct)
      .def_prop_ro("data_offset", [](const st::Reader& r) { return r.header().data_offset; })
      .def_prop_ro("metadata", [](const st::Reader& r) { return r.header().metadata; })
      // [(name, dtype, shape, file offset, bytes)] in the order of the header.
      .def_prop_ro("tensors",
                   [](const st::Reader& r) {
                     nb::list out;
                     const auto& h = r.header();
                     for (const auto& t : h.tensors)
                       out.append(nb::make_tuple(t.name, t.dtype, t.shape, h.data_offset + t.begin, t.end - t.begin));
                     return out;
                   })
      .def("read",
           [](st::Reader& r, const std::vector<ReadTuple>& targets) {
             std::vector<st::ReadTarget> t;
             for (const auto& [idx, ptr, nbytes, device, stream, own] : targets)
               t.push_back({idx, ebbtide::py::pointer_buffer(ptr, nbytes, device, stream), own});
             ebbtide::py::gil_release g;
             return r.read(t);
           },
           nb::arg("targets"));

  m.def("safetensors_save",
        [](const std::string& path, const std::vector<SaveTuple>& tensors, const st::Metadata& metadata,
           std::optional<bool> direct) {
          std::vector<st::SaveTensor> ts;
          for (const auto& [name, dtype, shape, ptr, nbytes, device, stream] : tensors)
            ts.push_back({name, dtype, shape, ebbtide::py::pointer_buffer(ptr, nbytes, device, stream)});
          st::IoOptions o = io_options(direct);
          st::SaveResult r;
          {
            ebbtide::py::gil_release g;
            r = st::save(path, ts, metadata, o);
          }
          nb::dict d;
          d["file_bytes"] = r.file_bytes;
          d["data_bytes"] = r.data_bytes;
          d["backend"] = r.backend;
          return d;
        },
        nb::arg("path"), nb::arg("tensors"), nb::arg("metadata"), nb::arg("direct") = nb::none());
  leak_in_forked_children<st::Reader>(m.attr("SafetensorsReader"));  // Note [Objects across fork]
}
