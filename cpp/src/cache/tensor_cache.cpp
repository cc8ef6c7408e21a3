#include "ebbtide/cache/tensor_cache.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "ebbtide/mem/buffer_pool.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::cache {

// Note [Entry states]
// An entry is one saved storage (views of one storage share it: dedup by key).
//
//   save(offload=false) -> kKept -------------------------------------+
//   save(offload=true)  -> kQueued -> kStoring -> kStored <-> kLoading -> kLoaded
//                            |           |   \-> kFailed (resident)     (consume: -> kStored)
//                            +-----------+--> kForwarded (request() before the store finished,
//                                                          or backward began: Note [Late stores])
//
// Every state ends with release() of the last handle (or release_step()).
// Resident bytes (held in the training device's memory on the cache's behalf)
// are the entries in kKept, kQueued, kStoring, kForwarded, kFailed, kLoading,
// kLoaded, and kStored until the glue has polled the completion (it drops its
// reference then). `busy` marks a copy running on a worker without the lock:
// release waits for it so the glue never frees memory a worker still reads.
//
// Device entries on the stream-ordered path (Note [Stream-ordered offload])
// skip kQueued and kStoring: save() enqueues their copy and they are kStored
// at once, never resident from the cache's view; a device entry that cannot
// take that path (its host blob could not be page-locked) goes through the
// workers like a host entry.
//
// Note [Stream-ordered offload]
// On a GPU the CPU runs far ahead of the kernels, so nothing about a device
// entry is decided on the CPU's view of time. save() runs on the training
// thread and, without any host synchronisation:
//   1. records an event on the compute stream after the producing kernels;
//   2. makes the device's copy stream wait for it and enqueues the
//      device-to-host copy into a page-locked host blob (the host tier's, or
//      a bounce blob on its way to the SSD), then records `copy_ev`.
// The entry is kStored at once but the glue still holds the tensor (unacked)
// until a release point (Note [Release points]) makes the compute stream
// wait for the copy and reports the entry through poll(): the glue's drop is
// then an ordinary free on the compute stream, which torch's caching
// allocator hands to the next allocation of that stream at once. (With
// record_stream instead, the allocator would reuse the block only once a
// host-side event query saw the copy done: never while the CPU runs ahead,
// so the peak would not move.) Copies run in production order on one stream
// per device, so each copy event also covers every earlier copy. An unpack
// before the release is answered from the live tensor. A reload makes the
// device's load stream wait for the reload buffer's allocation and for
// `copy_ev` (a reload can never read a blob its store is still writing),
// copies host to device and records `load_done_ev`, which the compute stream
// waits on at unpack. A freed blob may still be read or written by a copy in
// flight: it returns to its store only once the last copy touching it
// completed (FencedFree, swept without blocking at saves and steps, waited
// for at close).
//
// Note [Release points]
// Where the compute stream waits for a copy decides both the step time (a
// wait for a copy that has not run stalls compute) and the peak (memory comes
// back only after the wait). The glue places them from the plan: after each
// block's forward, release the blocks whose copies the planner predicts done
// by then (write_done <= that block's forward end); without a plan, the
// blocks before the previous one. When backward of a micro-batch begins, all
// its copies are released. Two more rules, in save(): a copy a host-side
// query already saw complete is released without a wait (it can only be
// earlier than needed), and Note [Copy bound].
//
// Note [Copy bound]
// When the link is slower than the forward produces activations, copies fall
// behind and the tensors they read are held: the peak would grow with the
// backlog. So after each enqueue, when more than device_inflight_bytes of
// copies are still held ahead of the compute stream, the compute stream waits
// (on the device) for the oldest copy whose completion brings the backlog
// under the bound, and releases up to it. The activation peak is then bounded
// by construction: the activations kept plus device_inflight_bytes. The
// planner chooses what to offload so that this wait rarely happens.
//
// Note [SSD below the link]
// A device entry bound for the SSD goes device -> page-locked bounce blob on
// the copy stream (as above, so the device memory is given up as soon as the
// copy ran), then a worker waits for that copy on its own thread and writes
// the blob to the SSD, and frees it. At most staging_bytes of bounce blobs are
// held; past that a device entry stays resident rather than making the
// training thread wait. A reload reads the SSD into a bounce blob on a worker,
// which then enqueues the host-to-device copy on the load stream; an entry
// still in its bounce blob reloads from it directly.
//
// Note [Store workers]
// `workers` threads share two FIFO queues and always take a load before a
// store: a load blocks backward, a store only delays a memory release. Store
// calls are synchronous on the worker; the queues give the asynchrony and
// make cancel cheap (a queued id whose entry left kQueued is skipped). Device
// entries: save() records an event on the compute stream; the worker makes its
// own side stream wait on it before the copy, and for loads records a done
// event that wait() makes the consumer stream wait on: no host sync in hooks.
//
// Note [Glue objects]
// The core owns each entry's whole life, the glue's objects included: the
// saved tensor while the entry must keep it resident (`live`: kept,
// forwarded or failed entries, stores not yet done, device copies not yet
// released), a weak reference handed back with prefetch candidates
// (`orig`), and a reload buffer (`buf`: the glue's, or a host pool buffer the
// core allocated). They are opaque shared pointers whose deleters may need
// the interpreter's lock, so none is destroyed under mu_ (a thread holding
// the interpreter lock may be waiting for mu_) nor on a worker: dropping one
// moves it to graveyard_, and every public call that can drop one swaps the
// graveyard out under the lock and destroys it after unlocking (Reaper). A
// completion hands the dropped `live` to the glue instead (Note [Torn
// snapshots]).
//
// Note [Torn snapshots]
// A store copies the tensor while the training thread goes on (a worker, or
// the device's copy stream after the producing kernels). An in-place write
// after the save can race with that copy; autograd would report the write at
// backward as a version mismatch. So a completion returns the live tensor
// and its saved version to the glue, which compares versions and, when they
// differ, gives it back (hold_live): unpack then answers from the live
// tensor and the glue raises autograd's error. Copies made on the caller's
// thread (Note [Host copies on the caller]) cannot tear.
//
// Note [Host copies on the caller]
// For small host tensors a worker round trip (queue, wake-up, completion,
// poll) costs far more than the copy: tens of microseconds against one for
// 16 KiB. Host entries of at most inline_copy_bytes bound for the host tier
// are therefore copied into a host blob inside save() (the tensor is never
// held), and every host reload not already started runs inside unpack(),
// into a pool buffer, on the caller's thread (a worker would only add a
// hand-off to the same wait). Workers keep the larger host stores, which
// overlap compute, and every SSD write; prefetch skips the small host-tier
// entries, whose reloads cost less than a hand-off.
//
// Note [One call per unpack]
// unpack() does what request(), start_load(), wait() and consume() did in
// turn: a host entry comes back as a pool buffer holding its bytes or as the
// live tensor; a device entry the same, or, when no load was started, a
// request for a buffer (allocated by the glue through torch's allocator,
// then start_load(), then unpack() again). It also returns the prefetch
// candidates behind the entry and the completions since the last call.

struct TensorCache::Entry {
  EntryId id = 0;
  uint64_t key = 0;
  uint64_t version = 0;
  void* src = nullptr;
  uint64_t nbytes = 0;
  int device = mem::kHost;
  int microbatch = 0;
  int tier = kTierFirst;
  uint64_t step = 0;
  EntryState state = EntryState::kKept;
  bool acked = true;
  bool busy = false;
  bool caller_busy = false;  // `busy` on a caller's thread (a host reload): a release waits for it
  bool load_started = false;
  bool abandoned = false;  // released while a worker ran its work (Note [Abandoned work])
  int handles = 0;
  int unpacks_left = 0;
  int64_t consumed_task = -1;  // graph task that consumed the last load
  uint64_t reused_step = UINT64_MAX;  // step in which it was last answered from its original
  uint64_t tally_step = UINT64_MAX;   // step in which its bytes were last counted reloaded or reused
  bool tally_reused = false;          // ... as reused
  Location loc = 0;
  bool has_loc = false;
  void* dst = nullptr;
  mem::cuda::Event ready_ev = 0;       // data ready on the compute stream (store)
  mem::cuda::Event dst_ready_ev = 0;   // reload buffer allocated (load)
  mem::cuda::Event load_done_ev = 0;   // reload copied (load)
  std::exception_ptr load_error;
  // Stream-ordered device entries (Note [Stream-ordered offload]).
  bool stream_ordered = false;
  void* blob = nullptr;                // page-locked host copy, while it holds the bytes
  Store* blob_store = nullptr;         // the store `blob_loc` belongs to
  Location blob_loc = 0;
  mem::cuda::Event copy_ev = 0;        // the device-to-host copy into `blob` is done
  bool spill_queued = false;           // a worker is to write `blob` to the SSD
  bool loaded_once = false;            // a host-to-device copy read `blob` (load_done_ev)
  bool spilling = false;               // a worker is writing `blob` to the SSD
  uint64_t copy_through = 0;           // the lane's `enqueued` once its copy was
  mem::cuda::Stream src_stream = 0;    // the stream the saved tensor was produced on
  // Note [Glue objects].
  GlueObj live;
  GlueObj orig;
  GlueObj buf;                         // owns `dst` while loading or loaded
  bool buf_host = false;               // `buf` is a host pool buffer; `dst` is `buf_phase` bytes in
  uint64_t buf_phase = 0;
  mem::cuda::Stream buf_stream = 0;    // glue buffer: the stream it was allocated on
  bool load_enqueued = false;          // a host-to-device copy into `buf` was enqueued (load_done_ev)
  bool load_waited = false;            // ... and a stream of the glue was made to wait for it
  size_t order_pos = SIZE_MAX;         // its place in its micro-batch's order, if it has one
};

