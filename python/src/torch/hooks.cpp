// ebbtide._torch: the tensor cache's saved-tensor hooks, in C++ against libtorch.
//
// Note [Hooks in C++]
// Autograd calls the pack hook for every tensor a forward saves and the
// unpack hook for every use in backward, on the training thread; on a GPU that
// time delays kernel launches. Written in Python, eligibility, storage
// identity, the bookkeeping and the handle cost several times what identity
// hooks do (bench/pack_overhead.py). Here they are one C++ call each: the
// checks read the at::Tensor directly, host entries go to the core through
// the table of Note [Two modules] (glue_api.hpp), and reloads are allocated
// with ATen. The glue (python/ebbtide/cache/tensor_cache.py) keeps what is per block or
// per step (module hooks, plans, stats, CUDA streams) and tells the hooks what
// they need (device, scope, micro-batch, parameters, placement).
// Two cases take the glue's Python pack (`_pack`), which keeps its books
// here too (keep(), note_plan(), handle()), so there is one set of books
// whichever path a tensor took: the first tensor of a cache whose device is
// not known yet, and CUDA tensors without the driver shim (which the glue
// warns about). On a GPU the hooks read the compute stream from c10's
// virtual device guard and allocate reload buffers with ATen on it (Note
// [Reload buffers]).
// Everything here runs with the interpreter's lock held, which guards the
// state; the core's table releases it where the core may block.
#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "fork_safe.hpp"
#include "glue_api.hpp"
#include "tensor_util.hpp"

namespace nb = nanobind;
using namespace ebbtide::cache;
using namespace ebbtide::torch_glue;
using ebbtide::py::GlueApi;

namespace {

constexpr int kDeviceUnknown = -2;
constexpr int kDeviceCpu = -1;

const GlueApi* g_api = nullptr;

// Candidate::orig: a weak reference to the saved storage. Its unpack uses
// the original when the storage is still alive (Note [Originals still alive]).
struct StorageRef {
  c10::weak_intrusive_ptr<c10::StorageImpl> ref;
  bool expired() const { return ref.expired(); }
};

struct Hooks;

// Counts of resident saves the core never sees (Note [Kept tensors]).
struct KeptCounts {
  uint64_t saved = 0, fresh = 0, deduped = 0, bytes = 0, peak = 0;
  void fold(const KeptCounts& s) {
    saved += s.saved;
    fresh += s.fresh;
    deduped += s.deduped;
    bytes += s.bytes;
    peak = std::max(peak, s.peak);
  }
  nb::tuple py() const { return nb::make_tuple(saved, fresh, deduped, bytes, peak); }
};

// What autograd keeps for a saved tensor that stays resident: the tensor and
// its version at pack. Listed while its step runs (Note [Kept cycles]).
struct Kept {
  nb::object glue;         // the TensorCache
  nb::object hooks;        // its Hooks, kept alive
  Hooks* owner = nullptr;  // the same; null once counted out (aborted step)
  nb::object t;      // None once its step was aborted
  uint64_t version = 0;
  uint64_t key = 0;
  uint64_t nbytes = 0;
  Kept* prev = nullptr;
  Kept* next = nullptr;
  bool listed = false;
  Kept() = default;
  Kept(const Kept&) = delete;
  ~Kept();
};

// What autograd keeps for an entry of the core.
struct Handle {
  nb::object glue;         // the TensorCache: alive while autograd holds this
  nb::object hooks;        // its Hooks, kept alive
  Hooks* owner = nullptr;  // the same, used without a cast (destructors too)
  EntryId eid = 0;
  HandleId hid = 0;
  at::ScalarType dtype = at::kByte;
  c10::SmallVector<int64_t, 5> sizes, strides;
  int64_t offset = 0;
  uint64_t version = 0;
  // The saved tensor, while something outside autograd keeps it (Note
  // [Originals still alive]). A weak reference to the TensorImpl, not to
  // the Python object: it costs no object the garbage collector tracks.
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tref{c10::intrusive_ptr<c10::TensorImpl,
                                                                          c10::UndefinedTensorImpl>()};
  // The saved tensor if it is still alive with the storage it was saved from.
  std::optional<at::Tensor> original() const {
    auto p = tref.lock();
    if (!p || !p->has_storage() || reinterpret_cast<uint64_t>(p->storage().unsafeGetStorageImpl()) != key)
      return std::nullopt;
    return at::Tensor(std::move(p));
  }
  uint64_t key = 0;
  uint64_t nbytes = 0;
  bool whole = false;  // the tensor is its whole storage, contiguous
  Handle() = default;
  Handle(const Handle&) = delete;
  ~Handle();
};

struct PlanRow {
  bool offload = true;
  int tier = -1;
  uint64_t tensors = 0, bytes = 0, bytes_offloaded = 0;
};

struct Hooks {
  // Note [Objects across fork] (ebbtide/mem/fork_origin.hpp), through the
  // core (this module does not link it).
  uint64_t fork_generation = g_api->fork_generation();
  bool made_in_this_process() const noexcept { return fork_generation == g_api->fork_generation(); }
  nb::object glue_ref;  // weakref.ref to the TensorCache (it holds us)
  nb::object core_obj;
  TensorCache* core = nullptr;
  // Told by the glue.
  int device = kDeviceUnknown;  // -1 host, >= 0 CUDA ordinal
  bool cuda_ok = false;          // the core has the CUDA driver shim
  bool closed = false;
  bool close_pending = false;
  uint64_t min_bytes = 0;
  uint64_t inline_bytes = 0;
  int fwd_mb = 0;
  int64_t scope = -1;
  std::unordered_set<uint64_t> params;
  bool placement_valid = false;
  bool place_offload = true;
  int place_tier = -1;
  int64_t place_limit = -1;  // Note [Scope byte limits]; -1: none
  uint64_t place_lead = 0;   // SaveRequest::lead_bytes (0: the prefetch window)
  struct ScopeLimit {
    int mb = -1;
    uint64_t used = 0;     // offloaded in the scope by this micro-batch's forward
    bool reached = false;  // the rest of the scope stays resident
  };
  std::map<int64_t, ScopeLimit> limits;  // this step's, per scope
  bool warned_store = false;
  // Note [Kept tensors]
  struct KeyHash {
    size_t operator()(const std::pair<uint64_t, uint64_t>& k) const noexcept {
      return std::hash<uint64_t>()(k.first * 0x9E3779B97F4A7C15ull ^ k.second);
    }
  };
  // (storage key, version) -> live kept handles
  std::unordered_map<std::pair<uint64_t, uint64_t>, uint64_t, KeyHash> kept_refs;
  uint64_t kept_live = 0;
  uint64_t unflushed = 0;  // kept bytes not yet told to the core (note_kept)
  KeptCounts step, total;
  Kept* listed = nullptr;  // this step's kept handles
  std::map<int64_t, PlanRow> plan;
  // (storage key, version) -> live handles of core entries. While one lives,
  // its entry holds the storage (weakly, but the key stays unique: Note [Glue
  // objects]), so the pair names one storage; once the last goes the address
  // may come back for another storage, e.g. in the next micro-batch's forward
  // (a set kept for the whole step had counted such storages as offloaded).
  // A scope that keeps a storage offloaded and alive (the rotary tables every
  // block saves, kept in the last block) does not count it again in its plan
  // row, as a later scope that offloads it does not (the core dedups it);
  // else the profile counts it twice and the keep-all peak is that much above
  // the real one.
  std::unordered_map<std::pair<uint64_t, uint64_t>, uint64_t, KeyHash> handle_refs;

