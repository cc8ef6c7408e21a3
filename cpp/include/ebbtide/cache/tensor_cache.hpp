// The tensor cache core: bookkeeping and scheduling of offloaded activations.
//
// Knows nothing of torch. The glue (python/ebbtide/cache/tensor_cache.py) calls save() from
// the pack hook with a storage's identity, pointer and size, and the tensor as
// an opaque object the cache holds while the entry needs it resident (Note
// [Glue objects] in the .cpp); the cache dedups by key and offloads. Small
// host entries are copied inside save() (Note [Host copies on the caller]),
// larger ones and SSD writes by worker threads; device (CUDA) entries are
// copied stream-ordered from the calling thread (Note [Stream-ordered
// offload]) and released at release points. Completions come back with the
// next call, each with the tensor the cache stopped holding. At unpack, one
// unpack() call answers from the live tensor or a reload (Note [One call per
// unpack]) and names the next prefetch candidates, chosen in reverse forward
// order within a byte window. request(), start_load(), wait() and consume()
// are the same steps one by one. Thread safe; workers never call back into
// the caller. States: Note [Entry states] in the .cpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "ebbtide/mem/fork_origin.hpp"
#include "ebbtide/cache/store.hpp"
#include "ebbtide/mem/buffer.hpp"
#include "ebbtide/mem/cuda_shim.hpp"

