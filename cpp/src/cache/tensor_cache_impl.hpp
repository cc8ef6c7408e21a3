// Internal: TensorCache's entry and the helpers shared by the files that
// implement it: tensor_cache.cpp (the entry table and states, event pools,
// steps, close, statistics), tensor_cache_save.cpp (save, release and the
// glue's other calls), tensor_cache_device.cpp (the stream-ordered device
// path), tensor_cache_load.cpp (reloads, unpack, prefetch) and
// tensor_cache_workers.cpp (the store workers).
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <vector>

#include "ebbtide/cache/tensor_cache.hpp"

namespace ebbtide::cache {

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
  bool offloaded_order = false;        // that place is an offloaded entry's (not a kept one's)
  uint64_t offloaded_through = 0;      // its micro-batch's offloaded bytes through it (Note [Release by bytes])
  uint64_t lead = 0;                   // SaveRequest::lead_bytes
  bool load_on_demand = false;         // its worker load goes to the priority stream (Note [Priority loads])
  bool urgent = false;                 // a walk offered it for the running module: start_loads uses the priority stream
};

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

// Note [Queries during a capture]
// A CUDA graph capture in global mode (torch.cuda.graph's default) forbids
// potentially unsafe driver calls (event and stream queries and syncs, host
// registration, stream creation) on the capturing thread and on every other
// thread whose mode is not relaxed, whatever stream they concern: one such
// call invalidates the capture. The cache's calls on the caller's thread
// never touch a capturing stream (Note [Graph capture]: saves made in a
// capture stay resident, release points and prefetches on a capturing stream
// do nothing, another device's lane whose stream is captured is skipped),
// and its events are recorded outside any capture. So the entry points that
// query or wait for the cache's own copies or register host memory (save,
// release_copies, start_load(s), unpack, wait, drain) relax the calling
// thread's mode for their duration: a training thread that captures device
// 1's stream keeps its capture valid while it saves, releases and reloads on
// device 0 (CacheRaces.DeviceZeroWorksWhileDeviceOneIsCaptured and
// BackwardOnDeviceZeroWhileDeviceOneIsCaptured, which also check that the
// mode is global again after each call). The mode is restored before the
// call's glue objects are dropped (declared after them), so user code run by
// a tensor's deleter sees the thread's own mode. close() is left in the
// caller's mode: closing inside a capture would unregister host memory and
// destroy streams, which the driver's rules during a capture do not clearly
// allow; its synchronisation fails there instead and it holds what a copy
// may touch (CacheRaces.CloseDuringACaptureFreesNothingACopyMayTouch). The
// workers relax their own mode once (Note [Spill readiness]); stats()
// relaxes in harvest_waits_locked.
class CallerMode {
 public:
  CallerMode(mem::cuda::Driver* driver, bool here);

 private:
  std::optional<mem::cuda::RelaxedCaptureScope> scope_;
};

inline bool in_flight(EntryState s) { return s == EntryState::kQueued || s == EntryState::kStoring; }

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace ebbtide::cache