namespace {

// In MicroBatch::order: bytes the glue kept without an entry (note_kept).
constexpr EntryId kKeptBytes = 0;

// Declared after a call's Lock: swaps the graveyard out while the lock is
// held; the caller's vector, declared before the Lock, destroys it after the
// unlock (Note [Glue objects]).
struct Reaper {
  std::vector<GlueObj>& grave;
  std::vector<GlueObj>& out;
  ~Reaper() {
    if (!grave.empty()) out.swap(grave);
  }
};

bool is_resident(EntryState s, bool acked) {
  switch (s) {
    case EntryState::kStored: return !acked;
    default: return true;
  }
}
bool in_window(EntryState s) { return s == EntryState::kLoading || s == EntryState::kLoaded; }
bool in_flight(EntryState s) { return s == EntryState::kQueued || s == EntryState::kStoring; }

std::string what_of(std::exception_ptr err) {
  try {
    std::rethrow_exception(err);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error";
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void fold(Counters& total, const Counters& step) {
  total.bytes_offloaded += step.bytes_offloaded;
  total.bytes_reloaded += step.bytes_reloaded;
  total.tensors_saved += step.tensors_saved;
  total.tensors_deduped += step.tensors_deduped;
  total.tensors_offloaded += step.tensors_offloaded;
  total.tensors_forwarded += step.tensors_forwarded;
  total.tensors_kept += step.tensors_kept;
  total.tensors_reloaded += step.tensors_reloaded;
  total.tensors_reused += step.tensors_reused;
  total.bytes_reused += step.bytes_reused;
  total.bytes_discarded += step.bytes_discarded;
  total.store_failures += step.store_failures;
  total.load_failures += step.load_failures;
  total.copy_waits += step.copy_waits;
  total.tensors_in_capture += step.tensors_in_capture;
  total.saved_bytes_total += step.saved_bytes_total;
  total.peak_resident_bytes = std::max(total.peak_resident_bytes, step.peak_resident_bytes);
  total.stall_seconds += step.stall_seconds;
}

}  // namespace

std::string_view to_string(EntryState s) {
  switch (s) {
    case EntryState::kKept: return "kept";
    case EntryState::kQueued: return "queued";
    case EntryState::kStoring: return "storing";
    case EntryState::kStored: return "stored";
    case EntryState::kLoading: return "loading";
    case EntryState::kLoaded: return "loaded";
    case EntryState::kForwarded: return "forwarded";
    case EntryState::kFailed: return "failed";
  }
  return "?";
}

std::string_view to_string(Reload r) {
  switch (r) {
    case Reload::kResident: return "resident";
    case Reload::kForward: return "forward";
    case Reload::kNeedBuffer: return "need_buffer";
    case Reload::kPending: return "pending";
  }
  return "?";
}

TensorCache::TensorCache(std::unique_ptr<Store> store, CacheOptions options)
    : store_(std::move(store)), opts_(options) {
  EBB_CHECK(store_ != nullptr, "tensor cache: no store");
  EBB_CHECK(opts_.workers >= 1 && opts_.workers <= 64, "tensor cache: workers ", opts_.workers,
            " out of range 1..64");
  workers_.reserve(opts_.workers);
  for (unsigned i = 0; i < opts_.workers; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

TensorCache::~TensorCache() {
  try {
    close();
  } catch (const std::exception& e) {
    log::error("tensor cache: close failed: ", e.what());
  }
}

TensorCache::Entry& TensorCache::find(EntryId id, const char* what) {
  auto it = entries_.find(id);
  EBB_CHECK_STATE(it != entries_.end(), "tensor cache: ", what, ": entry ", id,
                  " is not live (released, or its step was aborted)");
  return *it->second;
}

void TensorCache::mutate(Entry& e, EntryState s, bool acked) {
  bool r0 = is_resident(e.state, e.acked), w0 = in_window(e.state), f0 = in_flight(e.state);
  e.state = s;
  e.acked = acked;
  bool r1 = is_resident(e.state, e.acked), w1 = in_window(e.state), f1 = in_flight(e.state);
  if (f0 && !f1) inflight_ -= e.nbytes;
  if (!f0 && f1) inflight_ += e.nbytes;
  if (r0 && !r1) resident_ -= e.nbytes;
  if (!r0 && r1) resident_ += e.nbytes;
  if (w0 && !w1) window_ -= e.nbytes;
  if (!w0 && w1) window_ += e.nbytes;
  step_c_.peak_resident_bytes = std::max(step_c_.peak_resident_bytes, resident_);
}

// Note [Caller's context]
// save(), start_load() and wait() run on the training thread, whose current
// CUDA context is whatever torch last used there: another GPU's, or none at
// all on an autograd thread that has not launched a kernel yet. They record
// and wait on events, which act in the current context, so each binds the
// entry's device for the call (mem::cuda::DeviceScope) and restores the
// caller's context after. Events live in per-device pools and are all created
// there, never on a worker (a worker binds its device only when it copies).
// An event may have several holders (a copy event: its entry, the lane's
// pending list, a fenced free); it returns to the pool when the last gives it.
mem::cuda::Event TensorCache::take_event_locked(int device) {
  auto& pool = free_events_[device];
  mem::cuda::Event ev = 0;
  if (!pool.empty()) {
    ev = pool.back();
    pool.pop_back();
  } else {
    EBB_CHECK_STATE(opts_.driver != nullptr, "tensor cache: device tensor but no CUDA driver");
    ev = opts_.driver->event_create();
  }
  event_refs_[ev] = 1;
  return ev;
}

void TensorCache::ref_event_locked(mem::cuda::Event ev) { event_refs_[ev] += 1; }

void TensorCache::give_event_locked(int device, mem::cuda::Event& ev) {
  if (ev != 0) {
    auto it = event_refs_.find(ev);
    if (it == event_refs_.end() || --it->second <= 0) {
      if (it != event_refs_.end()) event_refs_.erase(it);
      free_events_[device].push_back(ev);
    }
  }
  ev = 0;
}

void TensorCache::add_stall(double s) { step_c_.stall_seconds += s; }

// Note [Graph capture]
// While a stream is captured into a CUDA graph (torch.cuda.graph,
// make_graphed_callables) nothing enqueued on it runs, and in torch's global
// capture mode host synchronisation, event queries, host registration and
// stream creation are illegal. A save whose producing stream is capturing is
// therefore kept resident, with no driver call beyond the capture query
// (counted as tensors_in_capture): the graph's private pool holds its memory
// and a replay rewrites it, so an offload could not be replayed anyway.
// Release points and prefetches on a capturing stream do nothing (the copies
// are released at the next point outside the capture); a reload of an entry
// saved outside the capture is refused with a clear error; drops that need a
// wait on a capturing stream are deferred (Note [Stream-ordered drops]).
// Workers relax their own capture mode (Note [Spill readiness]).
SaveResult TensorCache::save(const SaveRequest& r) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  EBB_CHECK_STATE(!closed_, "tensor cache: save on a closed cache");
  EBB_CHECK(r.src.nbytes > 0 && r.src.ptr != nullptr, "tensor cache: save of an empty storage (key ", r.key, ")");
  EBB_CHECK(!r.src.on_device() || opts_.driver != nullptr, "tensor cache: device ", r.src.device,
            " tensor saved but no CUDA driver is loaded");
  step_c_.tensors_saved += 1;
  // A dedup hit needs the same storage (key), the same bytes and the same
  // version: after an in-place change the old snapshot must not serve the new.
  if (auto it = by_key_.find({r.key, r.version}); it != by_key_.end()) {
    Entry& e = *entries_.at(it->second);
    if (e.nbytes == r.src.nbytes && e.src == r.src.ptr && e.device == r.src.device) {
      e.handles += 1;
      if (e.state == EntryState::kLoaded) e.unpacks_left += 1;
      step_c_.tensors_deduped += 1;
      bool off = e.state != EntryState::kKept && e.state != EntryState::kFailed;
      return SaveResult{e.id, new_handle_locked(e.id), false, off, take_completions_locked()};
    }
  }
  auto e = std::make_unique<Entry>();
  e->id = next_id_++;
  e->key = r.key;
  e->version = r.version;
  e->src = r.src.ptr;
  e->nbytes = r.src.nbytes;
  e->device = r.src.device;
  e->microbatch = r.microbatch;
  e->tier = r.tier;
  e->step = step_;
  e->handles = 1;
  e->state = EntryState::kKept;
  e->orig = r.orig;
  e->src_stream = r.src.stream;
  bool offload = r.offload && !stop_offload_;
  if (r.src.on_device() && capturing_locked(r.src.device, r.src.stream)) {
    offload = false;  // Note [Graph capture]
    step_c_.tensors_in_capture += 1;
  } else if (r.src.on_device() && !deferred_.empty()) {
    flush_deferred_locked(false);
  }
  if (offload && opts_.max_inflight_bytes != 0 && inflight_ + r.src.nbytes > opts_.max_inflight_bytes) {
    // Note [Store backpressure]: bounds the memory held for pending stores
    // when the store is slower than compute (the wait counts as stall).
    auto t0 = std::chrono::steady_clock::now();
    done_cv_.wait(lock, [&] {
      return closed_ || stores_paused_ || inflight_ == 0 || inflight_ + r.src.nbytes <= opts_.max_inflight_bytes;
    });
    add_stall(seconds_since(t0));
    EBB_CHECK_STATE(!closed_, "tensor cache: closed while a save waited");
    offload = !stop_offload_;
  }
  // Device entries are copied stream-ordered from here when they can be
  // (Note [Stream-ordered offload]), else by a worker, else kept.
  bool stream_ordered = false;
  if (offload && r.src.on_device()) {
    switch (offload_device_locked(*e, r)) {
      case DevicePath::kOffloaded: stream_ordered = true; break;
      case DevicePath::kKeep: offload = false; break;
      case DevicePath::kWorker: break;
    }
  }
  if (offload && !stream_ordered && r.src.on_device()) {  // the only step that can fail: before any accounting
    mem::cuda::DeviceScope scope(opts_.driver, r.src.device);  // Note [Caller's context]
    e->ready_ev = take_event_locked(r.src.device);
    try {
      opts_.driver->event_record(e->ready_ev, r.src.stream);
    } catch (...) {
      give_event_locked(r.src.device, e->ready_ev);
      throw;
    }
  }
  const bool on_caller = offload && !r.src.on_device() && copy_on_caller_locked(*e, r);
  // Resident: kKept, kQueued, or kStored until its release point; the cache
  // holds the tensor until then.
  if (!on_caller) {
    resident_ += e->nbytes;
    step_c_.peak_resident_bytes = std::max(step_c_.peak_resident_bytes, resident_);
    e->live = r.live;
  }
  step_c_.saved_bytes_total += r.src.nbytes;
  const EntryId id = e->id;
  if (offload) {
    if (!stream_ordered && !on_caller) {
      e->state = EntryState::kQueued;
      inflight_ += e->nbytes;
      store_q_.push_back(id);
      work_cv_.notify_one();
    }
    auto& mb = microbatches_[r.microbatch];
    push_order_locked(mb, e.get(), r.src.nbytes, !on_caller);  // Note [Host copies on the caller]
    mb.backward_began = false;  // a new forward of this micro-batch
  } else {
    step_c_.tensors_kept += 1;
    if (r.src.on_device()) {
      // Kept device entries hold their place in the forward order, so the
      // prefetch distance counts them (Note [Prefetch distance]): a plan
      // keeps the tail resident, and the reloads of the early blocks must
      // wait until backward has freed it.
      push_order_locked(microbatches_[r.microbatch], e.get(), r.src.nbytes, false);
    }
  }
  by_key_[{r.key, r.version}] = id;
  entries_.emplace(id, std::move(e));
  const HandleId h = new_handle_locked(id);
  if (stream_ordered) {
    try {  // the entry and its handle exist: a failed bound only leaves its copies held
      mem::cuda::DeviceScope scope(opts_.driver, r.src.device);
      bound_copies_locked(lanes_.at(r.src.device), r.src.stream);
    } catch (const std::exception& ex) {
      log::warn_once("cache.copy_bound", detail::concat("tensor cache: bounding the device copies in flight failed (",
                                                        ex.what(), "); they stay held until a release point"));
    }
  }
  return SaveResult{id, h, true, offload, take_completions_locked()};
}

// Note [Host copies on the caller]. False when the entry is not for this path
// or the host tier is full (the worker path then spills it to the SSD).
bool TensorCache::copy_on_caller_locked(Entry& e, const SaveRequest& r) {
  if (r.src.on_device() || r.tier == kTierSsd || r.src.nbytes > opts_.inline_copy_bytes || !store_->has_tier(kTierCpu))
    return false;
  HostSpace space;
  try {
    space = store_->reserve_host(r.src.nbytes);
  } catch (const IoError& ex) {
    if (ex.err() == ENOSPC || ex.err() == ENOMEM) return false;
    throw;
  }
  std::memcpy(space.ptr, r.src.ptr, r.src.nbytes);
  e.loc = space.loc;
  e.has_loc = true;
  e.state = EntryState::kStored;
  e.acked = true;
  step_c_.bytes_offloaded += r.src.nbytes;
  step_c_.tensors_offloaded += 1;
  return true;
}

// `e` (or, null, `nbytes` kept without an entry) takes the next place in the
// micro-batch's forward order.
void TensorCache::push_order_locked(MicroBatch& mb, Entry* e, uint64_t nbytes, bool loadable) {
  if (loadable) mb.loadable.push_back(mb.order.size());
  if (e != nullptr) {
    e->order_pos = mb.order.size();
    mb.live += 1;
  }
  mb.order.push_back(e != nullptr ? e->id : kKeptBytes);
  mb.cum.push_back(mb.cum.back() + nbytes);
}

void TensorCache::bury_locked(GlueObj& obj) {
  if (obj) graveyard_.push_back(std::move(obj));
  obj.reset();
}

// Note [Torn snapshots]: the completions since the last call, each with the
// live tensor the cache stops holding.
std::vector<Completion> TensorCache::take_completions_locked() {
  std::vector<Completion> out;
  if (completions_.empty()) return out;
  out.swap(completions_);
  for (auto& c : out) {
    auto it = entries_.find(c.id);
    if (it == entries_.end()) continue;
    Entry& e = *it->second;
    if (c.ok && e.state == EntryState::kStored && !e.acked) {
      mutate(e, EntryState::kStored, true);
      c.live = std::move(e.live);
      c.version = e.version;
    }
  }
  return out;
}

HandleId TensorCache::new_handle_locked(EntryId id) {
  const HandleId h = next_handle_++;
  handles_.emplace(h, id);
  return h;
}

TensorCache::Lane& TensorCache::lane_locked(int device) {
  auto it = lanes_.find(device);
  if (it != lanes_.end()) return it->second;
  Lane lane;  // streams of the current context: the caller bound `device`
  lane.device = device;
  lane.copy = opts_.driver->stream_create();
  try {
    lane.load = opts_.driver->stream_create();
  } catch (...) {
    opts_.driver->stream_destroy(lane.copy);
    throw;
  }
  return lanes_.emplace(device, lane).first->second;
}

Store& TensorCache::staging_locked() {
  if (!staging_) {
    HostStoreOptions o;
    o.driver = opts_.driver;
    staging_ = make_host_store(o);
  }
  return *staging_;
}

// Note [Stream-ordered offload]. kKeep: no host space (budget full, no SSD
// tier, staging_bytes reached); kWorker: the blob could not be page-locked,
// so the copy would not overlap: the entry takes the worker path.
TensorCache::DevicePath TensorCache::offload_device_locked(Entry& e, const SaveRequest& r) {
  auto* drv = opts_.driver;
  mem::cuda::DeviceScope scope(drv, r.src.device);  // Note [Caller's context]
  if (!fenced_.empty()) sweep_fenced_locked(false);
  const auto full = [](const IoError& ex) { return ex.err() == ENOSPC || ex.err() == ENOMEM; };
  HostSpace space;
  Store* owner = nullptr;
  bool spill = false;
  if (r.tier != kTierSsd && store_->has_tier(kTierCpu)) {
    try {
      space = store_->reserve_host(r.src.nbytes);
      owner = store_.get();
    } catch (const IoError& ex) {
      if (!full(ex)) throw;
    }
  }
  if (owner == nullptr && store_->has_tier(kTierSsd)) {
    Store& st = staging_locked();
    if (st.stats().bytes_held + r.src.nbytes <= opts_.staging_bytes) {
      try {
        space = st.reserve_host(r.src.nbytes);
        owner = &st;
        spill = true;
      } catch (const IoError& ex) {
        if (!full(ex)) throw;
      }
    }
  }
  if (owner == nullptr) return DevicePath::kKeep;
  if (!space.pinned) {
    owner->free(space.loc);
    return DevicePath::kWorker;
  }
  Lane* lane = nullptr;
  mem::cuda::Event ready = 0;
  mem::cuda::Event copy = 0;
  bool enqueued = false;
  try {
    lane = &lane_locked(r.src.device);
    ready = take_event_locked(r.src.device);
    drv->event_record(ready, r.src.stream);
    drv->stream_wait_event(lane->copy, ready);
    give_event_locked(r.src.device, ready);  // the wait captured the record: the event may be reused
    drv->memcpy_dtoh_async(space.ptr, reinterpret_cast<mem::cuda::DevicePtr>(r.src.ptr), r.src.nbytes, lane->copy);
    enqueued = true;
    copy = take_event_locked(r.src.device);
    drv->event_record(copy, lane->copy);
  } catch (...) {
    give_event_locked(r.src.device, ready);
    give_event_locked(r.src.device, copy);
    // A copy already enqueued still writes the blob: freed only once it ran.
    bool free_it = !enqueued;
    if (enqueued) {
      try {
        drv->stream_synchronize(lane->copy);
        free_it = true;
      } catch (const std::exception& ex) {
        log::error("tensor cache: a failed offload's copy could not be waited for (", ex.what(),
                   "); its host blob is kept");
      }
    }
    if (free_it) owner->free(space.loc);
    throw;
  }
  lane->enqueued += r.src.nbytes;
  ref_event_locked(copy);
  lane->pending.push_back(Lane::Copy{lane->enqueued, copy, e.id, r.src.stream});
  e.stream_ordered = true;
  e.blob = space.ptr;
  e.blob_store = owner;
  e.blob_loc = space.loc;
  e.copy_ev = copy;
  e.copy_through = lane->enqueued;
  e.state = EntryState::kStored;
  e.acked = false;  // the glue holds the tensor until a release point
  step_c_.bytes_offloaded += r.src.nbytes;
  step_c_.tensors_offloaded += 1;
  if (spill) {  // Note [SSD below the link]
    e.spill_queued = true;
    store_q_.push_back(e.id);
    work_cv_.notify_one();
  }
  return DevicePath::kOffloaded;
}

// Note [Release points]: reports the entries whose copies are done up to
// `through` in the lane, after making the streams their tensors were produced
// on (and `compute`, when given) wait for the copy that ends there (skipped
// when a host query already saw it complete). The glue then drops the
// tensors: each is freed to the stream it was produced on, or held by the
// allocator until that stream passed the wait (record_stream at save), so no
// stream reuses memory a copy still reads (Note [Stream-ordered drops]).
void TensorCache::release_through_locked(Lane& lane, uint64_t through, const mem::cuda::Stream* compute) {
  auto* drv = opts_.driver;
  // The waits first: when one fails (or a stream is being captured) nothing
  // is released and the copies stay held for a later point.
  mem::cuda::Event last = 0;
  std::vector<mem::cuda::Stream> streams;
  if (compute != nullptr) streams.push_back(*compute);
  for (const auto& c : lane.pending) {
    if (c.through > through) break;
    if (std::find(streams.begin(), streams.end(), c.src) == streams.end()) streams.push_back(c.src);
    if (c.through == through) last = c.ev;
  }
  if (last == 0) return;
  for (mem::cuda::Stream s : streams)
    if (drv->stream_is_capturing(s)) return;  // Note [Graph capture]
  if (!drv->event_query(last)) {
    for (mem::cuda::Stream s : streams) drv->stream_wait_event(s, last);
    step_c_.copy_waits += 1;
  }
  while (!lane.pending.empty() && lane.pending.front().through <= through) {
    Lane::Copy c = lane.pending.front();
    lane.pending.pop_front();
    give_event_locked(lane.device, c.ev);
    auto it = entries_.find(c.id);
    if (it != entries_.end() && it->second->state == EntryState::kStored && !it->second->acked)
      completions_.push_back({c.id, true});
  }
  lane.waited = std::max(lane.waited, through);
}

// Note [Copy bound]. Copies a host query saw complete are released for free;
// then, while more than device_inflight_bytes are held, the oldest copy whose
// completion brings the backlog under the bound is waited for.
void TensorCache::bound_copies_locked(Lane& lane, mem::cuda::Stream compute) {
  auto* drv = opts_.driver;
  uint64_t seen_done = 0;
  for (const auto& c : lane.pending) {
    if (!drv->event_query(c.ev)) break;
    seen_done = c.through;
  }
  if (seen_done != 0) release_through_locked(lane, seen_done, &compute);
  const uint64_t limit = opts_.device_inflight_bytes;
  if (limit == 0 || lane.enqueued - lane.waited <= limit) return;
  for (const auto& c : lane.pending) {
    if (lane.enqueued - c.through <= limit) {
      release_through_locked(lane, c.through, &compute);
      return;
    }
  }
}

void TensorCache::release_copies(int microbatch, int64_t scope, mem::cuda::Stream compute) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  if (!deferred_.empty()) flush_deferred_locked(false);
  auto m = microbatches_.find(microbatch);
  // Nothing held (e.g. every block's backward after the first released all):
  // no walk over the order.
  const bool held = std::any_of(lanes_.begin(), lanes_.end(), [](const auto& l) { return !l.second.pending.empty(); });
  if (m == microbatches_.end() || !held) return;
  const MicroBatch& mb = m->second;
  size_t end = mb.order.size();
  if (scope != INT64_MAX) {
    auto s = mb.scope_end.find(scope);
    if (s == mb.scope_end.end()) return;
    end = std::min(end, s->second);
  }
  std::map<int, uint64_t> through;  // per device: the newest held copy to release
  for (size_t i = 0; i < end; ++i) {
    auto it = entries_.find(mb.order[i]);
    if (it == entries_.end()) continue;
    const Entry& e = *it->second;
    if (!e.stream_ordered || e.acked || e.copy_through == 0) continue;
    through[e.device] = std::max(through[e.device], e.copy_through);
  }
  for (auto [device, t] : through) {
    mem::cuda::DeviceScope ds(opts_.driver, device);  // Note [Caller's context]
    release_through_locked(lanes_.at(device), t, &compute);
  }
}

// The blob returns to its store once the last device copy touching it ran:
// the reload's when there was one (it waited for the store's copy), else the
// store's (Note [Stream-ordered offload]).
void TensorCache::free_blob_locked(Entry& e) {
  if (e.blob == nullptr) return;
  const mem::cuda::Event fence = e.loaded_once ? e.load_done_ev : e.copy_ev;
  if (fence != 0) {
    ref_event_locked(fence);
    fenced_.push_back(FencedFree{e.device, fence, e.blob_store, e.blob_loc});
  } else {
    try {
      e.blob_store->free(e.blob_loc);
    } catch (const std::exception& ex) {
      log::error("tensor cache: freeing the host copy of entry ", e.id, ": ", ex.what());
    }
  }
  e.blob = nullptr;
}

void TensorCache::sweep_fenced_locked(bool wait) {
  auto* drv = opts_.driver;
  for (auto it = fenced_.begin(); it != fenced_.end();) {
    bool done = false;
    try {
      mem::cuda::DeviceScope scope(drv, it->device);
      if (wait) drv->event_synchronize(it->fence);
      done = wait || drv->event_query(it->fence);
    } catch (const std::exception& ex) {
      log::error("tensor cache: waiting for a device copy before freeing its host blob: ", ex.what());
      done = false;  // kept: never freed under a copy that may still run
    }
    if (!done) {
      ++it;
      continue;
    }
    try {
      it->store->free(it->loc);
    } catch (const std::exception& ex) {
      log::error("tensor cache: freeing a host blob: ", ex.what());
    }
    give_event_locked(it->device, it->fence);
    it = fenced_.erase(it);
  }
}

void TensorCache::wait_idle_locked(Lock& lock, Entry& e) {
  if (!e.busy) return;
  const EntryId id = e.id;  // `e` may be gone when the wait ends (another release)
  auto t0 = std::chrono::steady_clock::now();
  done_cv_.wait(lock, [&] {
    auto it = entries_.find(id);
    return it == entries_.end() || !it->second->busy;
  });
  add_stall(seconds_since(t0));
}

// Note [Abandoned work]
// Releasing an entry never waits for a worker: backward's autograd thread
// releases entries as their nodes die, and a wait there for a running store,
// spill or load (hundreds of MiB at disk or PCIe speed) stalls backward. An
// entry whose work runs on a worker (`busy`, not `caller_busy`) moves to abandoned_ with
// everything that work touches: the saved tensor the store reads (device
// memory stays mapped and unused by anyone else while the glue's reference
// lives, so neither a reuse by the caching allocator nor an unmap by
// empty_cache() with expandable segments can pull it from under the copy),
// the reload buffer a load writes, the bounce blob a spill reads. When the
// work ends, the worker disposes of all of it (glue objects through the
// graveyard, stream-ordered where a device copy may still run: Note
// [Stream-ordered drops]) and drops the entry. Bytes stored for an entry
// that is gone are counted as discarded. Loads the caller's thread runs itself
// (Note [Host copies on the caller]) are still waited for: the releasing
// thread is another one, and the copy is a short memcpy.
//
// Note [Stream-ordered drops]
// Dropping a glue object that is device memory frees it to torch's caching
// allocator on the stream it was allocated on, which hands it to that
// stream's next allocation at once. So before the drop, every device copy
// that may still touch it must be ordered before that stream's next work:
//   - a reload buffer (`buf`, allocated on `buf_stream`) whose host-to-device
//     copy no unpack waited for (the entry was released before its backward,
//     answered from its original, its backward raised): `buf_stream` waits
//     for `load_done_ev`;
//   - a saved tensor whose device-to-host copy was not released yet (the
//     graph died during forward): the stream it was produced on waits for
//     `copy_ev`. The glue records that stream on the tensor at save
//     (record_stream), so a tensor allocated on another stream (MoE
//     all-to-all, communication overlap) is held by the allocator until that
//     stream passed this wait too.
// The waits are on the device; the host never synchronises. A wait on a stream
// that is being captured into a CUDA graph is illegal: such drops are
// deferred (deferred_) to the next call on an uncaptured stream, or to close.
void TensorCache::erase_locked(Lock& lock, EntryId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Entry& e = *it->second;
  const bool abandon = e.busy && !e.caller_busy;
  if (!abandon && e.busy) {
    wait_idle_locked(lock, e);  // the lock was released: look the entry up again
    erase_locked(lock, id);
    return;
  }
  mutate(e, EntryState::kStored, true);  // leaves resident and window sums
  if (auto k = by_key_.find({e.key, e.version}); k != by_key_.end() && k->second == id) by_key_.erase(k);
  if (auto m = microbatches_.find(e.microbatch); m != microbatches_.end()) {
    if (e.order_pos != SIZE_MAX && --m->second.live == 0) {
      microbatches_.erase(m);
    }
  }
  if (abandon) {
    e.abandoned = true;
    abandoned_.emplace(id, std::move(it->second));
  } else {
    dispose_locked(e);
  }
  entries_.erase(it);
}

// Frees what an entry holds: its stored bytes, its host blob (fenced), its
// glue objects (Note [Stream-ordered drops]) and its events.
void TensorCache::dispose_locked(Entry& e) {
  if (e.has_loc) {
    try {
      store_->free(e.loc);
    } catch (const std::exception& ex) {
      log::error("tensor cache: freeing entry ", e.id, ": ", ex.what());
    }
    e.has_loc = false;
  }
  if (e.stream_ordered && e.live && e.copy_ev != 0) {
    // Not released yet: the copy may still read it.
    fence_drop_locked(e.device, e.src_stream, e.copy_ev, e.live);
  }
  free_blob_locked(e);
  bury_locked(e.live);
  bury_locked(e.orig);
  drop_buf_locked(e);
  give_event_locked(e.device, e.copy_ev);
  give_event_locked(e.device, e.ready_ev);
  give_event_locked(e.device, e.dst_ready_ev);
  give_event_locked(e.device, e.load_done_ev);
}

// Blocks until no abandoned entry matching `pred` is left (Note [Abandoned work]).
void TensorCache::wait_abandoned_locked(Lock& lock, const std::function<bool(const Entry&)>& pred) {
  done_cv_.wait(lock, [&] {
    return std::none_of(abandoned_.begin(), abandoned_.end(), [&](const auto& kv) { return pred(*kv.second); });
  });
}

// A worker's work on an abandoned entry ended (Note [Abandoned work]).
void TensorCache::finish_abandoned_locked(Entry& e) {
  const EntryId id = e.id;
  dispose_locked(e);
  abandoned_.erase(id);  // destroys `e`
  done_cv_.notify_all();
}

// Note [Stream-ordered drops], for the reload buffer.
void TensorCache::drop_buf_locked(Entry& e) {
  if (e.buf && !e.buf_host && e.device >= 0 && e.load_enqueued && !e.load_waited && e.load_done_ev != 0)
    fence_drop_locked(e.device, e.buf_stream, e.load_done_ev, e.buf);
  bury_locked(e.buf);
  e.load_enqueued = false;
  e.load_waited = false;
}

// Note [Graph capture]: a reload (or a wait for one) of an entry saved
// outside the capture cannot be captured.
void TensorCache::refuse_in_capture_locked(const Entry& e, mem::cuda::Stream stream) {
  EBB_CHECK_STATE(!capturing_locked(e.device, stream), "tensor cache: entry ", e.id,
                  " was saved outside a CUDA graph capture and is unpacked inside one: its reload cannot be "
                  "captured (capture the whole step, or none of its backward)");
}

bool TensorCache::capturing_locked(int device, mem::cuda::Stream stream) {
  if (opts_.driver == nullptr || device < 0) return false;
  mem::cuda::DeviceScope scope(opts_.driver, device);  // Note [Caller's context]
  return opts_.driver->stream_is_capturing(stream);
}

// Makes `stream` wait for `fence` unless `stream` is being captured (then
// false: Note [Graph capture]). Throws what the driver does.
bool TensorCache::order_after_locked(int device, mem::cuda::Stream stream, mem::cuda::Event fence) {
  mem::cuda::DeviceScope scope(opts_.driver, device);  // Note [Caller's context]
  if (opts_.driver->stream_is_capturing(stream)) return false;
  opts_.driver->stream_wait_event(stream, fence);
  return true;
}

// `stream` waits for `fence`, then `obj` is dropped (Note [Stream-ordered drops]).
void TensorCache::fence_drop_locked(int device, mem::cuda::Stream stream, mem::cuda::Event fence, GlueObj& obj) {
  if (!obj) return;
  try {
    if (order_after_locked(device, stream, fence)) {
      bury_locked(obj);
      return;
    }
  } catch (const std::exception& ex) {
    // Held until close, which synchronises the device first.
    log::error("tensor cache: ordering a drop after device ", device, "'s copy failed (", ex.what(),
               "); the memory is held until the cache closes");
  }
  ref_event_locked(fence);
  deferred_.push_back(DeferredDrop{device, stream, fence, std::move(obj)});
  obj.reset();
}

// Deferred drops whose streams are no longer captured (all: every one, the
// device being idle, at close).
void TensorCache::flush_deferred_locked(bool all) {
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    bool done = all;
    if (!all) {
      try {
        done = order_after_locked(it->device, it->stream, it->fence);
      } catch (const std::exception& ex) {
        log::warn_once("cache.deferred_drop", detail::concat("tensor cache: ordering a deferred drop failed (",
                                                             ex.what(), "); it is held until the cache closes"));
      }
    }
    if (!done) {
      ++it;
      continue;
    }
    bury_locked(it->obj);
    give_event_locked(it->device, it->fence);
    it = deferred_.erase(it);
  }
}

// Note [Interrupted release]
// The glue releases a handle from its __del__, where a KeyboardInterrupt can
// land between any two Python bytecodes; it then releases the handle once
// more. Counting per handle, not per entry, makes the second call harmless: a
// dedup'd entry is never freed while another handle still needs it.
bool TensorCache::release_handle(HandleId handle, EntryId id) {
  {
    Lock lock(mu_);
    auto it = handles_.find(handle);
    if (it == handles_.end()) return entries_.count(id) == 0;
    id = it->second;
    handles_.erase(it);
  }
  return release(id);
}

bool TensorCache::release(EntryId id) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  auto it = entries_.find(id);
  if (it == entries_.end()) return true;
  Entry& e = *it->second;
  e.handles -= 1;
  if (e.handles > 0) {
    if (e.state == EntryState::kLoaded) e.unpacks_left = std::min(e.unpacks_left, e.handles);
    return false;
  }
  erase_locked(lock, id);
  done_cv_.notify_all();
  return true;
}

