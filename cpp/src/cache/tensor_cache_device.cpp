// The stream-ordered device path: copies on the per-device copy and load
// streams, release points, the copy bound, fenced frees, stream-ordered
// drops and CUDA graph capture.
#include "tensor_cache_impl.hpp"

#include <algorithm>
#include <map>
#include <optional>

#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::cache {

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

// Note [Copy bound]
// When the link is slower than the forward produces activations, copies fall
// behind and the tensors they read are held: the peak would grow with the
// backlog. So after each enqueue, when more than device_inflight_bytes of
// copies are still held ahead of the compute stream, the compute stream waits
// (on the device) for the oldest copy whose completion brings the backlog
// under the bound, and releases up to it. The activation peak is then bounded
// by construction: the activations kept plus device_inflight_bytes. The
// planner chooses what to offload so that this wait rarely happens.

// Note [Release by bytes]
// A release point names a scope, and, from a plan, the offloaded bytes whose
// copies the planner predicts done by then: the micro-batch's offloaded
// entries are counted in forward order from its first (released ones
// included, so a count is a fixed position in the copy order whatever was
// released before), and a point releases those saved up to the end of its
// scope whose count, their own bytes included, is within its bytes. Released
// by whole scopes, a block whose copies are half done at the point held all
// of them until the next one; by bytes, the glue releases the same prefix of
// the copy order the planner timed. An entry moved by a later saver (Note
// [Shared entries]) keeps the count of its first place, where its copy was
// enqueued.

// Note [Release points on several devices]
// A micro-batch's entries may sit on several devices (a C++ caller that
// splits a model over GPUs; the Python glue offloads one device's tensors).
// Each device has its own lane of copies, and a release point's compute
// stream belongs to one device: an event of one device can be neither
// recorded on nor waited for by a stream of another in that device's context.
// So that device's lane makes the compute stream wait (timed, Note [Device
// waits]) and every other lane orders its copies before the streams its
// tensors were made on only, which is all a stream-ordered free needs (Note
// [Stream-ordered drops]); its wait is timed on the stream its oldest held
// copy's tensor was made on, that device's compute stream as a rule (device
// waits are then summed over devices). A caller that does not name the
// compute stream's device is refused, before anything is released, once the
// cache has worked on two devices: whether it is refused must depend
// neither on a plan's byte counts nor on what earlier points released. While
// the compute stream is captured no lane releases anything (Note [Graph
// capture]).

// Note [Priority loads]
// Each device has two load streams. Prefetches (start_loads) run in the
// order they were issued on the load stream; a load made on demand (an
// unpack whose entry no prefetch reached: start_load), and a prefetch of
// the module whose backward runs (a walk's candidate at or past the start
// of the scope backward has reached: needed now, Entry::urgent), run on a
// second stream created with the device's highest priority. Behind the prefetch
// queue an on-demand load waited for every load queued before it (on the
// H200, 12 ms for a 1 MiB table behind a block's reloads). Loads that go
// through a worker (SSD entries, host entries) keep the same precedence in
// the workers' queue: an unpack's own first, then the running module's in
// the order its walks issued them, which is the order backward needs them
// (each walk starts where backward is and goes down the order), then the
// other prefetches (queue_load_locked: each pushed to the queue's front, a
// walk's would run farthest first); an unpack that finds its entry's load
// still queued moves it to the front and onto the priority stream
// (promote_load_locked). Both streams
// follow the same order: the copy waits for the buffer's allocation and for
// the entry's store copy, and the compute stream waits for its done event.
// One more: a load of an entry waits for the entry's previous load. Its done
// event is recorded again for each load, and a fence may still hold it for
// the previous one: a deferred drop of that load's buffer (Note
// [Stream-ordered drops]), the fenced free of the blob both read. On one
// stream the new recording implied the old; across the two it does so only
// through this wait (without it, a buffer dropped after a capture went back
// to its stream while the first load, still queued on the load stream,
// wrote it).