  nb::object glue() const {
    nb::object g = glue_ref();
    if (g.is_none()) raise_runtime("ebbtide.TensorCache: the cache object is gone");
    return g;
  }

  // ------------------------------------------------------------ bookkeeping
  void note_plan(uint64_t nbytes, bool offloaded, bool offload, int tier) {
    auto [it, fresh] = plan.try_emplace(scope);
    PlanRow& p = it->second;
    if (fresh) {
      p.offload = offload;
      p.tier = tier;
    }
    p.tensors += 1;
    p.bytes += nbytes;
    if (offloaded) p.bytes_offloaded += nbytes;
  }

  void placement() {
    if (placement_valid) return;
    nb::tuple pl = nb::cast<nb::tuple>(glue().attr("_scope_placement")());
    place_offload = nb::cast<std::string>(pl[0]) == "offload";
    place_tier = nb::cast<int>(pl[1]);
    place_limit = nb::len(pl) > 2 ? nb::cast<int64_t>(pl[2]) : -1;
    // The scope's reload lead in bytes (Note [Prefetch distance] in
    // tensor_cache_load.cpp); absent or 0: the prefetch window.
    const int64_t lead = nb::len(pl) > 3 ? nb::cast<int64_t>(pl[3]) : 0;
    place_lead = lead > 0 ? static_cast<uint64_t>(lead) : 0;
    placement_valid = true;
  }