std::vector<Completion> TensorCache::poll() {
  Lock lock(mu_);
  return take_completions_locked();
}

void TensorCache::hold_live(EntryId id, GlueObj live) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    dead.push_back(std::move(live));
    return;
  }
  bury_locked(it->second->live);
  it->second->live = std::move(live);
}

std::vector<std::pair<EntryId, GlueObj>> TensorCache::held_lives(uint64_t step) const {
  Lock lock(mu_);
  std::vector<std::pair<EntryId, GlueObj>> out;
  for (const auto& [id, e] : entries_) {
    if (e->live && (step == 0 || e->step == step)) out.emplace_back(id, e->live);
  }
  return out;
}

size_t TensorCache::entry_count() const {
  Lock lock(mu_);
  return entries_.size();
}

Reload TensorCache::request(EntryId id) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  EBB_CHECK_STATE(!closed_, "tensor cache: unpack from a closed cache (entry ", id, ")");
  Entry& e = find(id, "unpack");
  switch (e.state) {
    case EntryState::kKept:
    case EntryState::kForwarded:
    case EntryState::kFailed:
      return Reload::kResident;
    case EntryState::kQueued:
    case EntryState::kStoring: {
      // The queued store is skipped by its worker; a running one frees its
      // space on completion (Note [Entry states]).
      mutate(e, EntryState::kForwarded, true);
      step_c_.tensors_forwarded += 1;
      if (auto m = microbatches_.find(e.microbatch); m != microbatches_.end()) {
        cancel_late_stores_locked(m->second);
      }
      return Reload::kForward;
    }
    case EntryState::kStored:
      if (!e.acked && e.stream_ordered) return Reload::kResident;  // before its release point
      if (!e.acked) {
        // Completed after the glue's last poll: the glue drops its live
        // reference now; the completion in completions_ is then a no-op.
        mutate(e, EntryState::kStored, true);
        bury_locked(e.live);
      }
      return Reload::kNeedBuffer;
    case EntryState::kLoading:
    case EntryState::kLoaded:
      return Reload::kPending;
  }
  return Reload::kResident;
}

