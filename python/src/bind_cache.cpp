// Bindings of the tensor cache core (cpp/include/ebbtide/cache). The torch glue
// lives in python/ebbtide/cache/tensor_cache.py; this only converts arguments and releases
// the GIL where the core may block (release, wait, drain, close).
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string_view>
#include <type_traits>
#include <variant>

#include "fork_safe.hpp"
#include "bind.hpp"
#include "glue_api.hpp"
#include "ebbtide/cache/store.hpp"
#include "ebbtide/cache/store_pool.hpp"
#include "ebbtide/cache/tensor_cache.hpp"
#include "ebbtide/io/engine.hpp"
#include "ebbtide/util/error.hpp"

namespace nb = nanobind;

// No file-scope using-directive (Note [Unity build] in CMakeLists.txt).
namespace ebbtide::cache {
namespace {

nb::dict record_dict(const StatRecord& r);

nb::object stat_value(const StatField& f) {
  return std::visit(
      [](const auto& v) -> nb::object {
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<V, std::string_view>) {
          return nb::str(v.data(), v.size());
        } else if constexpr (std::is_same_v<V, StatRecord>) {
          return record_dict(v);
        } else if constexpr (std::is_same_v<V, std::vector<StatRecord>>) {
          nb::list out;
          for (const auto& r : v) out.append(record_dict(r));
          return out;
        } else {
          return nb::cast(v);
        }
      },
      f.value);
}

nb::dict record_dict(const StatRecord& r) {
  nb::dict d;
  for (const auto& f : r) d[nb::str(f.name.data(), f.name.size())] = stat_value(f);
  return d;
}

ebbtide::mem::cuda::Driver* cuda_driver(bool want) {
  return want ? ebbtide::mem::cuda::driver() : nullptr;
}

// Note [Glue objects] (tensor_cache_save.cpp): a Python object the core keeps for
// an entry. Its deleter takes the interpreter's lock (the core never destroys
// one under its own lock or on a worker) and leaks the object once the
// interpreter is gone.
GlueObj glue_obj(nb::handle h) {
  if (!h.is_valid() || h.is_none()) return {};
  return GlueObj(h.inc_ref().ptr(), [](void* p) noexcept {
    if (nb::detail::cleanup_guard guard{}) Py_DECREF(static_cast<PyObject*>(p));
  });
}

nb::object py_obj(const GlueObj& g) {
  return g ? nb::borrow(static_cast<PyObject*>(g.get())) : nb::none();
}

// A host pool buffer the core allocated (Entry::buf) as a torch uint8 tensor
// of `nbytes` at `data`; the tensor keeps the buffer alive.
nb::object host_tensor(const GlueObj& buf, void* data, uint64_t nbytes) {
  auto owner = ebbtide::py::owning_capsule(GlueObj(buf)).first;
  return ebbtide::py::tensor_1d(static_cast<uint8_t*>(data), nbytes, owner);
}

// None when empty (the common case costs no list), else [(id, ok, live, version)].
nb::object completions_py(std::vector<Completion>& done) {
  if (done.empty()) return nb::none();
  nb::list out;
  for (auto& c : done) out.append(nb::make_tuple(c.id, c.ok, py_obj(c.live), c.version));
  return out;
}

nb::object candidates_py(const std::vector<Candidate>& cands) {
  if (cands.empty()) return nb::none();
  nb::list out;
  for (const auto& c : cands) out.append(nb::make_tuple(c.id, c.nbytes, py_obj(c.orig)));
  return out;
}

// The table of Note [Two modules] (glue_api.hpp).
template <class F>
bool guarded(F&& f) noexcept {
  try {
    f();
    return true;
  } catch (...) {
    ebbtide::py::translate_error(std::current_exception(), true);
    return false;
  }
}

ebbtide::py::GlueApi make_glue_api() {
  ebbtide::py::GlueApi a;
  a.core_of = [](PyObject* obj) noexcept -> TensorCache* {
    TensorCache* c = nullptr;
    if (!nb::try_cast<TensorCache*>(nb::handle(obj), c) || c == nullptr) {
      PyErr_SetString(PyExc_TypeError, "ebbtide._torch: expected an ebbtide._core.CacheCore");
      return nullptr;
    }
    return c;
  };
  a.glue_obj = [](PyObject* obj) noexcept { return glue_obj(nb::handle(obj)); };
  a.kept_resident = [](TensorCache* c, int64_t delta) noexcept {
    nb::gil_scoped_release unlocked;  // a rise takes the core's lock
    c->add_kept_resident(delta);
  };
  a.save = [](TensorCache* c, SaveRequest& r, SaveResult* out) noexcept {
    bool ok = guarded([&] {
      nb::gil_scoped_release unlocked;
      *out = c->save(r);
    });
    r = SaveRequest{};  // its glue objects, dropped with the interpreter's lock held
    return ok;
  };
  a.unpack = [](TensorCache* c, EntryId id, uintptr_t stream, int64_t task, bool have_original, void* into,
                Unpacked* out) noexcept {
    return guarded([&] {
      nb::gil_scoped_release unlocked;
      *out = c->unpack(id, stream, task, have_original, into);
    });
  };
  a.release_handle = [](TensorCache* c, HandleId h, EntryId id) noexcept {
    int gone = -1;
    guarded([&] {
      nb::gil_scoped_release unlocked;
      gone = c->release_handle(h, id) ? 1 : 0;
    });
    return gone;
  };
  a.start_loads = [](TensorCache* c, const std::vector<EntryId>& ids,
                     const std::vector<std::pair<uintptr_t, PyObject*>>& buffers, uintptr_t stream) noexcept {
    std::vector<std::pair<uintptr_t, GlueObj>> bufs;
    for (const auto& [ptr, owner] : buffers) bufs.emplace_back(ptr, glue_obj(nb::handle(owner)));
    bool ok = guarded([&] {
      nb::gil_scoped_release unlocked;
      c->start_loads(ids, bufs, stream);
    });
    bufs.clear();  // the owners the core did not keep, dropped with the lock held
    return ok;
  };
  a.start_load = [](TensorCache* c, EntryId id, void* dst, uintptr_t stream, PyObject* owner) noexcept {
    return guarded([&] { c->start_load(id, dst, stream, glue_obj(nb::handle(owner))); });
  };
  a.reuse = [](TensorCache* c, EntryId id) noexcept { return guarded([&] { c->reuse(id); }); };
  a.prefetch_scope = [](TensorCache* c, int mb, int64_t scope, int64_t task, std::vector<Candidate>* out) noexcept {
    return guarded([&] { *out = c->prefetch_scope(mb, scope, task); });
  };
  a.hold_live = [](TensorCache* c, EntryId id, PyObject* live) noexcept {
    return guarded([&] { c->hold_live(id, glue_obj(nb::handle(live))); });
  };
  a.state_error = ebbtide::py::state_error_type();
  a.fork_generation = &ebbtide::mem::fork_generation;
  return a;
}

}  // namespace
}  // namespace ebbtide::cache