namespace ebbtide::cache {

using EntryId = uint64_t;
using HandleId = uint64_t;  // one per save(): what autograd holds

// An object of the glue that the core keeps for an entry: the saved tensor
// while it must stay resident, a reload buffer, a weak reference (Note [Glue
// objects] in the .cpp). Opaque here; the core destroys one only on a
// caller's thread with its lock released, never on a worker.
using GlueObj = std::shared_ptr<void>;

enum class EntryState : uint8_t {
  kKept,       // resident by policy; never offloaded
  kQueued,     // store queued; the glue holds the live tensor
  kStoring,    // store running; the glue holds the live tensor
  kStored,     // bytes in the store; live tensor dropped once the glue polled
  kLoading,    // reload into a glue buffer queued or running
  kLoaded,     // reload finished; the glue holds the buffer
  kForwarded,  // answered from the live tensor; resident until released
  kFailed,     // store failed (disk full, I/O error); resident until released
};
std::string_view to_string(EntryState s);

// What the glue does at unpack (request()).
enum class Reload : uint8_t {
  kResident,    // use the live tensor (kept, forwarded or failed entry)
  kForward,     // store cancelled or abandoned: use the live tensor and keep it
  kNeedBuffer,  // allocate a buffer, start_load(), wait()
  kPending,     // a load is queued, running or done into the glue's buffer: wait()
};
std::string_view to_string(Reload r);

struct CacheOptions {
  uint64_t prefetch_window_bytes = 512ull << 20;  // bytes loading or loaded ahead of use
  unsigned workers = 2;                          // store/load threads (loads first)
  uint64_t max_inflight_bytes = 0;               // save() waits while more store bytes are
                                                 // queued or running (0 = never waits)
  mem::cuda::Driver* driver = nullptr;           // needed for device entries
  uint64_t device_inflight_bytes = 1ull << 30;   // device copies the compute stream may run
                                                 // ahead of (Note [Copy bound]; 0 = no bound)
  uint64_t staging_bytes = 1ull << 30;           // pinned bytes held for device entries on
                                                 // their way to the SSD (Note [SSD below the link])
  // Host entries of at most this many bytes bound for host memory are copied
  // on the caller's thread, in save() and at unpack (Note [Host copies on the
  // caller]); larger ones and SSD-bound ones go through the workers.
  uint64_t inline_copy_bytes = 256ull << 10;
  // When set, close() hands the store (every entry's space freed) to this
  // instead of destroying it: a pool of stores for short-lived caches.
  std::function<void(std::unique_ptr<Store>)> return_store;
};

struct SaveRequest {
  uint64_t key = 0;             // storage identity; the glue keeps it unique while the entry lives
  uint64_t version = 0;         // the tensor's version counter: dedup only within one version
  mem::Buffer src;              // the storage's bytes (nbytes > 0); device: its ordinal and
                                // the compute stream that produced them
  int microbatch = 0;
  bool offload = true;          // false: keep resident (policy)
  int tier = kTierFirst;        // store tier hint (Store::put)
  GlueObj live;                 // the saved tensor: held while the entry needs it resident
  GlueObj orig;                 // handed back with prefetch candidates (Candidate::orig)
  // Its reload may start once backward is within this many bytes of saves of
  // it (Note [Prefetch distance]; 0: the prefetch window). A dedup hit that
  // moves the entry (Note [Shared entries]) gives it the new request's lead.
  uint64_t lead_bytes = 0;
};

struct Completion {
  EntryId id = 0;
  bool ok = false;     // false: store failed; the glue keeps the live tensor
  GlueObj live;        // the entry's live tensor, no longer held by the cache
  uint64_t version = 0;  // the version it was saved at (Note [Torn snapshots])
};

struct SaveResult {
  EntryId id = 0;
  HandleId handle = 0;     // release_handle() it when autograd drops it
  bool is_new = false;     // false: dedup hit, the handle joined an existing entry
  bool offloaded = false;  // a store was queued (new entry) / the entry is offloaded
  std::vector<Completion> done;  // what poll() would return now, taken with this call
};

// A stored entry worth loading ahead of use (prefetch_*()).
struct Candidate {
  EntryId id = 0;
  uint64_t nbytes = 0;
  GlueObj orig;  // SaveRequest::orig
};

// What unpack() answers (Note [One call per unpack]).
struct Unpacked {
  enum class Kind : uint8_t {
    kLive,        // `obj` is the live tensor (kept, forwarded, failed, or not yet released)
    kBuffer,      // the bytes are in a reload buffer: `obj` owns it
    kNeedBuffer,  // device entry: allocate `nbytes` on `stream`, start_load(), unpack() again
  };
  Kind kind = Kind::kLive;
  GlueObj obj;
  bool host_buffer = false;       // kBuffer: `obj` is a host pool buffer whose bytes start at `data`
  void* data = nullptr;
  uint64_t nbytes = 0;
  uint64_t offset = 0;            // kBuffer, glue buffer: bytes from its start
  mem::cuda::Stream buffer_stream = 0;  // glue buffer: the stream it was allocated on
  std::vector<Candidate> prefetch;      // loads the glue may start next (start_load)
  std::vector<Completion> done;         // as SaveResult::done
};

struct Counters {
  uint64_t bytes_offloaded = 0;    // successful stores
  uint64_t bytes_reloaded = 0;     // successful loads
  uint64_t tensors_saved = 0;      // handles (every pack that reached the cache)
  uint64_t tensors_deduped = 0;    // handles that joined an existing entry
  uint64_t tensors_offloaded = 0;  // entries stored successfully
  uint64_t tensors_forwarded = 0;  // entries answered from the live tensor
  uint64_t tensors_kept = 0;       // entries kept resident by policy
  uint64_t tensors_reloaded = 0;   // completed loads
  uint64_t tensors_reused = 0;     // stored entries answered from their original, still alive
  uint64_t bytes_reused = 0;       // (Note [Originals still alive]): no reload needed
  uint64_t bytes_discarded = 0;    // stores that finished after their entry was forwarded or
                                   // released: written, never read (Note [Abandoned work])
  uint64_t store_failures = 0;
  uint64_t load_failures = 0;
  uint64_t copy_waits = 0;         // times the compute stream was made to wait for an older
                                   // device copy (Note [Copy bound])
  uint64_t tensors_in_capture = 0; // device saves made during a CUDA graph capture, kept
                                   // resident (Note [Graph capture])
  uint64_t saved_bytes_total = 0;  // bytes of new entries (after dedup)
  uint64_t peak_resident_bytes = 0;
  double stall_seconds = 0;        // caller time blocked on loads and stores
  // Device time compute streams spent in waits the cache enqueued (Note
  // [Device waits]): all of them, those for copies (release points, the copy
  // bound) and those for reloads (unpack, wait). Counted once measured.
  double device_wait_seconds = 0;
  double copy_wait_seconds = 0;
  double load_wait_seconds = 0;
};

struct CacheStats {
  Counters step;       // since begin_step()
  Counters total;      // since construction
  uint64_t steps = 0;
  uint64_t resident_bytes = 0;   // now
  uint64_t window_bytes = 0;     // loading + loaded now
  uint64_t inflight_bytes = 0;   // stores queued or running now
  uint64_t entries = 0;          // live entries
  uint64_t queued_stores = 0;
  uint64_t queued_loads = 0;
  StoreStats store;
};

// Statistics as named values in the shape the Python API's stats() returns
// (python/tests/test_cache*.py check the names): a record is a list of fields,
// a field holds a number, a name, a record or a list of records. Bindings
// convert records to dicts without naming any field.
struct StatField;
using StatRecord = std::vector<StatField>;
struct StatField {
  std::string_view name;  // static storage
  std::variant<uint64_t, double, std::string_view, StatRecord, std::vector<StatRecord>> value;
};
// step and total counters, the gauges, the store's (store_*) and its tiers'.
StatRecord stat_record(const CacheStats& s);

class TensorCache : public mem::ForkOrigin {
 public:
  TensorCache(std::unique_ptr<Store> store, CacheOptions options);
  ~TensorCache();  // close()
  TensorCache(const TensorCache&) = delete;
  TensorCache& operator=(const TensorCache&) = delete;