void TensorCache::start_load(EntryId id, void* dst, mem::cuda::Stream stream) {
  Lock lock(mu_);
  EBB_CHECK_STATE(!closed_, "tensor cache: load on a closed cache");
  start_load_locked(find(id, "start_load"), dst, stream);
}

void TensorCache::start_load(EntryId id, void* dst, mem::cuda::Stream stream, GlueObj owner) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  EBB_CHECK_STATE(!closed_, "tensor cache: load on a closed cache");
  Entry& e = find(id, "start_load");
  EBB_CHECK_STATE(e.state == EntryState::kStored, "tensor cache: start_load of entry ", id, " in state ",
                  to_string(e.state), " (expected stored)");
  adopt_buffer_locked(e, std::move(owner), stream);
  start_load_locked(e, dst, stream);
}

// The glue's buffer `owner` (allocated on `stream`) holds the entry's reload.
// Called before the load into it starts (the old buffer's flags go with it).
void TensorCache::adopt_buffer_locked(Entry& e, GlueObj owner, mem::cuda::Stream stream) {
  drop_buf_locked(e);
  e.buf = std::move(owner);
  e.buf_host = false;
  e.buf_phase = 0;
  e.buf_stream = stream;
}

void TensorCache::start_loads(const std::vector<EntryId>& ids,
                              const std::vector<std::pair<uintptr_t, GlueObj>>& buffers, mem::cuda::Stream stream) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  EBB_CHECK_STATE(!closed_, "tensor cache: load on a closed cache");
  EBB_CHECK(buffers.empty() || buffers.size() == ids.size(), "tensor cache: start_loads of ", ids.size(),
            " entries with ", buffers.size(), " buffers");
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = entries_.find(ids[i]);
    if (it == entries_.end()) continue;
    Entry& e = *it->second;
    if (e.state != EntryState::kStored || !e.acked || e.live || (!e.has_loc && e.blob == nullptr)) continue;
    if (e.device < 0) {
      host_buffer_locked(e);
      start_load_locked(e, e.dst, 0);
    } else {
      EBB_CHECK(i < buffers.size() && buffers[i].first != 0, "tensor cache: no buffer for device entry ", e.id);
      if (capturing_locked(e.device, stream)) return;  // Note [Graph capture]: no prefetch inside one
      adopt_buffer_locked(e, buffers[i].second, stream);
      start_load_locked(e, reinterpret_cast<void*>(buffers[i].first), stream);
    }
  }
}

