// The store workers: the threads that run stores, loads and SSD spills off
// the training thread, loads first.
#include "tensor_cache_impl.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <string>

#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::cache {

// Note [SSD below the link]
// A device entry bound for the SSD goes device -> page-locked bounce blob on
// the copy stream (Note [Stream-ordered offload], so the device memory is
// given up as soon as the copy ran), then a worker waits for that copy on its
// own thread and writes the blob to the SSD, and frees it. At most staging_bytes of bounce blobs are
// held; past that a device entry stays resident rather than making the
// training thread wait. A reload reads the SSD into a bounce blob on a worker,
// which then enqueues the host-to-device copy on the load stream; an entry
// still in its bounce blob reloads from it directly.

// Note [Store workers]
// `workers` threads share two FIFO queues and always take a load before a
// store: a load blocks backward, a store only delays a memory release. Store
// calls are synchronous on the worker; the queues give the asynchrony and
// make cancel cheap (a queued id whose entry left kQueued is skipped). Device
// entries: save() records an event on the compute stream; the worker makes its
// own side stream wait on it before the copy, and for loads records a done
// event that wait() makes the consumer stream wait on: no host sync in hooks.

namespace {

std::string what_of(std::exception_ptr err) {
  try {
    std::rethrow_exception(err);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

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
    completions_.push_back({id, false, {}, 0});  // also when forwarded meanwhile: the glue warns
    return;
  }
  if (e.state == EntryState::kStoring) {
    e.loc = loc;
    e.has_loc = true;
    mutate(e, EntryState::kStored, false);
    step_c_.bytes_offloaded += e.nbytes;
    step_c_.tensors_offloaded += 1;
    completions_.push_back({id, true, {}, 0});
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
  const bool after_previous = e.loaded_once;  // Note [Priority loads]
  const mem::cuda::Stream load = e.load_on_demand ? lanes_.at(dev).load_hi : lanes_.at(dev).load;  // Note [Priority loads]
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
    if (after_previous) opts_.driver->stream_wait_event(load, done);
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

}  // namespace ebbtide::cache