  // A pack: dedups by key, else creates an entry and queues its store when
  // `offload` (and no store failed in this step); first waits while more than
  // max_inflight_bytes of stores are pending. StateError when closed.
  SaveResult save(const SaveRequest& r);
  // A handle died. The entry goes when its last handle does: a queued store is
  // cancelled, a running copy is waited for, its space freed. Returns true when
  // the entry is gone (the glue drops everything it holds for it). Unknown ids
  // (released by release_step) are ignored.
  bool release(EntryId id);
  // The same for the handle save() returned; idempotent (Note [Interrupted
  // release]): a handle already released changes nothing. Returns true when
  // entry `id` is gone.
  bool release_handle(HandleId handle, EntryId id);
  // Completions since the last poll, in completion order. Each carries the
  // entry's live tensor when the cache held one (it no longer does).
  std::vector<Completion> poll();
  // The cache holds `live` for the entry (again, or instead of the object it
  // held) and answers unpacks from it: the glue saw the tensor of a completion
  // written in place since its save, so its version check reports the change
  // (Note [Torn snapshots]); or the glue swaps a held tensor for one that
  // makes no reference cycle (Note [Kept cycles] in cache/hooks.py).
  void hold_live(EntryId id, GlueObj live);
  // The tensors the cache holds for entries of step `step` (0: every step).
  std::vector<std::pair<EntryId, GlueObj>> held_lives(uint64_t step) const;

  // One unpack of entry `id` in backward task `task`, on compute stream
  // `stream` (Note [One call per unpack]). Host entries are answered whole:
  // from the live tensor, or reloaded into a pool buffer (on this thread when
  // no load runs). StateError when closed or the entry is gone; rethrows a
  // failed load. A call that throws returns no completions: the next call does.
  // `have_original`: the glue holds the saved tensor itself, still alive
  // outside autograd (Note [Originals still alive]): no reload; counted as
  // reused, and kLive comes back without `obj` unless the cache holds one.
  // `into`: the glue's host buffer of the entry's nbytes; a host-tier entry
  // whose load has not started is copied there (kBuffer without `obj`).
  Unpacked unpack(EntryId id, mem::cuda::Stream stream, int64_t task = -1, bool have_original = false,
                  void* into = nullptr);
  // Starts loads of stored entries (prefetch candidates): host entries into
  // pool buffers of the cache's own, device entries into `buffers` (the
  // glue's, allocated on `stream`), in order. Entries no longer stored are
  // skipped.
  void start_loads(const std::vector<EntryId>& ids, const std::vector<std::pair<uintptr_t, GlueObj>>& buffers,
                   mem::cuda::Stream stream);