// A host pool buffer for `e`'s reload, its bytes starting at the saved
// storage's address modulo the store's I/O alignment (Note [Slot phase] in
// io/striping.cpp: O_DIRECT reads land in place), unless a 16-byte element could
// not start there.
void TensorCache::host_buffer_locked(Entry& e) {
  uint64_t phase = reinterpret_cast<uintptr_t>(e.src) % std::max<uint64_t>(1, store_->io_alignment());
  if (phase % 16 != 0) phase = 0;
  void* p = mem::HostBufferPool::shared().take(e.nbytes + phase).data;
  bury_locked(e.buf);
  e.buf = GlueObj(p, [](void* q) noexcept {
    try {
      mem::HostBufferPool::shared().give(q);
    } catch (...) {
    }
  });
  e.buf_host = true;
  e.buf_phase = phase;
  e.buf_stream = 0;
  e.dst = static_cast<char*>(p) + phase;
}

void TensorCache::start_load_locked(Entry& e, void* dst, mem::cuda::Stream stream) {
  const EntryId id = e.id;
  EBB_CHECK_STATE(e.state == EntryState::kStored && (e.has_loc || e.blob != nullptr),
                  "tensor cache: start_load of entry ", id, " in state ", to_string(e.state), " (expected stored)");
  EBB_CHECK(dst != nullptr, "tensor cache: start_load of entry ", id, " into a null buffer");
  e.dst = dst;
  e.load_started = false;
  e.load_error = nullptr;
  refuse_in_capture_locked(e, stream);
  if (e.stream_ordered && e.blob != nullptr) {
    // Note [Stream-ordered offload]: enqueued here, after the buffer's
    // allocation and the store's copy, with no host wait.
    auto* drv = opts_.driver;
    mem::cuda::DeviceScope scope(drv, e.device);  // Note [Caller's context]
    Lane& lane = lane_locked(e.device);
    if (e.dst_ready_ev == 0) e.dst_ready_ev = take_event_locked(e.device);
    if (e.load_done_ev == 0) e.load_done_ev = take_event_locked(e.device);
    drv->event_record(e.dst_ready_ev, stream);
    drv->stream_wait_event(lane.load, e.dst_ready_ev);
    drv->stream_wait_event(lane.load, e.copy_ev);
    drv->memcpy_htod_async(reinterpret_cast<mem::cuda::DevicePtr>(dst), e.blob, e.nbytes, lane.load);
    try {
      drv->event_record(e.load_done_ev, lane.load);
    } catch (...) {
      drv->stream_synchronize(lane.load);  // the buffer may be dropped once the copy ran
      throw;
    }
    e.load_enqueued = true;
    e.load_waited = false;
    e.loaded_once = true;
    e.spill_queued = false;  // the bytes stay in host memory: backward reads them now
    e.load_started = true;
    mutate(e, EntryState::kLoaded, true);
    e.unpacks_left = e.handles;
    count_reload_locked(e);
    return;
  }
  if (e.device >= 0) {
    mem::cuda::DeviceScope scope(opts_.driver, e.device);  // Note [Caller's context]
    if (e.dst_ready_ev == 0) e.dst_ready_ev = take_event_locked(e.device);
    if (e.load_done_ev == 0) e.load_done_ev = take_event_locked(e.device);
    opts_.driver->event_record(e.dst_ready_ev, stream);
  }
  mutate(e, EntryState::kLoading, true);
  e.unpacks_left = e.handles;
  load_q_.push_back(id);
  work_cv_.notify_one();
}

void TensorCache::wait(EntryId id, mem::cuda::Stream stream) {
  Lock lock(mu_);
  Entry& e = find(id, "wait");
  if (e.state == EntryState::kLoading) {
    auto t0 = std::chrono::steady_clock::now();
    done_cv_.wait(lock, [&] {
      auto it = entries_.find(id);
      return closed_ || it == entries_.end() || it->second->state != EntryState::kLoading;
    });
    add_stall(seconds_since(t0));
  }
  Entry& f = find(id, "wait");
  if (f.load_error) {
    auto err = f.load_error;
    f.load_error = nullptr;
    std::rethrow_exception(err);
  }
  EBB_CHECK_STATE(f.state == EntryState::kLoaded, "tensor cache: wait on entry ", id, " in state ",
                  to_string(f.state), " (no load started)");
  if (f.device >= 0 && f.load_done_ev != 0) {
    refuse_in_capture_locked(f, stream);
    mem::cuda::DeviceScope scope(opts_.driver, f.device);  // Note [Caller's context]
    opts_.driver->stream_wait_event(stream, f.load_done_ev);
    f.load_waited = true;  // on `stream`; the glue records it on the buffer when it is another
  }
}

// Note [Consumed entries]
// A consumed entry goes back to kStored but lives on until its handles die,
// which may be after later unpacks in the same backward (a node unpacks all
// its saved tensors before running, and dedup'd views die with their nodes).
// Prefetching it again in that backward would reload bytes no one reads, so
// prefetches of the consuming graph task skip it; a later backward of a
// retained graph runs in a new task and prefetches it again.
bool TensorCache::consume(EntryId id, int64_t task) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  Entry& e = find(id, "consume");
  if (e.state != EntryState::kLoaded) return false;
  consume_locked(e, task);
  return e.state == EntryState::kStored;
}

void TensorCache::consume_locked(Entry& e, int64_t task) {
  if (--e.unpacks_left > 0) return;
  e.consumed_task = task;
  mutate(e, EntryState::kStored, true);
  e.dst = nullptr;
  drop_buf_locked(e);
  if (e.stream_ordered && e.has_loc) free_blob_locked(e);  // a bounce blob: the SSD still has the bytes
}

// Note [Host copies on the caller]: the reload of a stored host entry into a
// pool buffer (then kLoaded), or into the glue's buffer `into` (the entry
// stays kStored), on this thread, the lock released during the copy (`busy`
// makes a release wait for it). Rethrows a failed load; the entry stays stored.
void TensorCache::load_host_locked(Lock& lock, Entry& e, void* into, bool count) {
  const bool own = into == nullptr;
  if (own) {
    host_buffer_locked(e);
    mutate(e, EntryState::kLoading, true);
    e.unpacks_left = e.handles;
    e.load_started = true;
    e.load_error = nullptr;
  }
  e.busy = true;
  e.caller_busy = true;
  const Location loc = e.loc;
  const mem::Buffer dst{own ? e.dst : into, e.nbytes};
  busy_ += 1;
  lock.unlock();
  const auto t0 = std::chrono::steady_clock::now();
  std::exception_ptr err;
  try {
    store_->get(loc, dst);
  } catch (...) {
    err = std::current_exception();
  }
  lock.lock();
  busy_ -= 1;
  e.busy = false;
  e.caller_busy = false;
  add_stall(seconds_since(t0));
  done_cv_.notify_all();
  if (err) {
    step_c_.load_failures += 1;
    if (own) {
      e.dst = nullptr;
      bury_locked(e.buf);
      mutate(e, EntryState::kStored, true);
    }
    std::rethrow_exception(err);
  }
  if (own) mutate(e, EntryState::kLoaded, true);
  if (count) count_reload_locked(e);
}

