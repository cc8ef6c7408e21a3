// The entry table and its states, the per-device event pools, steps, close
// and statistics. The rest of TensorCache: tensor_cache_save.cpp,
// tensor_cache_device.cpp, tensor_cache_load.cpp, tensor_cache_workers.cpp
// (tensor_cache_impl.hpp).
#include "tensor_cache_impl.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

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

namespace {

bool is_resident(EntryState s, bool acked) {
  switch (s) {
    case EntryState::kStored: return !acked;
    default: return true;
  }
}
bool in_window(EntryState s) { return s == EntryState::kLoading || s == EntryState::kLoaded; }

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
  total.device_wait_seconds += step.device_wait_seconds;
  total.copy_wait_seconds += step.copy_wait_seconds;
  total.load_wait_seconds += step.load_wait_seconds;
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
  note_peak_locked();
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

void TensorCache::begin_step() {
  Lock lock(mu_);
  EBB_CHECK_STATE(!closed_, "tensor cache: step on a closed cache");
  harvest_waits_locked();  // Note [Device waits]: the last step's, before its counters go
  step_ += 1;
  step_folded_ = false;
  step_c_ = Counters{};
  std::erase_if(microbatches_, [](const auto& kv) { return kv.second.live == 0; });
  step_c_.peak_resident_bytes = resident_ + kept_resident();
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
  harvest_waits_locked();  // Note [Device waits]: those done by now; later ones go to the totals
  fold(total_c_, step_c_);
  step_folded_ = true;
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
  CallerMode mode(opts_.driver, made_in_this_process());  // Note [Queries during a capture]
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
      opts_.driver->stream_synchronize(lane.load_hi);
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
        opts_.driver->stream_synchronize(lane.load_hi);
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
    drop_timings_locked();
    free_timed_.clear();  // their events are leaked with the rest
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
        opts_.driver->stream_destroy(lane.load_hi);
      } catch (const std::exception&) {
      }
    }
    lanes_.clear();
    staging_.reset();
    drop_timings_locked();  // the device is idle: every timing completed, none is read any more
    for (auto* pools : {&free_events_, &free_timed_}) {
      for (auto& [device, pool] : *pools) {
        try {
          mem::cuda::DeviceScope scope(opts_.driver, device);
          for (auto ev : pool) opts_.driver->event_destroy(ev);
        } catch (const std::exception&) {
        }
      }
    }
  }
  free_events_.clear();
  free_timed_.clear();
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
  // Logically const: it adds the device waits measured since (Note [Device waits]).
  if (!closed_) const_cast<TensorCache*>(this)->harvest_waits_locked();
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

}  // namespace ebbtide::cache