  Reload request(EntryId id);
  // Starts the reload of a kStored entry into dst (entry's nbytes, on the
  // entry's device; `stream`: where dst was allocated, the copy waits for it).
  // A load made on demand: on the device's priority load stream (Note
  // [Priority loads]), ahead of the workers' queued loads.
  void start_load(EntryId id, void* dst, mem::cuda::Stream stream);
  // The same, the cache keeping `owner` (the buffer's glue object) until the
  // entry is consumed or released.
  void start_load(EntryId id, void* dst, mem::cuda::Stream stream, GlueObj owner);
  // Blocks until the entry's load is done; `stream` (device) then waits for
  // it without a host sync. Rethrows the load's error (the entry stays stored).
  void wait(EntryId id, mem::cuda::Stream stream);
  // One handle of a loaded entry was unpacked in backward pass `task` (the
  // autograd graph task). True when every handle was: the entry returns to
  // kStored, the glue drops its buffer, and prefetches of the same task skip
  // it (its other views may still be alive, Note [Consumed entries]).
  bool consume(EntryId id, int64_t task = -1);
  // The glue answered an unpack of a stored entry from the original tensor,
  // still alive outside autograd (Note [Originals still alive]): counted once
  // per entry and step; returns false when it was already counted.
  bool reuse(EntryId id);

  // The micro-batch's current end of forward order (for scope bookkeeping).
  void scope_end(int microbatch, int64_t scope);
  // `nbytes` the glue kept resident without an entry were saved at this point
  // of the micro-batch's forward order: the prefetch distance counts them
  // (Note [Prefetch distance]).
  void note_kept(int microbatch, uint64_t nbytes);
  // The glue's bytes kept resident without entries rose (delta > 0) or fell
  // (Note [Joint resident peak]): peak_resident_bytes counts them with the
  // entries'. Changes, not levels: two threads' calls may arrive in any order.
  void add_kept_resident(int64_t delta);
  // Stored entries to load next, in reverse forward order from the end of
  // `scope` (or from just before entry `id`), within the prefetch window.
  // prefetch_scope also marks the start of the micro-batch's backward: its
  // stores not yet started are cancelled (Note [Late stores]).
  // Returns (id, nbytes); the glue allocates and calls start_load for each.
  // `task`: the current backward's graph task (-1: none).
  std::vector<Candidate> prefetch_scope(int microbatch, int64_t scope, int64_t task = -1);
  std::vector<Candidate> prefetch_before(EntryId id, int64_t task = -1);