Unpacked TensorCache::unpack(EntryId id, mem::cuda::Stream stream, int64_t task, bool have_original,
                              void* into) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  EBB_CHECK_STATE(!closed_, "tensor cache: unpack from a closed cache (entry ", id, ")");
  Unpacked out;
  out.done = take_completions_locked();
  Entry* e = &find(id, "unpack");
  out.nbytes = e->nbytes;
  if (e->live) {
    // Kept, forwarded, failed, a store not yet done (forwarded now), a copy
    // not yet released, or a torn snapshot: the live tensor answers.
    if (in_flight(e->state)) {
      mutate(*e, EntryState::kForwarded, true);
      step_c_.tensors_forwarded += 1;
      if (auto m = microbatches_.find(e->microbatch); m != microbatches_.end()) cancel_late_stores_locked(m->second);
    } else if (e->state == EntryState::kStored) {
      count_reuse_locked(*e);  // offloaded, but no reload needed
    }
    out.kind = Unpacked::Kind::kLive;
    out.obj = e->live;
    return out;
  }
  if (have_original && (e->state == EntryState::kStored || e->state == EntryState::kLoaded)) {
    // A loaded entry's bytes were counted as reloaded: this handle only
    // consumes it (every offloaded byte counts once, reloaded or reused).
    if (e->state == EntryState::kLoaded) consume_locked(*e, task);
    else count_reuse_locked(*e);
    out.kind = Unpacked::Kind::kLive;
    return out;
  }
  if (e->state == EntryState::kStored) {
    EBB_CHECK_STATE(e->has_loc || e->blob != nullptr, "tensor cache: entry ", id, " has neither bytes nor tensor");
    if (e->device >= 0) {
      out.kind = Unpacked::Kind::kNeedBuffer;
      return out;
    }
    if (into != nullptr && e->has_loc && store_->tier_of(e->loc) == kTierCpu) {
      // The handles of one storage are copied one by one: one reload per
      // backward (a retained graph's next backward counts again).
      const bool again = task != -1 && e->consumed_task == task && e->tally_step == step_ && !e->tally_reused;
      load_host_locked(lock, *e, into, !again);
      e->consumed_task = task;
      out.kind = Unpacked::Kind::kBuffer;
      return out;  // no prefetch: host-tier entries are loaded at unpack
    }
    load_host_locked(lock, *e, nullptr, true);
  } else if (e->state == EntryState::kLoading) {
    const auto t0 = std::chrono::steady_clock::now();
    done_cv_.wait(lock, [&] {
      auto it = entries_.find(id);
      return closed_ || it == entries_.end() || it->second->state != EntryState::kLoading;
    });
    add_stall(seconds_since(t0));
    e = &find(id, "unpack");
    if (e->load_error) {
      auto err = e->load_error;
      e->load_error = nullptr;
      drop_buf_locked(*e);
      std::rethrow_exception(err);
    }
  }
  EBB_CHECK_STATE(e->state == EntryState::kLoaded, "tensor cache: unpack of entry ", id, " in state ",
                  to_string(e->state), " without its tensor");
  if (e->device >= 0 && e->load_done_ev != 0) {
    refuse_in_capture_locked(*e, stream);
    mem::cuda::DeviceScope scope(opts_.driver, e->device);  // Note [Caller's context]
    opts_.driver->stream_wait_event(stream, e->load_done_ev);
    e->load_waited = true;  // on `stream`; the glue records it on the buffer when it is another
  }
  out.kind = Unpacked::Kind::kBuffer;
  out.obj = e->buf;
  out.host_buffer = e->buf_host;
  out.data = e->dst;
  out.buffer_stream = e->buf_stream;
  consume_locked(*e, task);
  if (auto m = microbatches_.find(e->microbatch); m != microbatches_.end() && e->order_pos != SIZE_MAX) {
    out.prefetch = prefetch_locked(m->second, e->order_pos, task);
  }
  return out;
}

// Note [Originals still alive]
// A saved tensor may outlive forward outside autograd: the model's input, a
// tensor the user keeps. Its storage then never left memory, so the glue
// answers its unpack from it and does not prefetch it; the counters record it
// so that bytes_reloaded + bytes_reused accounts for every offloaded byte.
bool TensorCache::reuse(EntryId id) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  Entry& e = find(id, "reuse");
  if (e.state == EntryState::kLoaded) {  // prefetched, then not needed: its bytes count as reloaded
    consume_locked(e, -1);
    return false;
  }
  return count_reuse_locked(e);
}

// Every offloaded byte counts once a step: reloaded, or reused when no reload
// was needed. An entry with several handles can be both (one handle's tensor
// alive, another's not): the reload wins.
bool TensorCache::count_reuse_locked(Entry& e) {
  if (e.reused_step == step_) return false;
  e.reused_step = step_;
  if (e.tally_step == step_) return false;
  e.tally_step = step_;
  e.tally_reused = true;
  step_c_.tensors_reused += 1;
  step_c_.bytes_reused += e.nbytes;
  return true;
}

void TensorCache::count_reload_locked(Entry& e) {
  step_c_.bytes_reloaded += e.nbytes;
  step_c_.tensors_reloaded += 1;
  if (e.tally_step == step_ && e.tally_reused) {
    step_c_.tensors_reused -= 1;
    step_c_.bytes_reused -= e.nbytes;
  }
  e.tally_step = step_;
  e.tally_reused = false;
}

// Note [Late stores]
// Once backward of a micro-batch has begun (a block's backward hook, the
// "backward" phase hint, or an unpack that meets an unfinished store), its
// stores that have not started are cancelled: the entries stay resident and
// are answered from the live tensor (counted as forwarded). The forward's
// peak, which held them, has passed; storing them now would only spend the
// link on bytes that this same backward reads back, while its loads wait for
// the link. Stores already running finish (Note [Abandoned work] for what
// they wrote). Seen on an H100: stores lagged the forward so far that the
// workers went on storing the first blocks through backward and then reloaded
// them. A later forward of the micro-batch re-arms the mark.
void TensorCache::cancel_late_stores_locked(MicroBatch& mb) {
  if (mb.backward_began) return;
  mb.backward_began = true;
  for (EntryId id : mb.order) {
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second->state != EntryState::kQueued) continue;
    mutate(*it->second, EntryState::kForwarded, true);
    step_c_.tensors_forwarded += 1;
  }
}

void TensorCache::note_kept(int microbatch, uint64_t nbytes) {
  Lock lock(mu_);
  push_order_locked(microbatches_[microbatch], nullptr, nbytes, false);  // a place in the order, no entry
}

void TensorCache::scope_end(int microbatch, int64_t scope) {
  Lock lock(mu_);
  auto& mb = microbatches_[microbatch];
  mb.scope_end[scope] = mb.order.size();
}

std::vector<Candidate> TensorCache::prefetch_locked(MicroBatch& mb, size_t end, int64_t task) {
  // Note [Prefetch distance]: the window bounds two things. The bytes loading
  // or loaded ahead of use (window_), and how far ahead of the point backward
  // has reached a load may start: the bytes of every entry in between count,
  // resident ones (kept, forwarded) included. Without the second bound, when stores lag
  // compute (a fast GPU: most entries forwarded) the walk skipped the resident
  // entries and reloaded the few stored early blocks at the start of backward,
  // on top of everything still resident: a peak above no offload.
  // Only loadable positions are visited; the bytes between come from the
  // running sums (Note [Host copies on the caller]: the small host entries
  // count towards the distance but are loaded at unpack).
  std::vector<Candidate> out;
  uint64_t window = window_;
  const uint64_t limit = opts_.prefetch_window_bytes;
  end = std::min(end, mb.order.size());
  for (auto it = std::lower_bound(mb.loadable.begin(), mb.loadable.end(), end); it != mb.loadable.begin();) {
    const size_t i = *--it;
    const uint64_t distance = mb.cum[end] - mb.cum[i];  // order[i, end)
    if (distance > limit && mb.cum[end] - mb.cum[i + 1] > 0) break;
    auto eit = entries_.find(mb.order[i]);
    if (eit == entries_.end()) continue;
    const Entry& e = *eit->second;
    if (task != -1 && e.consumed_task == task) continue;
    if (e.state != EntryState::kStored || !e.acked || e.live || (!e.has_loc && e.blob == nullptr)) continue;
    if (e.reused_step == step_) continue;  // answered from its original (Note [Originals still alive])
    if (e.device < 0 && e.has_loc && e.nbytes <= opts_.inline_copy_bytes && store_->tier_of(e.loc) == kTierCpu)
      continue;  // reloaded at unpack (Note [Host copies on the caller])
    if (window + e.nbytes > limit) break;
    window += e.nbytes;
    out.push_back(Candidate{e.id, e.nbytes, e.orig});
  }
  return out;
}

std::vector<Candidate> TensorCache::prefetch_scope(int microbatch, int64_t scope, int64_t task) {
  Lock lock(mu_);
  auto m = microbatches_.find(microbatch);
  if (m == microbatches_.end()) return {};
  cancel_late_stores_locked(m->second);
  auto s = m->second.scope_end.find(scope);
  size_t end = s == m->second.scope_end.end() ? m->second.order.size() : s->second;
  return prefetch_locked(m->second, end, task);
}

std::vector<Candidate> TensorCache::prefetch_before(EntryId id, int64_t task) {
  Lock lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return {};
  auto m = microbatches_.find(it->second->microbatch);
  if (m == microbatches_.end()) return {};
  if (it->second->order_pos == SIZE_MAX) return {};
  return prefetch_locked(m->second, it->second->order_pos, task);
}

void TensorCache::begin_step() {
  Lock lock(mu_);
  EBB_CHECK_STATE(!closed_, "tensor cache: step on a closed cache");
  step_ += 1;
  step_c_ = Counters{};
  std::erase_if(microbatches_, [](const auto& kv) { return kv.second.live == 0; });
  step_c_.peak_resident_bytes = resident_;
  stop_offload_ = false;
  // No sweep of fenced frees here: a step may begin inside a graph capture,
  // where the query is illegal (Note [Graph capture]); saves sweep them.
}

void TensorCache::end_step() {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  // The step's counters close once its abandoned work ended (Note [Abandoned
  // work]): what its stores wrote is then all counted, offloaded or
  // discarded. Backward has ended; this is one wait at the step's end, for
  // host I/O of entries released mid-write, instead of one per release. It
  // never waits for a GPU: a spill starts only once its copy ran (Note
  // [Spill readiness]) and a reload's device copy is only enqueued; a device
  // store on the worker path (pageable blobs) waits behind the compute
  // stream, so it is not waited for here (its bytes count in the next step).
  const auto t0 = std::chrono::steady_clock::now();
  wait_abandoned_locked(lock, [&](const Entry& e) { return e.step == step_ && !(e.device >= 0 && !e.stream_ordered); });
  add_stall(seconds_since(t0));
  fold(total_c_, step_c_);
  steps_ += 1;
}