  // Note [Scope byte limits]
  // A plan may offload only the first bytes of a scope's saves (Note
  // [Partial offload] in cpp/src/plan/planner.cpp): the glue's placement then
  // carries a byte limit, and a save is offloaded while the bytes the scope
  // offloaded in this micro-batch's forward stay within it. The first save
  // that would pass it, and every later one of the scope, stays resident, so
  // what moves is a prefix in save order, as the planner timed it. A storage
  // with a live core entry (handle_refs) goes to the core whatever the limit
  // (its entry is shared; kept here, its memory would stay held).
  ScopeLimit& scope_limit() {
    ScopeLimit& l = limits[scope];
    if (l.mb != fwd_mb) l = ScopeLimit{fwd_mb, 0, false};
    return l;
  }

  bool within_limit(uint64_t key, uint64_t version, uint64_t nbytes) {
    if (place_limit < 0 || handle_refs.count({key, version})) return true;
    ScopeLimit& l = scope_limit();
    if (!l.reached && l.used + nbytes <= static_cast<uint64_t>(place_limit)) return true;
    l.reached = true;
    return false;
  }

  void link(Kept* k) {
    k->next = listed;
    if (listed) listed->prev = k;
    listed = k;
    k->listed = true;
  }

  void unlink(Kept* k) {
    if (!k->listed) return;
    if (k->prev) k->prev->next = k->next;
    else listed = k->next;
    if (k->next) k->next->prev = k->prev;
    k->prev = k->next = nullptr;
    k->listed = false;
  }

  void kept_gone(uint64_t key, uint64_t version, uint64_t nbytes) {
    auto it = kept_refs.find({key, version});
    if (it == kept_refs.end()) return;
    if (--it->second == 0) {
      kept_refs.erase(it);
      kept_live -= nbytes;
      g_api->kept_resident(core, -static_cast<int64_t>(nbytes));  // Note [Joint resident peak]
    }
  }

  // A handle instance made in place (no copy, no Python call), tied to this
  // cache: it keeps the TensorCache and these hooks alive.
  template <class H>
  std::pair<nb::object, H*> new_handle(nb::handle self) {
    nb::object h = nb::inst_alloc(nb::type<H>());
    H* p = nb::inst_ptr<H>(h);
    new (p) H();
    nb::inst_mark_ready(h);
    p->glue = glue();
    p->hooks = nb::borrow(self);
    p->owner = this;
    return {std::move(h), p};
  }

  nb::object keep(nb::handle self, PyObject* obj, const at::Tensor& t, uint64_t key, uint64_t nbytes, bool offload,
                  int tier) {
    uint64_t version = t._version();
    step.saved += 1;
    uint64_t& n = kept_refs[{key, version}];
    if (n++ == 0) {
      step.fresh += 1;
      step.bytes += nbytes;
      kept_live += nbytes;
      step.peak = std::max(step.peak, kept_live);
      g_api->kept_resident(core, static_cast<int64_t>(nbytes));  // Note [Joint resident peak]
      if (!handle_refs.count({key, version})) note_plan(nbytes, false, offload, tier);
      // The prefetch distance counts kept bytes on every device (Note
      // [Prefetch distance]): without them a CPU step reloaded the blocks
      // below the kept tail while the tail was still resident.
      unflushed += nbytes;
    } else {
      step.deduped += 1;
    }
    auto [h, k] = new_handle<Kept>(self);
    k->t = nb::borrow(obj);
    k->version = version;
    k->key = key;
    k->nbytes = nbytes;
    link(k);
    return h;
  }

  nb::object make_handle(nb::handle self, PyObject* obj, const at::Tensor& t, EntryId eid, HandleId hid,
                         uint64_t version, uint64_t key, uint64_t nbytes) {
    auto [h, p] = new_handle<Handle>(self);
    p->eid = eid;
    p->hid = hid;
    p->dtype = t.scalar_type();
    p->sizes.assign(t.sizes().begin(), t.sizes().end());
    p->strides.assign(t.strides().begin(), t.strides().end());
    p->offset = t.storage_offset();
    p->version = version;
    p->tref = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr());
    p->key = key;
    p->nbytes = nbytes;
    ++handle_refs[{key, version}];
    p->whole = p->offset == 0 && t.is_contiguous() &&
               static_cast<uint64_t>(t.numel()) * t.element_size() == nbytes;
    return h;
  }

  // Completions that came back with a call: a tensor written in place while
  // its store ran goes back to the core (Note [Torn snapshots]); a failed
  // store is said once.
  void ack(std::vector<Completion>& done) {
    for (auto& c : done) {
      if (c.ok) {
        auto* live = static_cast<PyObject*>(c.live.get());
        if (live && THPVariable_Check(live) && THPVariable_Unpack(live)._version() != c.version) {
          if (!g_api->hold_live(core, c.id, live)) throw nb::python_error();
        }
      } else if (!warned_store) {
        warned_store = true;
        if (PyErr_WarnEx(PyExc_RuntimeWarning,
                         "ebbtide: storing an activation failed (disk full or I/O error); the rest of this "
                         "step's activations stay in memory",
                         1) < 0)
          throw nb::python_error();
      }
    }
    done.clear();
  }