  void begin_step();
  void end_step();
  // Releases every entry created in step `step` (0 = all) whatever its handles
  // (exception cleanup). Returns the ids released.
  std::vector<EntryId> release_step(uint64_t step);
  uint64_t current_step() const;
  // Blocks until no store or load is queued or running (paused stores excepted).
  void drain();
  // Holds queued stores (loads still run) until unpaused: tests stage forwarding.
  void pause_stores(bool paused);
  // Changes CacheOptions::inline_copy_bytes (0: every store through the workers).
  void set_inline_copy_bytes(uint64_t bytes);
  // A release point (Note [Release points]): the compute stream `compute` waits
  // for the copies of micro-batch `microbatch`'s device entries saved up to the
  // end of `scope` (every scope: INT64_MAX) whose offloaded bytes, counted in
  // forward order from the micro-batch's first offloaded entry, end within
  // `max_bytes` (Note [Release by bytes]), and their completions are queued
  // for poll(), so the glue drops the tensors in the device's order.
  // `compute` is a stream of device `compute_device`; copies held on other
  // devices are ordered before the streams their tensors were made on only.
  // -1: the one device the cache works on (InvalidArgument, nothing
  // released, once it has worked on two; Note [Release points on several
  // devices]).
  void release_copies(int microbatch, int64_t scope, mem::cuda::Stream compute, uint64_t max_bytes = UINT64_MAX,
                      int compute_device = -1);
  // Live entries (released ones excluded).
  size_t entry_count() const;
  // Device-to-host and host-to-device bytes/s of device `device`'s link,
  // timed with events over `nbytes` of device memory at `dev_ptr` (the glue's
  // allocation) and a pinned buffer, best of `repeats`. Synchronizes the device.
  std::pair<double, double> measure_link(int device, void* dev_ptr, uint64_t nbytes, int repeats = 3);
  // Changes the prefetch window (the glue sizes it from the blocks it saw).
  void set_prefetch_window(uint64_t bytes);
  // Changes max_inflight_bytes (0: saves never wait); saves waiting now
  // re-check against the new bound (Note [Store backpressure]).
  void set_max_inflight(uint64_t bytes);
  // Caps the store's SSD writes (Store::set_write_limit).
  void set_write_limit(int tier, double bytes_per_second);
  // Writes `nbytes` of host memory to `tier` and reads them back, through the
  // store (its cap and meters included); returns {write seconds, read seconds}.
  // For a tier the step's own traffic did not measure. Throws what the store does.
  std::pair<double, double> probe(int tier, uint64_t nbytes);
  void close();
  bool closed() const;

  EntryState state(EntryId id) const;  // StateError for unknown ids
  bool contains(EntryId id) const;
  CacheStats stats() const;
  std::string describe() const;
  const CacheOptions& options() const { return opts_; }
  // Reload buffers at the saved storage's address modulo this skip a staging
  // copy (Store::io_alignment).
  uint64_t io_alignment() const { return store_ ? store_->io_alignment() : 1; }

 private:
  struct Entry;
  // Per device: Note [Stream-ordered offload], Note [Copy bound].
  struct Lane {
    int device = 0;
    mem::cuda::Stream copy = 0;  // device -> host copies, in production order
    mem::cuda::Stream load = 0;  // host -> device reloads (prefetches)
    mem::cuda::Stream load_hi = 0;  // reloads made on demand, highest priority (Note [Priority loads])
    uint64_t enqueued = 0;       // bytes ever enqueued on `copy`
    uint64_t waited = 0;         // copies up to here are done before the compute stream goes on
    struct Copy {
      uint64_t through = 0;  // `enqueued` once this copy was
      mem::cuda::Event ev = 0;
      EntryId id = 0;
      mem::cuda::Stream src = 0;  // the stream the saved tensor was produced on
    };
    std::deque<Copy> pending;  // copies whose entries the glue still holds, in copy order
  };
  // A glue object dropped once `stream` passed `fence`, held while `stream`
  // is being captured (Note [Stream-ordered drops]).
  struct DeferredDrop {
    int device = 0;
    mem::cuda::Stream stream = 0;
    mem::cuda::Event fence = 0;
    GlueObj obj;
  };
  // A host blob freed once `fence` (a device copy touching it) completed.
  struct FencedFree {
    int device = 0;
    mem::cuda::Event fence = 0;
    Store* store = nullptr;
    Location loc = 0;
  };
  struct MicroBatch {
    std::vector<EntryId> order;              // offloaded entries, forward order
    std::vector<uint64_t> cum{0};            // cum[i]: bytes of order[0, i), kept bytes included
    std::vector<size_t> loadable;            // positions in `order` that prefetch may load, ascending
    std::map<int64_t, size_t> scope_end;     // scope -> order size at its end
    size_t live = 0;
    bool backward_began = false;  // its queued stores were cancelled (Note [Late stores])
    uint64_t offloaded = 0;       // bytes of its offloaded entries so far (Note [Release by bytes])
    uint64_t max_lead = 0;        // the longest lead_bytes an entry took (Note [Prefetch distance])
    bool window_lead = false;     // an entry took the prefetch window as its lead
  };
  // A pair of timed events around a wait the cache enqueued on `stream`
  // (Note [Device waits]).
  struct WaitTiming {
    int device = 0;
    mem::cuda::Stream stream = 0;
    mem::cuda::Event begin = 0;
    mem::cuda::Event end = 0;
    uint64_t step = 0;
    bool load = false;  // a reload's wait, else a copy's
  };
  using Lock = std::unique_lock<std::mutex>;