std::vector<EntryId> TensorCache::release_step(uint64_t step) {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  std::vector<EntryId> ids;
  for (const auto& [id, e] : entries_) {
    if (step == 0 || e->step == step) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  for (EntryId id : ids) erase_locked(lock, id);
  // An aborted step leaves nothing behind when this returns: its abandoned
  // work (Note [Abandoned work]), this call's or its handles' before it, is
  // waited for here, off the hot path.
  wait_abandoned_locked(lock, [&](const Entry& e) { return step == 0 || e.step == step; });
  done_cv_.notify_all();
  return ids;
}

uint64_t TensorCache::current_step() const {
  Lock lock(mu_);
  return step_;
}

void TensorCache::drain() {
  std::vector<GlueObj> dead;
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  auto t0 = std::chrono::steady_clock::now();
  for (auto& [device, lane] : lanes_) {  // first: spills wait for these copies (Note [Spill readiness])
    mem::cuda::DeviceScope scope(opts_.driver, device);
    opts_.driver->stream_synchronize(lane.copy);
  }
  done_cv_.wait(lock, [&] {
    return closed_ || ((store_q_.empty() || stores_paused_) && load_q_.empty() && busy_ == 0);
  });
  if (!closed_) {
    for (auto& [device, lane] : lanes_) {  // the stream-ordered copies too
      mem::cuda::DeviceScope scope(opts_.driver, device);
      opts_.driver->stream_synchronize(lane.copy);
      opts_.driver->stream_synchronize(lane.load);
      // Every copy is done: release them all, no wait is enqueued.
      if (!lane.pending.empty()) release_through_locked(lane, lane.pending.back().through, nullptr);
    }
    if (!fenced_.empty()) sweep_fenced_locked(false);
  }
  add_stall(seconds_since(t0));
}

void TensorCache::set_prefetch_window(uint64_t bytes) {
  Lock lock(mu_);
  opts_.prefetch_window_bytes = bytes;
}

void TensorCache::set_max_inflight(uint64_t bytes) {
  {
    Lock lock(mu_);
    opts_.max_inflight_bytes = bytes;
  }
  done_cv_.notify_all();
}

void TensorCache::set_write_limit(int tier, double bytes_per_second) {
  EBB_CHECK_STATE(!closed(), "tensor cache: set_write_limit on a closed cache");
  store_->set_write_limit(tier, bytes_per_second);
}

std::pair<double, double> TensorCache::probe(int tier, uint64_t nbytes) {
  EBB_CHECK(nbytes > 0 && nbytes <= (1ull << 30), "tensor cache: probe size ", nbytes, " out of range 1..1 GiB");
  EBB_CHECK_STATE(!closed(), "tensor cache: probe on a closed cache");
  constexpr size_t kAlign = 4096;
  const size_t alloc = (nbytes + kAlign - 1) / kAlign * kAlign;
  auto free_fn = [](void* p) { std::free(p); };
  std::unique_ptr<void, decltype(free_fn)> buf(std::aligned_alloc(kAlign, alloc), free_fn);
  EBB_CHECK_STATE(buf != nullptr, "tensor cache: cannot allocate a ", nbytes, "-byte probe buffer");
  std::memset(buf.get(), 0x5a, alloc);
  const mem::Buffer span{buf.get(), nbytes};
  auto t0 = std::chrono::steady_clock::now();
  const Location loc = store_->put(span, tier);
  const double write_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  try {
    store_->get(loc, span);
  } catch (...) {
    store_->free(loc);
    throw;
  }
  const double read_s = seconds_since(t0);
  store_->free(loc);
  return {write_s, read_s};
}

void TensorCache::set_inline_copy_bytes(uint64_t bytes) {
  Lock lock(mu_);
  opts_.inline_copy_bytes = bytes;
}

void TensorCache::pause_stores(bool paused) {
  Lock lock(mu_);
  stores_paused_ = paused;
  work_cv_.notify_all();
}

void TensorCache::close() {
  std::vector<GlueObj> dead;  // Note [Glue objects]: destroyed after the lock
  {
    Lock lock(mu_);
    if (closed_ && workers_.empty()) return;
    closed_ = true;
    store_q_.clear();
    load_q_.clear();
  }
  work_cv_.notify_all();
  done_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
  Lock lock(mu_);
  std::vector<EntryId> ids;
  for (const auto& [id, e] : entries_) ids.push_back(id);
  for (EntryId id : ids) erase_locked(lock, id);
  microbatches_.clear();
  handles_.clear();
  for (auto& c : completions_) bury_locked(c.live);
  completions_.clear();
  dead.swap(graveyard_);
  bool idle = true;  // every copy the cache enqueued has run
  if (opts_.driver != nullptr) {
    for (auto& [device, lane] : lanes_) {
      try {
        mem::cuda::DeviceScope scope(opts_.driver, device);
        opts_.driver->stream_synchronize(lane.copy);
        opts_.driver->stream_synchronize(lane.load);
      } catch (const std::exception& ex) {
        idle = false;
        log::error("tensor cache: synchronizing the copy streams of device ", device, ": ", ex.what());
      }
      for (auto& c : lane.pending) give_event_locked(device, c.ev);
      lane.pending.clear();
    }
  }
  if (!idle) {
    // Note [Close without a sync]: inside a graph capture, or with a broken
    // device, copies may still run: nothing they may touch is freed. The
    // stores (their pinned blobs) and the held glue objects are leaked on
    // purpose, for the life of the process.
    log::error("tensor cache: closed while its copies could not be waited for; their host memory is kept "
               "for the life of the process");
    static auto* leaked = new std::vector<std::unique_ptr<Store>>();
    static auto* leaked_glue = new std::vector<GlueObj>();
    if (staging_) leaked->push_back(std::move(staging_));
    for (auto& d : deferred_) leaked_glue->push_back(std::move(d.obj));
    deferred_.clear();
    fenced_.clear();
    lanes_.clear();
    free_events_.clear();
    closed_store_stats_ = store_ ? store_->stats() : StoreStats{};
    closed_describe_ = store_ ? store_->describe() : std::string();
    if (store_) leaked->push_back(std::move(store_));
    return;
  }
  if (opts_.driver != nullptr) {
    sweep_fenced_locked(true);
    flush_deferred_locked(true);  // the copies they waited for are done
    for (auto& g : graveyard_) dead.push_back(std::move(g));
    graveyard_.clear();
    for (auto& [device, lane] : lanes_) {
      try {
        mem::cuda::DeviceScope scope(opts_.driver, device);
        opts_.driver->stream_destroy(lane.copy);
        opts_.driver->stream_destroy(lane.load);
      } catch (const std::exception&) {
      }
    }
    lanes_.clear();
    staging_.reset();
    for (auto& [device, pool] : free_events_) {
      try {
        mem::cuda::DeviceScope scope(opts_.driver, device);
        for (auto ev : pool) opts_.driver->event_destroy(ev);
      } catch (const std::exception&) {
      }
    }
  }
  free_events_.clear();
  // Note [Close releases]
  // The store's files, disk space and threads go now, not when the last
  // reference to the cache does (a Python handle kept by a traceback, a
  // garbage collection not yet run): a second cache on the same filesystem
  // must find the space free. stats() and describe() keep their last values.
  if (store_) {
    closed_store_stats_ = store_->stats();
    closed_describe_ = store_->describe();
    auto store = std::move(store_);
    lock.unlock();
    if (opts_.return_store) {
      try {
        opts_.return_store(std::move(store));
      } catch (const std::exception& ex) {
        log::error("tensor cache: returning the store to its pool: ", ex.what());
      }
    }
    store.reset();
  }
}

bool TensorCache::closed() const {
  Lock lock(mu_);
  return closed_;
}

EntryState TensorCache::state(EntryId id) const {
  Lock lock(mu_);
  auto it = entries_.find(id);
  EBB_CHECK_STATE(it != entries_.end(), "tensor cache: entry ", id, " is not live");
  return it->second->state;
}

bool TensorCache::contains(EntryId id) const {
  Lock lock(mu_);
  return entries_.count(id) != 0;
}

CacheStats TensorCache::stats() const {
  Lock lock(mu_);
  CacheStats s;
  s.step = step_c_;
  s.total = total_c_;
  fold(s.total, Counters{});
  s.steps = steps_;
  s.resident_bytes = resident_;
  s.window_bytes = window_;
  s.inflight_bytes = inflight_;
  s.entries = entries_.size();
  s.queued_stores = store_q_.size();
  s.queued_loads = load_q_.size();
  s.store = store_ ? store_->stats() : closed_store_stats_;
  return s;
}

std::string TensorCache::describe() const {
  return detail::concat("tensor cache on ", store_ ? store_->describe() : closed_describe_ + " (closed)", ", ",
                        opts_.workers, " workers, prefetch window ",
                        config::format_bytes(double(opts_.prefetch_window_bytes)));
}

// Note [Spill readiness]
// A spill (Note [SSD below the link]) can start only once its device-to-host
// copy has run, and on a GPU that copy waits behind the compute stream, which
// the CPU runs far ahead of. A worker that waited for it in
// cuEventSynchronize would sit there (spinning, unless the event blocks)
// while loads, which backward waits for, queue behind it. So a worker takes
// a spill only once a query finds its copy done, takes any other queued work
// first, and when only unready spills are left it looks again after
// kSpillPoll (or when new work arrives). Worker threads relax their graph
// capture mode (Note [Graph capture]): their queries and copies never touch a
// captured stream, and a capture on the training thread must not fail them.
namespace {
constexpr auto kSpillPoll = std::chrono::microseconds(250);
}  // namespace

bool TensorCache::spill_ready_locked(const Entry& e) {
  try {
    opts_.driver->bind_device(e.device);
    return opts_.driver->event_query(e.copy_ev);
  } catch (const std::exception& ex) {
    log::error("tensor cache: querying the copy of entry ", e.id, " before its spill: ", ex.what());
    return true;  // run_spill reports the failure
  }
}

void TensorCache::worker_main(unsigned index) {
  std::map<int, mem::cuda::Stream> side;  // per device, this worker's copy stream
  if (opts_.driver != nullptr) {
    try {
      opts_.driver->relax_capture_mode();
    } catch (const std::exception& ex) {
      log::warn_once("cache.relax_capture", detail::concat("tensor cache: worker ", index,
                                                           " cannot relax its CUDA graph capture mode: ", ex.what()));
    }
  }
  Lock lock(mu_);
  for (;;) {
    if (closed_) break;
    EntryId id = 0;
    bool load = !load_q_.empty();
    if (load) {
      id = load_q_.front();
      load_q_.pop_front();
    } else if (!store_q_.empty() && !stores_paused_) {
      // Copies of one device complete in the order they were enqueued (one
      // copy stream, spills queued in that order): one query per device.
      auto pick = store_q_.end();
      std::vector<int> unready;
      for (auto it = store_q_.begin(); it != store_q_.end(); ++it) {
        auto e = entries_.find(*it);
        if (e == entries_.end() || !e->second->spill_queued) {
          pick = it;
          break;
        }
        const int dev = e->second->device;
        if (std::find(unready.begin(), unready.end(), dev) != unready.end()) continue;
        if (spill_ready_locked(*e->second)) {
          pick = it;
          break;
        }
        unready.push_back(dev);
      }
      if (pick == store_q_.end()) {  // only spills whose copies have not run
        work_cv_.wait_for(lock, kSpillPoll);
        continue;
      }
      id = *pick;
      store_q_.erase(pick);
    } else {
      work_cv_.wait(lock);
      continue;
    }
    busy_ += 1;
    if (load) run_load(lock, id, side);
    else run_store(lock, id, side);
    busy_ -= 1;
    done_cv_.notify_all();
  }
  lock.unlock();
  if (opts_.driver != nullptr) {
    for (auto& [dev, s] : side) {
      try {
        opts_.driver->bind_device(dev);
        opts_.driver->stream_destroy(s);
      } catch (const std::exception&) {
      }
    }
  }
}

namespace {
mem::cuda::Stream side_stream(mem::cuda::Driver* drv, std::map<int, mem::cuda::Stream>& side, int device) {
  drv->bind_device(device);
  auto it = side.find(device);
  if (it != side.end()) return it->second;
  auto s = drv->stream_create();
  side.emplace(device, s);
  return s;
}
}  // namespace

void TensorCache::run_store(Lock& lock, EntryId id, std::map<int, mem::cuda::Stream>& side) {
  auto it = entries_.find(id);
  if (it != entries_.end() && it->second->stream_ordered) {
    if (it->second->spill_queued) run_spill(lock, *it->second);
    return;
  }
  if (it == entries_.end() || it->second->state != EntryState::kQueued) return;  // cancelled
  Entry& e = *it->second;
  mutate(e, EntryState::kStoring, true);
  e.busy = true;
  mem::Buffer src{e.src, e.nbytes, e.device};
  mem::cuda::Event ready = e.ready_ev;
  lock.unlock();
  Location loc = 0;
  std::exception_ptr err;
  try {
    if (src.on_device()) {
      src.stream = side_stream(opts_.driver, side, src.device);
      opts_.driver->stream_wait_event(src.stream, ready);
    }
    loc = store_->put(src, e.tier);
  } catch (...) {
    err = std::current_exception();
  }
  lock.lock();
  e.busy = false;  // erased only when not busy, or kept in abandoned_: `e` is still valid
  give_event_locked(e.device, e.ready_ev);
  if (!err && (e.abandoned || e.state != EntryState::kStoring)) {
    // Forwarded or released while the copy ran: the bytes are not needed.
    step_c_.bytes_discarded += e.nbytes;
    try {
      store_->free(loc);
    } catch (const std::exception& ex) {
      log::error("tensor cache: freeing abandoned store of entry ", id, ": ", ex.what());
    }
  }
  if (e.abandoned) {  // Note [Abandoned work]
    finish_abandoned_locked(e);
    return;
  }
  if (err) {
    step_c_.store_failures += 1;
    log::warn_once("cache.store_failed." + std::to_string(reinterpret_cast<uintptr_t>(this)),
                   detail::concat("ebbtide: storing an activation failed (", what_of(err),
                                  "); keeping this step's remaining activations in memory"));
    stop_offload_ = true;
    if (e.state == EntryState::kStoring) {
      mutate(e, EntryState::kFailed, true);
      step_c_.tensors_kept += 1;
    }
    completions_.push_back({id, false});  // also when forwarded meanwhile: the glue warns
    return;
  }
  if (e.state == EntryState::kStoring) {
    e.loc = loc;
    e.has_loc = true;
    mutate(e, EntryState::kStored, false);
    step_c_.bytes_offloaded += e.nbytes;
    step_c_.tensors_offloaded += 1;
    completions_.push_back({id, true});
  }
}

void TensorCache::run_load(Lock& lock, EntryId id, std::map<int, mem::cuda::Stream>& side) {
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second->state != EntryState::kLoading || it->second->load_started) return;
  Entry& e = *it->second;
  if (e.stream_ordered) {
    run_device_load(lock, e);
    return;
  }
  e.busy = true;
  e.load_started = true;
  mem::Buffer dst{e.dst, e.nbytes, e.device};
  Location loc = e.loc;
  mem::cuda::Event ready = e.dst_ready_ev;
  mem::cuda::Event done = e.load_done_ev;  // made by start_load (Note [Caller's context])
  lock.unlock();
  std::exception_ptr err;
  try {
    if (dst.on_device()) {
      dst.stream = side_stream(opts_.driver, side, dst.device);
      opts_.driver->stream_wait_event(dst.stream, ready);
    }
    store_->get(loc, dst);
    if (dst.on_device()) opts_.driver->event_record(done, dst.stream);
  } catch (...) {
    err = std::current_exception();
  }
  lock.lock();
  e.busy = false;
  if (e.abandoned) {  // Note [Abandoned work]; a device copy was synchronous in get()
    finish_abandoned_locked(e);
    return;
  }
  if (err) {
    step_c_.load_failures += 1;
    e.load_error = err;
    e.dst = nullptr;
    mutate(e, EntryState::kStored, true);
    return;
  }
  mutate(e, EntryState::kLoaded, true);
  count_reload_locked(e);
}