  // Starts the loads of prefetch candidates, best effort: host entries into
  // the core's pool buffers, device entries into buffers from torch's
  // allocator on the compute stream `stream` (Note [Reload buffers]).
  void prefetch(std::vector<Candidate>& cands, uintptr_t stream) {
    std::vector<EntryId> ids;
    std::vector<nb::object> owners;
    std::vector<std::pair<uintptr_t, PyObject*>> bufs;
    for (auto& c : cands) {
      auto* orig = static_cast<PyObject*>(c.orig.get());
      StorageRef* r = nullptr;
      if (orig && nb::try_cast<StorageRef*>(nb::handle(orig), r) && r && !r->expired()) {
        // Its storage is still alive outside autograd: its unpack will use
        // the original (Note [Originals still alive]): counted once per step
        // by the core, which offers it again to later prefetches (the
        // original may die before its unpack: it is then loaded).
        if (!g_api->reuse(core, c.id)) throw nb::python_error();
        continue;
      }
      if (device >= 0) {
        at::Tensor b;
        try {
          b = at::empty({static_cast<int64_t>(c.nbytes)}, device_bytes());
        } catch (const c10::OutOfMemoryError&) {
          break;  // unpack loads on demand
        }
        owners.push_back(wrap(b));
        bufs.emplace_back(reinterpret_cast<uintptr_t>(b.data_ptr()), owners.back().ptr());
      }
      ids.push_back(c.id);
    }
    cands.clear();
    // e.g. host memory exhausted: unpack loads on demand
    if (!ids.empty() && !g_api->start_loads(core, ids, bufs, stream)) PyErr_Clear();
  }

  at::TensorOptions device_bytes() const {
    return at::TensorOptions().dtype(at::kByte).device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  }