  Entry& find(EntryId id, const char* what);
  void mutate(Entry& e, EntryState s, bool acked);  // keeps resident/window sums
  void erase_locked(Lock& lock, EntryId id);
  void cancel_late_stores_locked(MicroBatch& mb);
  enum class DevicePath { kOffloaded, kWorker, kKeep };
  DevicePath offload_device_locked(Entry& e, const SaveRequest& r);
  HandleId new_handle_locked(EntryId id);
  Lane& lane_locked(int device);
  Store& staging_locked();
  void bound_copies_locked(Lane& lane, mem::cuda::Stream compute);
  void release_through_locked(Lane& lane, uint64_t through, const mem::cuda::Stream* compute);
  void free_blob_locked(Entry& e);
  void dispose_locked(Entry& e);
  void finish_abandoned_locked(Entry& e);
  void wait_abandoned_locked(Lock& lock, const std::function<bool(const Entry&)>& pred);
  void drop_buf_locked(Entry& e);
  bool order_after_locked(int device, mem::cuda::Stream stream, mem::cuda::Event fence);
  void fence_drop_locked(int device, mem::cuda::Stream stream, mem::cuda::Event fence, GlueObj& obj);
  void flush_deferred_locked(bool all);
  bool capturing_locked(int device, mem::cuda::Stream stream);
  void refuse_in_capture_locked(const Entry& e, mem::cuda::Stream stream);
  bool spill_ready_locked(const Entry& e);
  void sweep_fenced_locked(bool wait);
  void run_spill(Lock& lock, Entry& e);
  void run_device_load(Lock& lock, Entry& e);
  void ref_event_locked(mem::cuda::Event ev);
  void wait_idle_locked(Lock& lock, Entry& e);
  // unpack() past its completions; fills `out` (Note [One call per unpack]).
  void unpack_locked(Lock& lock, EntryId id, mem::cuda::Stream stream, int64_t task, bool have_original, void* into,
                     Unpacked& out);
  // `urgent_from`: candidates at or past this place in the order are the
  // running module's, loaded on the priority stream (Note [Priority loads]).
  std::vector<Candidate> prefetch_locked(MicroBatch& mb, size_t end, int64_t task, size_t urgent_from);
  // The first place in the order of the scope holding place `pos` (its
  // predecessor's end; `strict`: a scope ending at `pos` is that predecessor).
  static size_t scope_start(const MicroBatch& mb, size_t pos, bool strict);
  std::vector<Completion> take_completions_locked();
  void push_order_locked(MicroBatch& mb, Entry* e, uint64_t nbytes, bool loadable);
  void take_lead_locked(MicroBatch& mb, Entry& e, uint64_t lead);
  void move_order_locked(MicroBatch& mb, Entry& e, uint64_t lead);
  uint64_t lead_of_locked(const Entry& e) const;
  void bury_locked(GlueObj& obj);
  bool copy_on_caller_locked(Entry& e, const SaveRequest& r);
  void load_host_locked(Lock& lock, Entry& e, void* into, bool count);
  void host_buffer_locked(Entry& e);
  void consume_locked(Entry& e, int64_t task);
  bool count_reuse_locked(Entry& e);  // Note [Originals still alive]: once per entry and step
  void count_reload_locked(Entry& e);
  // What a load is for (Note [Priority loads]): a prefetch, a prefetch of the
  // module whose backward runs (needed next), or an unpack's own (needed now).
  enum class LoadNeed { kPrefetch, kNext, kNow };
  void start_load_locked(Entry& e, void* dst, mem::cuda::Stream stream, LoadNeed need);
  void queue_load_locked(EntryId id, LoadNeed need);
  void promote_load_locked(Entry& e);  // a queued load is needed now
  void adopt_buffer_locked(Entry& e, GlueObj owner, mem::cuda::Stream stream);
  void worker_main(unsigned index);
  void run_store(Lock& lock, EntryId id, std::map<int, mem::cuda::Stream>& side);
  void run_load(Lock& lock, EntryId id, std::map<int, mem::cuda::Stream>& side);
  // Events of device `device`'s primary context, which must be current.
  mem::cuda::Event take_event_locked(int device);
  void give_event_locked(int device, mem::cuda::Event& ev);
  void add_stall(double seconds);
  // `stream` waits for `ev`, not seen complete (device `device`, current),
  // between timed events (Note [Device waits]).
  void timed_wait_locked(int device, mem::cuda::Stream stream, mem::cuda::Event ev, bool load);
  // `stream` waits for the entry's reload (load_done_ev): timed unless a host
  // query finds it done.
  void wait_for_load_locked(Entry& e, mem::cuda::Stream stream);
  void harvest_waits_locked();
  void drop_timings_locked();

