// The glue's calls around an entry's life: save, its handles and release,
// the completions it polls and the live tensors it hands back.
#include "tensor_cache_impl.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::cache {

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

// Note [Torn snapshots]
// A store copies the tensor while the training thread goes on (a worker, or
// the device's copy stream after the producing kernels). An in-place write
// after the save can race with that copy; autograd would report the write at
// backward as a version mismatch. So a completion returns the live tensor
// and its saved version to the glue, which compares versions and, when they
// differ, gives it back (hold_live): unpack then answers from the live
// tensor and the glue raises autograd's error. Copies made on the caller's
// thread (Note [Host copies on the caller]) cannot tear.

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

// Note [Shared entries]
// A storage several blocks save (HF Llama's rotary cos/sin tables, made once
// per forward and passed to every block) is one entry: the first saver's
// save creates it, the others' join it (dedup). In the forward order it sat
// at its first saver's place, so backward reached it last and the prefetch,
// walking from the last block down, queued its reload behind every block's
// in between; the blocks that use it first in backward (the last savers)
// then loaded it on demand behind those reloads. So a dedup hit by an
// offloading save of the same micro-batch, in the same step and before its
// backward began, moves the entry to the current end of the order (no
// bytes added to the running sums: they were counted where it was saved;
// its old place stays as bytes between others and the walk skips it), and
// it takes that save's lead: it is reloaded when backward reaches its last
// saver. Its count for release points stays its first place's (Note
// [Release by bytes]). A later saver that keeps it holds the tensor itself
// (the glue's kept handle: Note [Originals still alive]).

namespace {

// In MicroBatch::order: bytes the glue kept without an entry (note_kept).
constexpr EntryId kKeptBytes = 0;

}  // namespace

SaveResult TensorCache::save(const SaveRequest& r) {
  std::vector<GlueObj> dead;
  CallerMode mode(opts_.driver, made_in_this_process());  // Note [Queries during a capture]
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
      if (r.offload && e.offloaded_order && e.microbatch == r.microbatch && e.step == step_ &&
          (in_flight(e.state) || e.state == EntryState::kStored)) {
        // Note [Shared entries].
        auto m = microbatches_.find(e.microbatch);
        if (m != microbatches_.end() && !m->second.backward_began) move_order_locked(m->second, e, r.lead_bytes);
      }
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
    note_peak_locked();
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
    mb.offloaded += r.src.nbytes;
    e->offloaded_through = mb.offloaded;  // Note [Release by bytes]
    e->offloaded_order = true;
    take_lead_locked(mb, *e, r.lead_bytes);
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

// Note [Shared entries]: `e` (offloaded, with a place) takes a new place at
// the order's end, adding no bytes, and the lead `lead`.
void TensorCache::move_order_locked(MicroBatch& mb, Entry& e, uint64_t lead) {
  const bool loadable = std::binary_search(mb.loadable.begin(), mb.loadable.end(), e.order_pos);
  if (loadable) mb.loadable.push_back(mb.order.size());
  e.order_pos = mb.order.size();
  mb.order.push_back(e.id);
  mb.cum.push_back(mb.cum.back());
  take_lead_locked(mb, e, lead);
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

}  // namespace ebbtide::cache