  // --------------------------------------------------------------- the hooks
  bool base_is_param(const at::TensorBase& t) const {
    // Note [What is never offloaded]: a view of a parameter, recorded or not.
    at::TensorBase b = t._base();
    for (int i = 0; i < 8; ++i) {
      nb::object bo = wrap(b);
      if (Py_TYPE(bo.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
        int is = PyObject_IsInstance(bo.ptr(), ParameterClass);
        if (is != 0) {
          PyErr_Clear();
          return true;
        }
      }
      if (!b.has_storage() || params.count(storage_key(b))) return true;
      if (!b.is_view()) return false;
      b = b._base();
    }
    return true;
  }

  nb::object pack(nb::handle self, nb::handle th) {
    PyObject* obj = th.ptr();
    if (closed || Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
        torch::autograd::get_current_graph_task_id() != -1)
      return nb::borrow(th);
    // Note [Hooks in C++]: a cache whose device is not known yet, or whose
    // CUDA tensors stay resident (no driver shim: the glue warns), takes the
    // Python path.
    if (device == kDeviceUnknown || (device >= 0 && !cuda_ok)) return glue().attr("_pack")(th);
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (device == kDeviceCpu ? !t.is_cpu() : !t.is_cuda() || t.get_device() != device) return nb::borrow(th);
    if (t.layout() != at::kStrided || t.is_quantized() || t.is_nested() || t.is_conj() ||
        t.is_neg() || functorch_wrapped(t) || !t.has_storage())
      return nb::borrow(th);
    uint64_t key = storage_key(t);
    if (params.count(key) || (t.is_view() && base_is_param(t))) return nb::borrow(th);
    uint64_t nbytes = t.storage().nbytes();
    if (nbytes == 0) return nb::borrow(th);
    placement();
    const uint64_t version = t._version();
    // A storage a kept handle holds stays kept: copying it out would free
    // nothing (the kept handle holds it) and count it twice (Note [Scope byte
    // limits]: a partial scope keeps its tail, and a later scope may save the
    // same storage, as every block saves the rotary tables).
    if (nbytes < min_bytes || !place_offload || kept_refs.count({key, version}) ||
        !within_limit(key, version, nbytes))
      return keep(self, obj, t, key, nbytes, place_offload, place_tier);
    SaveRequest r;
    r.key = key;
    r.version = version;
    r.src.ptr = const_cast<void*>(t.storage().data());  // only read (mem/buffer.hpp)
    r.src.nbytes = nbytes;
    r.src.device = device;
    std::optional<c10::Stream> cur;
    if (device >= 0) {
      // The copy is ordered after the stream that produced the tensor: the current one.
      c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
      cur = guard.getStream(t.device());
      r.src.stream = reinterpret_cast<uintptr_t>(cur->native_handle());
    }
    r.microbatch = fwd_mb;
    r.offload = true;
    r.tier = place_tier;
    r.lead_bytes = place_lead;
    r.live = g_api->glue_obj(obj);
    nb::object sref = nb::cast(StorageRef{t.storage().getWeakStorageImpl()});
    r.orig = g_api->glue_obj(sref.ptr());
    SaveResult res;
    if (!g_api->save(core, r, &res)) {
      if (closed && PyErr_ExceptionMatches(g_api->state_error)) {  // closed meanwhile: autograd keeps it
        PyErr_Clear();
        return nb::borrow(th);
      }
      throw nb::python_error();
    }
    ack(res.done);
    // Note [Stream-ordered drops] (tensor_cache_device.cpp): the release makes this
    // stream wait for the copy; a tensor allocated on another stream (an
    // all-to-all's output) is then held by the allocator until this stream
    // passed that wait. A no-op for a tensor allocated on this stream.
    if (cur && res.offloaded) t.record_stream(*cur);
    if (res.is_new && res.offloaded && place_limit >= 0) scope_limit().used += nbytes;
    if (res.is_new) note_plan(nbytes, res.offloaded, true, place_tier);
    return make_handle(self, obj, t, res.id, res.handle, version, key, nbytes);
  }

  // A reload's tensor: the saved shape and strides over `storage`.
  static at::Tensor view(const Handle& h, const c10::Storage& storage, const at::TensorOptions& opts) {
    at::Tensor out = at::empty({0}, opts.dtype(h.dtype));
    out.set_(storage, h.offset, h.sizes, h.strides);
    return out;
  }

  // One unpack() of the core; then its completions and its prefetch
  // candidates (loads started on `compute`).
  void core_unpack(const Handle& h, uintptr_t stream, int64_t task, bool have_original, void* into, Unpacked* u,
                   uintptr_t compute) {
    if (g_api->unpack(core, h.eid, stream, task, have_original, into, u)) {
      if (!u->done.empty()) ack(u->done);
      if (!u->prefetch.empty()) prefetch(u->prefetch, compute);
      return;
    }
    if (PyErr_ExceptionMatches(g_api->state_error)) {
      PyErr_Clear();
      raise_runtime(closed ? "ebbtide.TensorCache: a saved tensor was unpacked after the cache was closed"
                           : "ebbtide.TensorCache: a saved tensor was unpacked after its step was aborted (the "
                             "step raised) or the cache released it");
    }
    throw nb::python_error();
  }

  // Note [One call per unpack] (tensor_cache_load.cpp), for host entries.
  nb::object reload(Handle& h) {
    if (closed) raise_runtime("ebbtide.TensorCache: a saved tensor was unpacked after the cache was closed");
    std::optional<at::Tensor> orig = h.original();
    if (orig && static_cast<uint64_t>(orig->_version()) != h.version)
      raise_version_error(*orig, h.version);  // Note [Originals still alive]: no reload, and a change is caught
    const int64_t task = torch::autograd::get_current_graph_task_id();
    const uintptr_t stream = device >= 0 ? compute_stream_handle() : 0;
    Unpacked u;
    if (device < 0 && !orig && h.nbytes <= inline_bytes) {
      // Note [Host copies on the caller]: straight into a tensor of the saved shape.
      at::Tensor out = h.whole ? at::empty(h.sizes, at::TensorOptions().dtype(h.dtype))
                               : at::empty({static_cast<int64_t>(h.nbytes)}, at::TensorOptions().dtype(at::kByte));
      core_unpack(h, 0, task, false, out.data_ptr(), &u, stream);
      if (u.kind == Unpacked::Kind::kBuffer && !u.obj)
        return h.whole ? wrap(out) : wrap(view(h, out.storage(), out.options()));
    } else {
      core_unpack(h, stream, task, orig.has_value(), nullptr, &u, stream);
    }
    if (u.kind == Unpacked::Kind::kNeedBuffer) {
      // Note [Reload buffers]: allocated on the current (compute) stream, so
      // the caching allocator never hands their memory to another stream
      // before the compute stream's later work; the copy waits on an event
      // recorded at start_load and the next unpack makes the compute stream
      // wait on its end.
      {
        nb::object owner = wrap(at::empty({static_cast<int64_t>(u.nbytes)}, device_bytes()));
        void* dst = THPVariable_Unpack(owner.ptr()).data_ptr();
        if (!g_api->start_load(core, h.eid, dst, stream, owner.ptr())) throw nb::python_error();
      }
      u = Unpacked{};
      core_unpack(h, stream, task, false, nullptr, &u, stream);
    }
    if (u.kind == Unpacked::Kind::kLive) {
      if (orig) return wrap(*orig);
      auto* live = static_cast<PyObject*>(u.obj.get());
      if (!live || !THPVariable_Check(live)) raise_runtime("ebbtide.TensorCache: the core answered without a tensor");
      const at::Tensor& t = THPVariable_Unpack(live);
      if (static_cast<uint64_t>(t._version()) != h.version) raise_version_error(t, h.version);
      return wrap(view(h, t.storage(), t.options()));
    }
    if (u.kind != Unpacked::Kind::kBuffer) raise_runtime("ebbtide.TensorCache: no reload buffer for an entry");
    if (!u.host_buffer) {
      // The glue's device buffer (start_load's owner).
      auto* b = static_cast<PyObject*>(u.obj.get());
      if (!b || !THPVariable_Check(b)) raise_runtime("ebbtide.TensorCache: the core answered without a buffer");
      const at::Tensor& buf = THPVariable_Unpack(b);
      if (buf.is_cuda() && u.buffer_stream != stream) buf.record_stream(compute_stream());
      return wrap(view(h, buf.storage(), buf.options()));
    }
    // A host pool buffer: it lives as long as the storage made over it.
    auto* owner = new GlueObj(std::move(u.obj));
    at::Tensor buf = at::from_blob(
        u.data, {static_cast<int64_t>(u.nbytes)}, [owner](void*) { delete owner; },
        at::TensorOptions().dtype(at::kByte));
    return wrap(view(h, buf.storage(), buf.options()));
  }

  // The current stream of the cache's CUDA device: what its kernels run on.
  c10::Stream compute_stream() const {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    return guard.getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  }
  uintptr_t compute_stream_handle() const { return reinterpret_cast<uintptr_t>(compute_stream().native_handle()); }

  // The candidates behind a block whose backward begins (the glue's block hooks).
  void prefetch_scope(int mb, int64_t scope, int64_t task) {
    std::vector<Candidate> cands;
    if (!g_api->prefetch_scope(core, mb, scope, task, &cands)) throw nb::python_error();
    if (!cands.empty()) prefetch(cands, device >= 0 ? compute_stream_handle() : 0);
  }

  nb::object unpack(nb::handle hobj) {
    PyTypeObject* tp = Py_TYPE(hobj.ptr());
    if (tp == reinterpret_cast<PyTypeObject*>(nb::type<Kept>().ptr())) {
      Kept* k = nb::inst_ptr<Kept>(hobj);
      if (k->t.is_none())
        raise_runtime("ebbtide.TensorCache: a saved tensor was unpacked after its step was aborted (the step "
                      "raised)");
      const at::Tensor& t = THPVariable_Unpack(k->t.ptr());
      if (static_cast<uint64_t>(t._version()) != k->version) raise_version_error(t, k->version);
      return k->t;
    }
    if (tp == reinterpret_cast<PyTypeObject*>(nb::type<Handle>().ptr())) {
      Handle* h = nb::inst_ptr<Handle>(hobj);
      return h->owner->reload(*h);
    }
    return nb::borrow(hobj);
  }

  // ------------------------------------------------------------------ steps
  void begin_step() {
    step = KeptCounts{};
    step.peak = kept_live;
    unflushed = 0;
    unlist_all();
    plan.clear();
    limits.clear();
    placement_valid = false;
  }

  void unlist_all() {
    while (listed) unlink(listed);
  }

  // Note [Kept cycles] (cache/hooks.py): the step's surviving kept handles hold
  // detached tensors from now on.
  // Dropping a tensor may free a graph and with it kept handles, this list's
  // included, so the old tensors go only once the walk is over.
  void detach_kept() {
    std::vector<nb::object> old;
    for (Kept* k = listed; k; k = k->next) {
      if (k->t.is_none()) continue;
      nb::object d = wrap(THPVariable_Unpack(k->t.ptr()).detach());
      old.push_back(std::exchange(k->t, std::move(d)));
    }
    unlist_all();
  }

  // A failed step: its kept handles let go of their tensors (unpacking one raises).
  void abort_kept() {
    std::vector<nb::object> old;
    while (Kept* k = listed) {
      unlink(k);
      kept_gone(k->key, k->version, k->nbytes);
      k->owner = nullptr;
      old.push_back(std::exchange(k->hooks, nb::none()));
      old.push_back(std::exchange(k->t, nb::none()));
    }
  }
};

Kept::~Kept() {
  if (!owner || !owner->made_in_this_process()) return;  // Note [Objects across fork]
  owner->unlink(this);
  owner->kept_gone(key, version, nbytes);
}

Handle::~Handle() {
  if (!owner || !owner->made_in_this_process()) return;  // Note [Objects across fork]
  if (auto it = owner->handle_refs.find({key, version}); it != owner->handle_refs.end() && --it->second == 0)
    owner->handle_refs.erase(it);
  if (owner->closed) return;
  Hooks& s = *owner;
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);  // a handle may die while an exception is being raised
  int gone = g_api->release_handle(s.core, hid, eid);
  if (gone < 0) PyErr_Clear();
  if (gone == 1 && s.close_pending) {
    // Note [Lifetime after the block] (cache/tensor_cache.py).
    PyObject* r = PyObject_CallMethod(glue.ptr(), "_entry_gone", nullptr);
    if (r) Py_DECREF(r);
    else PyErr_Clear();
  }
  PyErr_Restore(type, value, tb);
}

}  // namespace