// Note [Device waits]
// stall_seconds counts the host's waits; on a GPU the cache's cost is the
// compute stream's: a wait for a reload not yet done, or for a copy at a
// release point or the copy bound. Where the cache makes a compute stream
// wait for an event a host query has not seen complete, it records a pair of
// timed events on that stream around the wait; once both completed (queried
// at begin_step, end_step and stats(), never waited for) the time between
// is the device time the stream stood: device_wait_seconds, split into
// copy_wait_seconds and load_wait_seconds, counted in the step that made the
// wait (in the totals only once that step has ended). Nothing is timed or
// queried on a stream being captured (Note [Graph capture]).

TensorCache::Lane& TensorCache::lane_locked(int device) {
  auto it = lanes_.find(device);
  if (it != lanes_.end()) return it->second;
  Lane lane;  // streams of the current context: the caller bound `device`
  lane.device = device;
  auto* drv = opts_.driver;
  lane.copy = drv->stream_create();
  try {
    lane.load = drv->stream_create();
    try {
      lane.load_hi = drv->stream_create_with_priority(drv->stream_priority_range().second);
    } catch (...) {
      drv->stream_destroy(lane.load);
      throw;
    }
  } catch (...) {
    drv->stream_destroy(lane.copy);
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
    // The compute stream's wait is timed (Note [Device waits]).
    for (size_t i = 0; i < streams.size(); ++i) {
      if (i == 0 && compute != nullptr) timed_wait_locked(lane.device, streams[i], last, false);
      else drv->stream_wait_event(streams[i], last);
    }
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

void TensorCache::release_copies(int microbatch, int64_t scope, mem::cuda::Stream compute, uint64_t max_bytes,
                                 int compute_device) {
  std::vector<GlueObj> dead;
  CallerMode mode(opts_.driver, made_in_this_process());  // Note [Queries during a capture]
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  if (!deferred_.empty()) flush_deferred_locked(false);
  // Note [Release points on several devices]
  if (compute_device < 0 && lanes_.size() > 1)
    throw InvalidArgument(detail::concat("release_copies: the cache works on devices ", lanes_.begin()->first,
                                         " and ", std::next(lanes_.begin())->first,
                                         ": name the device of the compute stream (compute_device)"));
  auto m = microbatches_.find(microbatch);
  // Nothing held (e.g. every block's backward after the first released all):
  // no walk over the order.
  const bool held = std::any_of(lanes_.begin(), lanes_.end(), [](const auto& l) { return !l.second.pending.empty(); });
  if (m == microbatches_.end() || !held) return;
  // Note [Graph capture]: nothing is released while the compute stream is captured, on any device.
  if (compute_device >= 0 && capturing_locked(compute_device, compute)) return;
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
    if (e.offloaded_through > max_bytes) continue;  // Note [Release by bytes]
    through[e.device] = std::max(through[e.device], e.copy_through);
  }
  for (auto [device, t] : through) {
    mem::cuda::DeviceScope ds(opts_.driver, device);  // Note [Caller's context]
    Lane& lane = lanes_.at(device);
    if (lane.pending.empty()) continue;  // released, not yet polled
    // Note [Release points on several devices]: another device's lane times
    // its wait on the stream its oldest held copy's tensor was made on.
    mem::cuda::Stream s = compute_device < 0 || compute_device == device ? compute : lane.pending.front().src;
    release_through_locked(lane, t, &s);
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

// Note [Stream-ordered drops], for the reload buffer.
void TensorCache::drop_buf_locked(Entry& e) {
  if (e.buf && !e.buf_host && e.device >= 0 && e.load_enqueued && !e.load_waited && e.load_done_ev != 0)
    fence_drop_locked(e.device, e.buf_stream, e.load_done_ev, e.buf);
  bury_locked(e.buf);
  e.load_enqueued = false;
  e.load_waited = false;
}

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

// Note [Device waits]: `stream` waits for `ev`, which a host query did not
// find complete, between two timed events. Without timed events (a driver
// that lacks them) the wait is untimed.
void TensorCache::timed_wait_locked(int device, mem::cuda::Stream stream, mem::cuda::Event ev, bool load) {
  auto* drv = opts_.driver;
  WaitTiming t{device, stream, 0, 0, step_, load};
  auto& pool = free_timed_[device];
  try {
    for (mem::cuda::Event* x : {&t.begin, &t.end}) {
      if (!pool.empty()) {
        *x = pool.back();
        pool.pop_back();
      } else {
        *x = drv->event_create_timed();
      }
    }
    drv->event_record(t.begin, stream);
  } catch (const std::exception& ex) {
    for (mem::cuda::Event x : {t.begin, t.end})
      if (x != 0) pool.push_back(x);
    log::warn_once("cache.timed_wait", detail::concat("tensor cache: device waits are not timed (", ex.what(),
                                                      "); device_wait_seconds stays 0"));
    drv->stream_wait_event(stream, ev);
    return;
  }
  try {
    drv->stream_wait_event(stream, ev);
    drv->event_record(t.end, stream);
  } catch (...) {
    pool.push_back(t.begin);
    pool.push_back(t.end);
    throw;
  }
  wait_timings_.push_back(t);
}

// Note [Queries during a capture] (tensor_cache_impl.hpp). A driver that
// cannot relax the mode leaves it as it was: the calls are then what they were.
CallerMode::CallerMode(mem::cuda::Driver* driver, bool here) {
  if (driver == nullptr || !here) return;  // a forked child's copy makes no driver call
  try {
    scope_.emplace(driver);
  } catch (const std::exception& ex) {
    log::warn_once("cache.caller_mode", detail::concat("tensor cache: the calling thread's CUDA capture mode could "
                                                       "not be relaxed (", ex.what(), ")"));
  }
}

// Note [Device waits]: adds the timings whose events completed; the rest wait
// for a later call. Never blocks. The events were recorded outside any
// capture, so the queries are legal in the relaxed capture mode, whatever
// this thread or another captures now (stats() may run on a monitoring
// thread while the training thread captures); none is made on a stream
// being captured.
void TensorCache::harvest_waits_locked() {
  // A forked child's copy never reads them: the events are the parent's
  // (Note [Objects across fork]).
  if (wait_timings_.empty() || !made_in_this_process()) return;
  auto* drv = opts_.driver;
  std::optional<mem::cuda::RelaxedCaptureScope> relaxed;
  try {
    relaxed.emplace(drv);
  } catch (const std::exception& ex) {
    log::warn_once("cache.timed_wait_mode", detail::concat("tensor cache: device waits are not read (", ex.what(), ")"));
    return;
  }
  std::vector<WaitTiming> left;
  for (WaitTiming& t : wait_timings_) {
    double seconds = -1;
    try {
      mem::cuda::DeviceScope scope(drv, t.device);  // Note [Caller's context]
      if (drv->stream_is_capturing(t.stream) || !drv->event_query(t.end)) {
        left.push_back(t);
        continue;
      }
      seconds = std::max(0.0, static_cast<double>(drv->event_elapsed_ms(t.begin, t.end)) / 1e3);
    } catch (const std::exception& ex) {
      log::warn_once("cache.timed_wait_read", detail::concat("tensor cache: reading a device wait's time failed (",
                                                             ex.what(), "); that wait is not counted"));
    }
    if (seconds >= 0) {
      auto add = [&](Counters& c) {
        c.device_wait_seconds += seconds;
        (t.load ? c.load_wait_seconds : c.copy_wait_seconds) += seconds;
      };
      if (t.step == step_) add(step_c_);
      if (t.step != step_ || step_folded_) add(total_c_);
    }
    auto& pool = free_timed_[t.device];
    pool.push_back(t.begin);
    pool.push_back(t.end);
  }
  wait_timings_.swap(left);
}

// Timings not yet read go (close): their events back to the pools.
void TensorCache::drop_timings_locked() {
  for (const WaitTiming& t : wait_timings_) {
    free_timed_[t.device].push_back(t.begin);
    free_timed_[t.device].push_back(t.end);
  }
  wait_timings_.clear();
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