// Note [SSD below the link]: the worker writes the bounce blob to the SSD once
// its copy ran (Note [Spill readiness]). A release meanwhile abandons the
// entry (Note [Abandoned work]): the blob is freed after the write. A failed
// write leaves the bytes in host memory.
void TensorCache::run_spill(Lock& lock, Entry& e) {
  e.spill_queued = false;
  e.spilling = true;
  e.busy = true;
  void* blob = e.blob;
  const uint64_t n = e.nbytes;
  const int dev = e.device;
  const mem::cuda::Event copy = e.copy_ev;
  lock.unlock();
  Location loc = 0;
  std::exception_ptr err;
  try {
    opts_.driver->bind_device(dev);
    // Found complete by a query (Note [Spill readiness]): no wait; it orders the read after the copy.
    opts_.driver->event_synchronize(copy);
    loc = store_->put(mem::Buffer{blob, n}, kTierSsd);
  } catch (...) {
    err = std::current_exception();
  }
  lock.lock();
  e.busy = false;
  e.spilling = false;
  if (e.abandoned) {
    if (!err) {
      step_c_.bytes_discarded += n;
      e.loc = loc;
      e.has_loc = true;
    }
    finish_abandoned_locked(e);
    return;
  }
  if (err) {
    step_c_.store_failures += 1;
    log::warn_once("cache.spill_failed." + std::to_string(reinterpret_cast<uintptr_t>(this)),
                   detail::concat("ebbtide: writing an offloaded activation to the SSD failed (", what_of(err),
                                  "); it stays in host memory"));
    return;
  }
  e.loc = loc;
  e.has_loc = true;
  if (e.state == EntryState::kStored) free_blob_locked(e);
}

// Note [SSD below the link]: SSD -> bounce blob on this worker, then the
// host-to-device copy on the load stream after the buffer's allocation.
void TensorCache::run_device_load(Lock& lock, Entry& e) {
  e.busy = true;
  e.load_started = true;
  const Location loc = e.loc;
  const uint64_t n = e.nbytes;
  const int dev = e.device;
  void* dst = e.dst;
  const mem::cuda::Event ready = e.dst_ready_ev;
  const mem::cuda::Event done = e.load_done_ev;
  const mem::cuda::Stream load = lanes_.at(dev).load;
  Store& st = staging_locked();
  lock.unlock();
  HostSpace space;
  bool have = false;
  bool enqueued = false;
  std::exception_ptr err;
  try {
    opts_.driver->bind_device(dev);  // before pinning: Note [Caller's context]
    space = st.reserve_host(n);
    have = true;
    store_->get(loc, mem::Buffer{space.ptr, n});
    opts_.driver->stream_wait_event(load, ready);
    opts_.driver->memcpy_htod_async(reinterpret_cast<mem::cuda::DevicePtr>(dst), space.ptr, n, load);
    enqueued = true;
    opts_.driver->event_record(done, load);
  } catch (...) {
    err = std::current_exception();
    if (enqueued) {  // the copy reads the blob and writes the buffer: neither goes before it ran
      try {
        opts_.driver->stream_synchronize(load);
      } catch (const std::exception& ex) {
        log::error("tensor cache: a failed reload's copy could not be waited for (", ex.what(),
                   "); its bounce blob is kept");
        have = false;
      }
    }
  }
  lock.lock();
  e.busy = false;
  if (err) {
    if (have) {
      try {
        st.free(space.loc);
      } catch (const std::exception& ex) {
        log::error("tensor cache: freeing a bounce blob: ", ex.what());
      }
    }
    if (e.abandoned) {
      finish_abandoned_locked(e);
      return;
    }
    step_c_.load_failures += 1;
    e.load_error = err;
    e.dst = nullptr;
    mutate(e, EntryState::kStored, true);
    return;
  }
  e.blob = space.ptr;
  e.blob_store = &st;
  e.blob_loc = space.loc;
  e.loaded_once = true;
  e.load_enqueued = true;
  e.load_waited = false;
  if (e.abandoned) {  // the copy into its buffer may still run: Note [Stream-ordered drops]
    finish_abandoned_locked(e);
    return;
  }
  mutate(e, EntryState::kLoaded, true);
  count_reload_locked(e);
}

std::pair<double, double> TensorCache::measure_link(int device, void* dev_ptr, uint64_t nbytes, int repeats) {
  EBB_CHECK(opts_.driver != nullptr, "tensor cache: measuring the link needs the CUDA driver");
  EBB_CHECK(dev_ptr != nullptr && nbytes > 0 && repeats > 0, "tensor cache: measure_link of ", nbytes,
            " bytes at ", dev_ptr, ", ", repeats, " repeats");
  Lock lock(mu_);
  EBB_CHECK_STATE(!closed_, "tensor cache: measure_link on a closed cache");
  auto* drv = opts_.driver;
  mem::cuda::DeviceScope scope(drv, device);
  Lane& lane = lane_locked(device);
  Store& st = staging_locked();
  HostSpace h = st.reserve_host(nbytes);
  mem::cuda::Event ev[3] = {0, 0, 0};
  auto cleanup = [&] {
    for (auto& x : ev)
      if (x != 0) drv->event_destroy(x);
    st.free(h.loc);
  };
  double d2h = 0, h2d = 0;
  try {
    EBB_CHECK_STATE(h.pinned, "tensor cache: host memory could not be page-locked; the link was not measured");
    for (auto& x : ev) x = drv->event_create_timed();
    const auto dev = reinterpret_cast<mem::cuda::DevicePtr>(dev_ptr);
    for (int i = 0; i < repeats; ++i) {
      drv->event_record(ev[0], lane.copy);
      drv->memcpy_dtoh_async(h.ptr, dev, nbytes, lane.copy);
      drv->event_record(ev[1], lane.copy);
      drv->memcpy_htod_async(dev, h.ptr, nbytes, lane.copy);
      drv->event_record(ev[2], lane.copy);
      drv->event_synchronize(ev[2]);
      const double a = drv->event_elapsed_ms(ev[0], ev[1]) / 1e3;
      const double b = drv->event_elapsed_ms(ev[1], ev[2]) / 1e3;
      if (a > 0) d2h = std::max(d2h, double(nbytes) / a);
      if (b > 0) h2d = std::max(h2d, double(nbytes) / b);
    }
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  return {d2h, h2d};
}

}  // namespace ebbtide::cache