  std::unique_ptr<Store> store_;
  CacheOptions opts_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::unordered_map<EntryId, std::unique_ptr<Entry>> entries_;
  // Released entries whose store, spill or load still runs on a worker:
  // the worker disposes of them when it ends (Note [Abandoned work]).
  std::unordered_map<EntryId, std::unique_ptr<Entry>> abandoned_;
  // (storage key, version) -> entry: the dedup of save(), looked up once per pack.
  struct KeyHash {
    size_t operator()(const std::pair<uint64_t, uint64_t>& k) const noexcept {
      return std::hash<uint64_t>()(k.first * 0x9E3779B97F4A7C15ull ^ k.second);
    }
  };
  std::unordered_map<std::pair<uint64_t, uint64_t>, EntryId, KeyHash> by_key_;
  std::unordered_map<HandleId, EntryId> handles_;             // handles not yet released
  HandleId next_handle_ = 1;
  std::map<int, MicroBatch> microbatches_;
  std::deque<EntryId> store_q_;
  std::deque<EntryId> load_q_;
  std::vector<Completion> completions_;
  std::vector<GlueObj> graveyard_;  // glue objects to destroy once the lock is released
  std::map<int, std::vector<mem::cuda::Event>> free_events_;  // per device
  std::map<int, std::vector<mem::cuda::Event>> free_timed_;   // per device: timed events (Note [Device waits])
  std::vector<WaitTiming> wait_timings_;                      // not yet seen complete
  std::unordered_map<mem::cuda::Event, int> event_refs_;       // holders of taken events
  std::map<int, Lane> lanes_;
  std::deque<FencedFree> fenced_;
  std::vector<DeferredDrop> deferred_;
  std::unique_ptr<Store> staging_;  // pinned bounce blobs for the SSD (made on first use)
  StoreStats closed_store_stats_;   // the store's last stats, once close() released it
  std::string closed_describe_;
  std::vector<std::thread> workers_;
  unsigned busy_ = 0;
  EntryId next_id_ = 1;
  uint64_t step_ = 0;
  bool stores_paused_ = false;
  bool stop_offload_ = false;  // a store failed in this step
  bool closed_ = false;
  uint64_t resident_ = 0;
  // add_kept_resident's sum (Note [Joint resident peak]); below zero for a
  // moment when a fall arrives before the rise it undoes.
  std::atomic<int64_t> kept_resident_{0};
  uint64_t kept_resident() const { return static_cast<uint64_t>(std::max<int64_t>(kept_resident_.load(), 0)); }
  void note_peak_locked() {
    step_c_.peak_resident_bytes = std::max(step_c_.peak_resident_bytes, resident_ + kept_resident());
  }
  uint64_t window_ = 0;
  uint64_t inflight_ = 0;  // bytes in kQueued + kStoring
  Counters step_c_;
  Counters total_c_;
  bool step_folded_ = false;  // end_step() folded step_c_ into total_c_
  uint64_t steps_ = 0;
};

}  // namespace ebbtide::cache