void ebbtide::py::bind_cache(nb::module_& m) {
  using namespace ebbtide::cache;
  nb::dict(m.attr("build_info"))["cache_ssd"] = true;
  static const ebbtide::py::GlueApi api = make_glue_api();
  m.attr("_glue_api") = nb::capsule(&api, "ebbtide._core._glue_api");
  // Test hooks for target "ssd" (Note [Fault injection] in io/engine.cpp).
  m.def("cache_inject_write_fault", &ebbtide::io::inject_write_fault, nb::arg("dir"), nb::arg("after_bytes"),
        nb::arg("err"), nb::arg("count") = 1);
  m.def("cache_clear_faults", &ebbtide::io::clear_faults);
  m.def("cuda_driver_available", [] { return cuda_driver(true) != nullptr; });
  m.def("release_pooled_stores", &release_pooled_stores, nb::call_guard<nb::gil_scoped_release>(),
        "Drops the idle stores kept for ebbtide.offload() (Note [Store pool]); returns how many.");
  m.attr("RELOAD_RESIDENT") = static_cast<int>(Reload::kResident);
  m.attr("RELOAD_FORWARD") = static_cast<int>(Reload::kForward);
  m.attr("RELOAD_NEED_BUFFER") = static_cast<int>(Reload::kNeedBuffer);
  m.attr("TIER_CPU") = kTierCpu;
  m.attr("TIER_SSD") = kTierSsd;
  m.attr("RELOAD_PENDING") = static_cast<int>(Reload::kPending);
  m.attr("UNPACK_LIVE") = static_cast<int>(Unpacked::Kind::kLive);
  m.attr("UNPACK_BUFFER") = static_cast<int>(Unpacked::Kind::kBuffer);
  m.attr("UNPACK_NEED_BUFFER") = static_cast<int>(Unpacked::Kind::kNeedBuffer);

  nb::class_<TensorCache>(m, "CacheCore", "The C++ tensor cache (bookkeeping, store/load workers).")
      .def("__init__",
           [](TensorCache* self, const std::string& target, const std::vector<std::string>& paths,
              uint64_t capacity_bytes, uint64_t prefetch_window_bytes, unsigned workers, bool cuda,
              uint64_t max_inflight_bytes, uint64_t host_budget_bytes, double max_write_bps, bool pooled,
              std::optional<uint64_t> device_inflight_bytes, std::optional<uint64_t> staging_bytes) {
             auto* drv = cuda_driver(cuda);
             const StoreSpec spec{target, paths, capacity_bytes, host_budget_bytes, max_write_bps, drv};
             CacheOptions co;
             // Note [Store pool] (cache/store_pool.cpp).
             auto store = pooled ? take_pooled_store(spec, &co.return_store) : make_store(spec);
             co.prefetch_window_bytes = prefetch_window_bytes;
             co.workers = workers;
             co.max_inflight_bytes = max_inflight_bytes;
             co.driver = drv;
             if (device_inflight_bytes) co.device_inflight_bytes = *device_inflight_bytes;
             if (staging_bytes) co.staging_bytes = *staging_bytes;
             new (self) TensorCache(std::move(store), co);
           },
           nb::arg("target"), nb::arg("paths"), nb::arg("capacity_bytes") = 0,
           nb::arg("prefetch_window_bytes") = 512ull << 20, nb::arg("workers") = 2, nb::arg("cuda") = false,
           nb::arg("max_inflight_bytes") = 0, nb::arg("host_budget_bytes") = 0, nb::arg("max_write_bps") = 0.0,
           nb::arg("pooled") = false, nb::arg("device_inflight_bytes") = nb::none(),
           nb::arg("staging_bytes") = nb::none())
      .def("save",
           [](TensorCache& c, uint64_t key, uint64_t version, uintptr_t ptr, uint64_t nbytes, int device,
              uintptr_t stream, int microbatch, bool offload, int tier, nb::handle live, nb::handle orig,
              uint64_t lead_bytes) {
             SaveRequest r;
             r.lead_bytes = lead_bytes;
             r.live = glue_obj(live);
             r.orig = glue_obj(orig);
             r.key = key;
             r.version = version;
             r.src = {reinterpret_cast<void*>(ptr), nbytes, device, stream};
             r.microbatch = microbatch;
             r.offload = offload;
             r.tier = tier;
             SaveResult res;
             {
               nb::gil_scoped_release unlocked;
               res = c.save(r);
               r = SaveRequest{};  // its glue objects: dropped here, or after the lock comes back
             }
             return nb::make_tuple(res.id, res.is_new, res.offloaded, res.handle, completions_py(res.done));
           },
           nb::arg("key"), nb::arg("version"), nb::arg("ptr"), nb::arg("nbytes"), nb::arg("device"),
           nb::arg("stream"), nb::arg("microbatch"), nb::arg("offload"), nb::arg("tier") = -1,
           nb::arg("live").none() = nb::none(), nb::arg("orig").none() = nb::none(), nb::arg("lead_bytes") = 0,
           "Saves a storage (Note [Glue objects]: `live` is the tensor, held while the entry needs it; "
           "`orig` comes back with prefetch candidates; `lead_bytes`: how close backward must come before "
           "its reload may start, 0 the prefetch window). Returns (id, is_new, offloaded, handle, completions).")
      .def("unpack",
           [](TensorCache& c, EntryId id, uintptr_t stream, int64_t task, bool have_original, uintptr_t into) {
             Unpacked u;
             {
               nb::gil_scoped_release unlocked;
               u = c.unpack(id, stream, task, have_original, reinterpret_cast<void*>(into));
             }
             nb::object obj = u.kind == Unpacked::Kind::kBuffer && u.host_buffer ? host_tensor(u.obj, u.data, u.nbytes)
                                                                                : py_obj(u.obj);
             return nb::make_tuple(static_cast<int>(u.kind), obj, u.nbytes, u.buffer_stream,
                                   candidates_py(u.prefetch), completions_py(u.done));
           },
           nb::arg("id"), nb::arg("stream"), nb::arg("task") = -1, nb::arg("have_original") = false,
           nb::arg("into") = 0,
           "Note [One call per unpack]: (kind, obj, nbytes, buffer_stream, prefetch candidates, completions).")
      .def("start_loads",
           [](TensorCache& c, const std::vector<EntryId>& ids, nb::handle buffers, uintptr_t stream) {
             std::vector<std::pair<uintptr_t, GlueObj>> bufs;
             if (!buffers.is_none()) {
               for (nb::handle b : buffers) {
                 nb::tuple t = nb::borrow<nb::tuple>(b);
                 bufs.emplace_back(nb::cast<uintptr_t>(t[0]), glue_obj(t[1]));
               }
             }
             nb::gil_scoped_release unlocked;
             c.start_loads(ids, bufs, stream);
             bufs.clear();
           },
           nb::arg("ids"), nb::arg("buffers").none() = nb::none(), nb::arg("stream") = 0,
           "Starts loads of prefetch candidates: host entries into pool buffers, device entries into "
           "`buffers` [(ptr, owner)], allocated on `stream`.")
      .def("hold_live", [](TensorCache& c, EntryId id, nb::handle live) { c.hold_live(id, glue_obj(live)); },
           nb::arg("id"), nb::arg("live"))
      .def("held_lives",
           [](const TensorCache& c, uint64_t step) {
             auto held = c.held_lives(step);
             nb::list out;
             for (auto& [id, live] : held) out.append(nb::make_tuple(id, py_obj(live)));
             return out;
           },
           nb::arg("step"))
      .def("entry_count", &TensorCache::entry_count)
      .def("release", &TensorCache::release, nb::arg("id"), nb::call_guard<nb::gil_scoped_release>())
      .def("release_handle", &TensorCache::release_handle, nb::arg("handle"), nb::arg("id"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("poll",
           [](TensorCache& c) {
             auto done = c.poll();
             nb::list out;
             for (auto& x : done) out.append(nb::make_tuple(x.id, x.ok, py_obj(x.live), x.version));
             return out;
           })
      .def("request", [](TensorCache& c, EntryId id) { return static_cast<int>(c.request(id)); }, nb::arg("id"))
      .def("start_load",
           [](TensorCache& c, EntryId id, uintptr_t dst, uintptr_t stream, nb::handle owner) {
             if (owner.is_none()) c.start_load(id, reinterpret_cast<void*>(dst), stream);
             else c.start_load(id, reinterpret_cast<void*>(dst), stream, glue_obj(owner));
           },
           nb::arg("id"), nb::arg("dst"), nb::arg("stream"), nb::arg("owner").none() = nb::none())
      .def("wait", &TensorCache::wait, nb::arg("id"), nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>())
      .def("consume", &TensorCache::consume, nb::arg("id"), nb::arg("task") = -1)
      .def("reuse", &TensorCache::reuse, nb::arg("id"))
      .def("scope_end", &TensorCache::scope_end, nb::arg("microbatch"), nb::arg("scope"))
      .def("note_kept", &TensorCache::note_kept, nb::arg("microbatch"), nb::arg("nbytes"))
      .def("prefetch_scope",
           [](TensorCache& c, int mb, int64_t scope, int64_t task) {
             return candidates_py(c.prefetch_scope(mb, scope, task));
           },
           nb::arg("microbatch"), nb::arg("scope"), nb::arg("task") = -1)
      .def("prefetch_before",
           [](TensorCache& c, EntryId id, int64_t task) { return candidates_py(c.prefetch_before(id, task)); },
           nb::arg("id"), nb::arg("task") = -1)
      .def("release_copies",
           [](TensorCache& c, int mb, int64_t scope, uintptr_t stream, int64_t max_bytes, int device) {
             EBB_CHECK(max_bytes >= -1, "release_copies: max_bytes ", max_bytes, " (-1: no limit, else >= 0)");
             c.release_copies(mb, scope, stream, max_bytes < 0 ? UINT64_MAX : static_cast<uint64_t>(max_bytes),
                              device);
           },
           nb::arg("microbatch"), nb::arg("scope"), nb::arg("stream"), nb::arg("max_bytes") = -1,
           nb::arg("device") = -1,
           "Note [Release by bytes]: the copies of the micro-batch's entries up to the end of `scope` whose "
           "offloaded bytes, counted in forward order, end within `max_bytes` (-1: no limit). `stream` is a "
           "stream of CUDA device `device` (-1: the one device the cache works on; refused once it has worked on "
           "two, Note [Release points on several devices]).")
      .def("measure_link",
           [](TensorCache& c, int device, uintptr_t dev_ptr, uint64_t nbytes, int repeats) {
             return c.measure_link(device, reinterpret_cast<void*>(dev_ptr), nbytes, repeats);
           },
           nb::arg("device"), nb::arg("dev_ptr"), nb::arg("nbytes"), nb::arg("repeats") = 3,
           nb::call_guard<nb::gil_scoped_release>())
      .def("begin_step", &TensorCache::begin_step)
      .def("end_step", &TensorCache::end_step)
      .def("release_step", &TensorCache::release_step, nb::arg("step"), nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("current_step", &TensorCache::current_step)
      .def("drain", &TensorCache::drain, nb::call_guard<nb::gil_scoped_release>())
      .def("set_prefetch_window", &TensorCache::set_prefetch_window, nb::arg("bytes"))
      .def("set_max_inflight", &TensorCache::set_max_inflight, nb::arg("bytes"))
      .def_prop_ro("prefetch_window_bytes", [](const TensorCache& c) { return c.options().prefetch_window_bytes; })
      .def_prop_ro("device_inflight_bytes", [](const TensorCache& c) { return c.options().device_inflight_bytes; })
      .def("set_write_limit", &TensorCache::set_write_limit, nb::arg("tier"), nb::arg("bytes_per_second"))
      .def("probe", &TensorCache::probe, nb::arg("tier"), nb::arg("nbytes"), nb::call_guard<nb::gil_scoped_release>())
      .def("pause_stores", &TensorCache::pause_stores, nb::arg("paused"))
      .def("set_inline_copy_bytes", &TensorCache::set_inline_copy_bytes, nb::arg("bytes"))
      .def_prop_ro("inline_copy_bytes", [](const TensorCache& c) { return c.options().inline_copy_bytes; })
      .def("close", &TensorCache::close, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("closed", &TensorCache::closed)
      .def("state", [](const TensorCache& c, EntryId id) { return std::string(to_string(c.state(id))); },
           nb::arg("id"))
      .def("contains", &TensorCache::contains, nb::arg("id"))
      .def("describe", &TensorCache::describe)
      .def_prop_ro("io_alignment", &TensorCache::io_alignment)
      .def("stats", [](const TensorCache& c) { return record_dict(stat_record(c.stats())); });
  leak_in_forked_children<TensorCache>(m.attr("CacheCore"));  // Note [Objects across fork]
}