NB_MODULE(_torch, m) {
  nb::module_ core_mod = nb::module_::import_("ebbtide._core");
  nb::capsule cap = nb::cast<nb::capsule>(core_mod.attr("_glue_api"));
  g_api = static_cast<const GlueApi*>(PyCapsule_GetPointer(cap.ptr(), "ebbtide._core._glue_api"));
  if (!g_api) throw nb::python_error();
  if (g_api->version != GlueApi::kVersion || g_api->size != sizeof(GlueApi))
    throw std::runtime_error("ebbtide._torch was built for another ebbtide._core (rebuild both)");
  // Note [Hooks for one torch]: libtorch's C++ API is not stable across
  // releases, so the module refuses to load under a torch other than the one
  // it was built against, naming both and the rebuild. Only the public
  // version counts: the builds of one release for the CPU and for each CUDA
  // version ("2.13.0+cpu", "2.13.0+cu130") share libtorch's C++ interface,
  // and the wheel requires torch by that public version (docs/packaging.md).
  const std::string running = nb::cast<std::string>(nb::module_::import_("torch").attr("__version__"));
  const auto public_version = [](const std::string& v) { return v.substr(0, v.find('+')); };
  if (public_version(running) != public_version(EBBTIDE_TORCH_VERSION))
    throw nb::import_error(("ebbtide._torch was built against torch " EBBTIDE_TORCH_VERSION ", but torch " + running +
                            " is installed; rebuild ebbtide for it: pip install --no-build-isolation "
                            "--force-reinstall --no-deps <ebbtide's source directory>")
                               .c_str());
  m.attr("TORCH_VERSION") = EBBTIDE_TORCH_VERSION;

  nb::class_<StorageRef>(m, "StorageRef", "A weak reference to a saved tensor's storage.")
      .def("expired", &StorageRef::expired);

  nb::class_<Kept>(m, "KeptHandle", "A saved tensor kept resident (Note [Kept tensors]).")
      .def_prop_ro("t", [](const Kept& k) { return k.t; })
      .def_ro("version", &Kept::version)
      .def_ro("nbytes", &Kept::nbytes);

  nb::class_<Handle>(m, "Handle", "What autograd keeps for an entry of the tensor cache.")
      .def_prop_ro("cache", [](const Handle& h) { return h.glue; })
      .def_ro("eid", &Handle::eid)
      .def_ro("hid", &Handle::hid)
      .def_prop_ro("dtype", [](const Handle& h) {
        return nb::borrow(reinterpret_cast<PyObject*>(torch::getTHPDtype(h.dtype)));
      })
      .def_prop_ro("shape", [](const Handle& h) { return int_tuple(h.sizes); })
      .def_prop_ro("stride", [](const Handle& h) { return int_tuple(h.strides); })
      .def_ro("offset", &Handle::offset)
      .def_ro("version", &Handle::version)
      .def("original", [](const Handle& h) -> nb::object {
        auto t = h.original();
        return t ? wrap(*t) : nb::none();
      }, "The saved tensor while it is alive outside autograd with its storage, else None.")
      .def_ro("key", &Handle::key)
      .def_ro("nbytes", &Handle::nbytes)
      .def_ro("whole", &Handle::whole);

  nb::class_<Hooks>(m, "Hooks", "The tensor cache's saved-tensor hooks (Note [Hooks in C++]).")
      .def("__init__",
           [](Hooks* self, nb::handle glue, nb::handle core, uint64_t inline_bytes) {
             new (self) Hooks();
             self->glue_ref = nb::module_::import_("weakref").attr("ref")(glue);
             self->core = g_api->core_of(core.ptr());
             if (!self->core) throw nb::python_error();
             self->core_obj = nb::borrow(core);
             self->inline_bytes = inline_bytes;
           },
           nb::arg("glue"), nb::arg("core"), nb::arg("inline_bytes"))
      .def("pack", [](nb::handle self, nb::handle t) { return nb::cast<Hooks&>(self).pack(self, t); })
      .def("unpack", [](Hooks& s, nb::handle h) { return s.unpack(h); })
      .def_rw("closed", &Hooks::closed)
      .def_rw("close_pending", &Hooks::close_pending)
      .def_rw("min_bytes", &Hooks::min_bytes)
      .def_rw("fwd_mb", &Hooks::fwd_mb)
      .def_rw("scope", &Hooks::scope)
      .def_rw("device", &Hooks::device)
      .def_rw("cuda_ok", &Hooks::cuda_ok)
      .def_rw("warned_store", &Hooks::warned_store)
      .def_ro("kept_live", &Hooks::kept_live)
      .def_prop_ro("kept_storages",
                   [](const Hooks& s) { return s.kept_refs.size(); },
                   "Storage versions kept tensors hold now.")
      .def("set_params", [](Hooks& s, const std::vector<uint64_t>& keys) {
        s.params = std::unordered_set<uint64_t>(keys.begin(), keys.end());
      })
      .def("invalidate_placement", [](Hooks& s) { s.placement_valid = false; })
      .def("keep",
           [](nb::handle self, nb::handle t, uint64_t nbytes, bool offload, int tier) {
             const at::Tensor& x = tensor_arg(t);
             return nb::cast<Hooks&>(self).keep(self, t.ptr(), x, storage_key(x), nbytes, offload, tier);
           },
           nb::arg("t"), nb::arg("nbytes"), nb::arg("offload"), nb::arg("tier"),
           "Note [Kept tensors]: the handle of a save that stays resident (the glue's Python path).")
      .def("handle",
           [](nb::handle self, nb::handle t, EntryId eid, HandleId hid, uint64_t version, uint64_t key,
              uint64_t nbytes) {
             return nb::cast<Hooks&>(self).make_handle(self, t.ptr(), tensor_arg(t), eid, hid, version, key, nbytes);
           },
           nb::arg("t"), nb::arg("eid"), nb::arg("hid"), nb::arg("version"), nb::arg("key"), nb::arg("nbytes"))
      .def("storage_ref",
           [](Hooks&, nb::handle t) { return StorageRef{tensor_arg(t).storage().getWeakStorageImpl()}; }, nb::arg("t"))
      .def("note_plan", &Hooks::note_plan, nb::arg("nbytes"), nb::arg("offloaded"), nb::arg("offload"),
           nb::arg("tier"))
      .def("ack",
           [](Hooks& s, nb::handle done) {
             std::vector<Completion> v;
             for (nb::handle d : done) {
               nb::tuple c = nb::borrow<nb::tuple>(d);
               Completion x;
               x.id = nb::cast<EntryId>(c[0]);
               x.ok = nb::cast<bool>(c[1]);
               if (!c[2].is_none()) x.live = g_api->glue_obj(c[2].ptr());
               x.version = nb::cast<uint64_t>(c[3]);
               v.push_back(std::move(x));
             }
             s.ack(v);
           },
           nb::arg("done"), "Completions from the core's poll(): (id, ok, live tensor, saved version).")
      .def("prefetch_scope", &Hooks::prefetch_scope, nb::arg("microbatch"), nb::arg("scope"), nb::arg("task"),
           "Starts the loads behind a block whose backward begins (Note [Prefetch window]).")
      .def("take_unflushed", [](Hooks& s) { return std::exchange(s.unflushed, 0); })
      .def("begin_step", &Hooks::begin_step)
      .def("detach_kept", &Hooks::detach_kept)
      .def("abort_kept", &Hooks::abort_kept)
      .def("fold_step", [](Hooks& s) { s.total.fold(s.step); })
      .def("kept_counts", [](const Hooks& s, bool total) { return (total ? s.total : s.step).py(); },
           nb::arg("total"), "(saved, kept, deduped, bytes, peak) of the step or of all steps.")
      .def("plan_rows",
           [](const Hooks& s) {
             nb::list out;
             for (const auto& [scope, p] : s.plan)
               out.append(nb::make_tuple(scope, p.offload, p.tier, p.tensors, p.bytes, p.bytes_offloaded));
             return out;
           },
           "(scope, offload, tier, tensors, bytes, bytes_offloaded) per scope of the step, in scope order.");
  ebbtide::py::leak_in_forked_children<Hooks>(m.attr("Hooks"));  // Note [Objects across fork]
}
