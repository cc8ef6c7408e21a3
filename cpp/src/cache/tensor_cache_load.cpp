// The reload path: request, start_load(s), wait, unpack, consume, reuse, and
// the prefetch schedule over each micro-batch's forward order.
#include "tensor_cache_impl.hpp"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <utility>

#include "ebbtide/mem/buffer_pool.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::cache {

// Note [One call per unpack]
// unpack() does what request(), start_load(), wait() and consume() did in
// turn: a host entry comes back as a pool buffer holding its bytes or as the
// live tensor; a device entry the same, or, when no load was started, a
// request for a buffer (allocated by the glue through torch's allocator,
// then start_load(), then unpack() again). It also returns the prefetch
// candidates behind the entry and the completions since the last call; a
// call that throws leaves those for the next one.

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
  CallerMode mode(opts_.driver, made_in_this_process());  // Note [Queries during a capture]
  Lock lock(mu_);
  EBB_CHECK_STATE(!closed_, "tensor cache: load on a closed cache");
  start_load_locked(find(id, "start_load"), dst, stream, LoadNeed::kNow);
}

void TensorCache::start_load(EntryId id, void* dst, mem::cuda::Stream stream, GlueObj owner) {
  std::vector<GlueObj> dead;
  CallerMode mode(opts_.driver, made_in_this_process());  // Note [Queries during a capture]
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  EBB_CHECK_STATE(!closed_, "tensor cache: load on a closed cache");
  Entry& e = find(id, "start_load");
  EBB_CHECK_STATE(e.state == EntryState::kStored, "tensor cache: start_load of entry ", id, " in state ",
                  to_string(e.state), " (expected stored)");
  refuse_in_capture_locked(e, stream);  // before the entry takes the buffer: a refused load leaves it to the caller
  adopt_buffer_locked(e, std::move(owner), stream);
  start_load_locked(e, dst, stream, LoadNeed::kNow);
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
  CallerMode mode(opts_.driver, made_in_this_process());  // Note [Queries during a capture]
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
    // The running module's loads go to the priority stream (Note [Priority loads]).
    const LoadNeed need = std::exchange(e.urgent, false) ? LoadNeed::kNext : LoadNeed::kPrefetch;
    if (e.device < 0) {
      host_buffer_locked(e);
      start_load_locked(e, e.dst, 0, need);
    } else {
      EBB_CHECK(i < buffers.size() && buffers[i].first != 0, "tensor cache: no buffer for device entry ", e.id);
      if (capturing_locked(e.device, stream)) return;  // Note [Graph capture]: no prefetch inside one
      adopt_buffer_locked(e, buffers[i].second, stream);
      start_load_locked(e, reinterpret_cast<void*>(buffers[i].first), stream, need);
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

// `need`: what the load is for; all but a prefetch run on the priority
// stream and ahead of the prefetches in the workers' queue (Note [Priority loads]).
void TensorCache::start_load_locked(Entry& e, void* dst, mem::cuda::Stream stream, LoadNeed need) {
  const EntryId id = e.id;
  const bool on_demand = need != LoadNeed::kPrefetch;
  EBB_CHECK_STATE(e.state == EntryState::kStored && (e.has_loc || e.blob != nullptr),
                  "tensor cache: start_load of entry ", id, " in state ", to_string(e.state), " (expected stored)");
  EBB_CHECK(dst != nullptr, "tensor cache: start_load of entry ", id, " into a null buffer");
  refuse_in_capture_locked(e, stream);  // before the entry changes: a refused load leaves it as it was
  e.dst = dst;
  e.load_started = false;
  e.load_error = nullptr;
  if (e.stream_ordered && e.blob != nullptr) {
    // Note [Stream-ordered offload]: enqueued here, after the buffer's
    // allocation and the store's copy, with no host wait.
    auto* drv = opts_.driver;
    mem::cuda::DeviceScope scope(drv, e.device);  // Note [Caller's context]
    Lane& lane = lane_locked(e.device);
    const mem::cuda::Stream load = on_demand ? lane.load_hi : lane.load;
    if (e.dst_ready_ev == 0) e.dst_ready_ev = take_event_locked(e.device);
    // After the entry's previous load too (Note [Priority loads]).
    const bool after_previous = e.loaded_once && e.load_done_ev != 0;
    if (e.load_done_ev == 0) e.load_done_ev = take_event_locked(e.device);
    drv->event_record(e.dst_ready_ev, stream);
    drv->stream_wait_event(load, e.dst_ready_ev);
    drv->stream_wait_event(load, e.copy_ev);
    if (after_previous) drv->stream_wait_event(load, e.load_done_ev);
    drv->memcpy_htod_async(reinterpret_cast<mem::cuda::DevicePtr>(dst), e.blob, e.nbytes, load);
    try {
      drv->event_record(e.load_done_ev, load);
    } catch (...) {
      drv->stream_synchronize(load);  // the buffer may be dropped once the copy ran
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
  e.load_on_demand = on_demand;
  queue_load_locked(id, need);
  work_cv_.notify_one();
}

// Note [Priority loads]: the workers' queue. An unpack's load goes first (it
// waits for it now); a prefetch of the running module behind the priority
// loads queued before it, which an earlier walk, or this one at a nearer
// place, issued for what backward needs sooner; both ahead of the other
// prefetches, which run in the order they were issued.
void TensorCache::queue_load_locked(EntryId id, LoadNeed need) {
  if (need == LoadNeed::kNow) {
    load_q_.push_front(id);
    return;
  }
  auto pos = load_q_.end();
  if (need == LoadNeed::kNext) {
    pos = load_q_.begin();
    for (auto it = load_q_.begin(); it != load_q_.end(); ++it) {
      auto q = entries_.find(*it);
      if (q != entries_.end() && q->second->state == EntryState::kLoading && q->second->load_on_demand)
        pos = std::next(it);
    }
  }
  load_q_.insert(pos, id);
}

// Note [Priority loads]: an unpack (or wait) reached an entry whose load
// still waits in the workers' queue, behind loads backward needs later: it is
// needed now, so it moves to the front and takes the priority stream (the
// worker picks the stream when it starts the load).
void TensorCache::promote_load_locked(Entry& e) {
  if (e.state != EntryState::kLoading || e.load_started) return;
  auto it = std::find(load_q_.begin(), load_q_.end(), e.id);
  if (it == load_q_.end()) return;
  load_q_.erase(it);
  e.load_on_demand = true;
  queue_load_locked(e.id, LoadNeed::kNow);
}

void TensorCache::wait(EntryId id, mem::cuda::Stream stream) {
  CallerMode mode(opts_.driver, made_in_this_process());  // Note [Queries during a capture]
  Lock lock(mu_);
  Entry& e = find(id, "wait");
  if (e.state == EntryState::kLoading) {
    promote_load_locked(e);
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
    wait_for_load_locked(f, stream);
  }
}

void TensorCache::wait_for_load_locked(Entry& e, mem::cuda::Stream stream) {
  mem::cuda::DeviceScope scope(opts_.driver, e.device);  // Note [Caller's context]
  if (opts_.driver->event_query(e.load_done_ev)) opts_.driver->stream_wait_event(stream, e.load_done_ev);
  else timed_wait_locked(e.device, stream, e.load_done_ev, true);  // Note [Device waits]
  e.load_waited = true;  // on `stream`; the glue records it on the buffer when it is another
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
  Unpacked out;  // Note [Glue objects]: declared before the lock, destroyed after it
  std::vector<GlueObj> dead;
  CallerMode mode(opts_.driver, made_in_this_process());  // Note [Queries during a capture]
  Lock lock(mu_);
  Reaper reaper{graveyard_, dead};
  EBB_CHECK_STATE(!closed_, "tensor cache: unpack from a closed cache (entry ", id, ")");
  out.done = take_completions_locked();
  try {
    unpack_locked(lock, id, stream, task, have_original, into, out);
  } catch (...) {
    // The completions taken go back, ahead of any that came while the lock
    // was released, to the next call, whose caller acks them (Note [Torn
    // snapshots]: dropped with this call, a torn copy would go unnoticed and
    // the tensors they alone hold would die in it). A close meanwhile
    // dropped the others: these go the same way (Note [Close releases]).
    if (closed_) {
      for (auto& c : out.done) bury_locked(c.live);
    } else {
      completions_.insert(completions_.begin(), std::make_move_iterator(out.done.begin()),
                          std::make_move_iterator(out.done.end()));
    }
    out.done.clear();
    throw;
  }
  return out;
}

void TensorCache::unpack_locked(Lock& lock, EntryId id, mem::cuda::Stream stream, int64_t task, bool have_original,
                                void* into, Unpacked& out) {
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
    return;
  }
  if (have_original && (e->state == EntryState::kStored || e->state == EntryState::kLoaded)) {
    // A loaded entry's bytes were counted as reloaded: this handle only
    // consumes it (every offloaded byte counts once, reloaded or reused).
    if (e->state == EntryState::kLoaded) consume_locked(*e, task);
    else count_reuse_locked(*e);
    out.kind = Unpacked::Kind::kLive;
    return;
  }
  if (e->state == EntryState::kStored) {
    EBB_CHECK_STATE(e->has_loc || e->blob != nullptr, "tensor cache: entry ", id, " has neither bytes nor tensor");
    if (e->device >= 0) {
      out.kind = Unpacked::Kind::kNeedBuffer;
      return;
    }
    if (into != nullptr && e->has_loc && store_->tier_of(e->loc) == kTierCpu) {
      // The handles of one storage are copied one by one: one reload per
      // backward (a retained graph's next backward counts again).
      const bool again = task != -1 && e->consumed_task == task && e->tally_step == step_ && !e->tally_reused;
      load_host_locked(lock, *e, into, !again);
      e->consumed_task = task;
      out.kind = Unpacked::Kind::kBuffer;
      return;  // no prefetch: host-tier entries are loaded at unpack
    }
    load_host_locked(lock, *e, nullptr, true);
  } else if (e->state == EntryState::kLoading) {
    promote_load_locked(*e);
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
    wait_for_load_locked(*e, stream);
  }
  out.kind = Unpacked::Kind::kBuffer;
  out.obj = e->buf;
  out.host_buffer = e->buf_host;
  out.data = e->dst;
  out.buffer_stream = e->buf_stream;
  consume_locked(*e, task);
  if (auto m = microbatches_.find(e->microbatch); m != microbatches_.end() && e->order_pos != SIZE_MAX) {
    out.prefetch = prefetch_locked(m->second, e->order_pos, task, scope_start(m->second, e->order_pos, false));
  }
}

// Note [Originals still alive]
// A saved tensor may outlive forward outside autograd: the model's input, a
// tensor the user keeps, a storage a later block saves and keeps (a kept
// handle holds it). Its storage then never left memory, so the glue answers
// its unpack from it and does not load it; the counters record it once per
// entry and step, so that bytes_reloaded + bytes_reused accounts for every
// offloaded byte. Prefetch walks still offer it: the original may die later
// in the backward (the kept holder's backward ended), and the glue, which
// looks at the original each time, then loads it ahead of its unpack instead
// of that unpack loading it on demand.
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

// Note [Joint resident peak]
// The glue keeps small and planned-resident saves in handles of its own, no
// entry in the core (Note [Kept tensors] in python/src/torch/hooks.cpp), and
// tells the core how many bytes those hold whenever that changes. The step's
// peak of resident saved bytes is the peak of the sum: summing the two
// peaks (the kept ones at the forward's end, the reloads' late in
// backward) reported a CPU step's 36 MiB as 54 MiB. The glue sends changes,
// not levels: its calls run without the GIL, and two threads' levels could
// arrive out of order and leave a stale one (a sum of changes does not
// depend on their order). A rise takes the lock and compares the kept bytes
// its own add produced with the entries' bytes of that moment: read again
// under the lock, a fall that landed between could hide the peak. A fall
// cannot raise the peak and only adds.
void TensorCache::add_kept_resident(int64_t delta) {
  const int64_t kept = kept_resident_.fetch_add(delta) + delta;
  if (delta <= 0) return;
  Lock lock(mu_);
  step_c_.peak_resident_bytes =
      std::max(step_c_.peak_resident_bytes, resident_ + static_cast<uint64_t>(std::max<int64_t>(kept, 0)));
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

uint64_t TensorCache::lead_of_locked(const Entry& e) const {
  return e.lead != 0 ? e.lead : opts_.prefetch_window_bytes;
}

void TensorCache::take_lead_locked(MicroBatch& mb, Entry& e, uint64_t lead) {
  e.lead = lead;
  if (lead == 0) mb.window_lead = true;
  else mb.max_lead = std::max(mb.max_lead, lead);
}

size_t TensorCache::scope_start(const MicroBatch& mb, size_t pos, bool strict) {
  size_t start = 0;
  for (const auto& [scope, end] : mb.scope_end)
    if (strict ? end < pos : end <= pos) start = std::max(start, end);
  return start;
}

std::vector<Candidate> TensorCache::prefetch_locked(MicroBatch& mb, size_t end, int64_t task, size_t urgent_from) {
  // Note [Prefetch distance]: two bounds. The window bounds the bytes loading
  // or loaded ahead of use (window_). Each entry's lead (SaveRequest::
  // lead_bytes, the window when 0) bounds how far ahead of the point backward
  // has reached its load may start: the bytes of every entry in between
  // count, its own and resident ones (kept, forwarded) included; an entry
  // with nothing between always may. Without the second bound, when stores
  // lag compute (a fast GPU: most entries forwarded) the walk skipped the
  // resident entries and reloaded the few stored early blocks at the start
  // of backward, on top of everything still resident: a peak above no
  // offload. A plan gives each block the shortest lead that hides its reload
  // (Note [Reload lead] in plan/step_model.cpp), so an entry beyond its own
  // lead is skipped while one further on, with a longer lead, may still
  // qualify: the walk ends once the distance passes the micro-batch's
  // longest lead, or at the first entry the window has no room for.
  // Only loadable positions are visited; the bytes between come from the
  // running sums (Note [Host copies on the caller]: the small host entries
  // count towards the distance but are loaded at unpack).
  std::vector<Candidate> out;
  uint64_t window = window_;
  const uint64_t limit = opts_.prefetch_window_bytes;
  const uint64_t reach = std::max(mb.max_lead, mb.window_lead ? limit : 0);
  end = std::min(end, mb.order.size());
  for (auto it = std::lower_bound(mb.loadable.begin(), mb.loadable.end(), end); it != mb.loadable.begin();) {
    const size_t i = *--it;
    const uint64_t distance = mb.cum[end] - mb.cum[i];  // order[i, end)
    const bool adjacent = mb.cum[end] - mb.cum[i + 1] == 0;
    if (distance > reach && !adjacent) break;
    auto eit = entries_.find(mb.order[i]);
    if (eit == entries_.end()) continue;
    Entry& e = *eit->second;
    if (e.order_pos != i) continue;  // the place it had before a later saver moved it (Note [Shared entries])
    if (distance > lead_of_locked(e) && !adjacent) continue;
    if (task != -1 && e.consumed_task == task) continue;
    if (e.state != EntryState::kStored || !e.acked || e.live || (!e.has_loc && e.blob == nullptr)) continue;
    if (e.device < 0 && e.has_loc && e.nbytes <= opts_.inline_copy_bytes && store_->tier_of(e.loc) == kTierCpu)
      continue;  // reloaded at unpack (Note [Host copies on the caller])
    if (window + e.nbytes > limit) break;
    window += e.nbytes;
    e.urgent = i >= urgent_from;
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
  return prefetch_locked(m->second, end, task, scope_start(m->second, end, true));
}

std::vector<Candidate> TensorCache::prefetch_before(EntryId id, int64_t task) {
  Lock lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return {};
  auto m = microbatches_.find(it->second->microbatch);
  if (m == microbatches_.end()) return {};
  if (it->second->order_pos == SIZE_MAX) return {};
  const size_t pos = it->second->order_pos;
  return prefetch_locked(m->second, pos, task, scope_start(m->second, pos, false));
}

}  // namespace ebbtide::cache
