// A simulated GPU, as unforgiving as a real one, for the device paths of the
// core (Note [Simulated GPU]).
//
// Note [Simulated GPU]
// "Device memory" is host memory, but nothing happens when it is enqueued:
// every operation gets a start and an end on a virtual clock, as a GPU would
// run it, and its effect on memory lands at its end. Streams run their
// operations in order; an operation starts no earlier than its stream's
// previous one ended, than the events its stream waits on were reached, and
// than the host issued it; kernels take the time the test gives and run the
// test's effect at their end; device-to-host and host-to-device copies each
// have one copy engine per device of a given bandwidth and move their bytes
// at their end (a copy reads its source then: writes made after it was
// enqueued but before it ran are what it copies); copies on a stream created
// with a priority above the least have an engine per direction of their own,
// so they never queue behind the default priority's (the link's bandwidth is
// not shared between the two: optimistic, as the planner's model of a
// priority stream is). Timed events (event_create_timed) report the device
// clock: the time their stream reached them; reading one not yet reached on
// the host's clock, untimed or never recorded fails as the driver's
// cuEventElapsedTime does. The host's clock stays
// where the test leaves it (a training loop's CPU runs ahead of the GPU) and
// advances only through synchronize calls, a query that finds an event
// reached, or the test; effects run as the host's clock passes their end.
//
// Ordering is checked with vector clocks, not with the timeline: an operation
// happens before a point of a stream when a chain of stream order, event
// waits and host synchronisations leads from it there. The stream-ordered
// allocator model (alloc/free/record_stream/empty_cache: torch's caching
// allocator) hands a block freed on stream s to the next allocation on s at
// once, to another stream only once the host knows s reached the free, and
// fills freed blocks with a poison byte on their stream at the free. Handing
// out (or unmapping) a block while a copy that touched it is not ordered
// before that point is a race: it is recorded with the block's label and the
// copy (races()), whatever the timeline says. So is a copy that touches host
// memory another copy touched, one of them writing it, when that copy is not
// ordered before it (a page-locked blob freed while a reload still reads it,
// then written by the next offload's copy). Several devices each have a
// primary context; a thread has none current until it binds one; streams and
// events belong to the context current at their creation, and calls that
// need a context throw without one (contexts() lists the devices whose
// context was ever made current). Graph capture (begin_capture) forbids what
// the driver forbids in global mode (host synchronisation, queries, host
// registration, allocation, stream creation) on threads that did not relax
// their capture mode, and in any mode a host wait for a capturing stream or
// a query of an event recorded in a capture under way; captured work does
// not run. Every error the
// simulated driver raises is also recorded (errors()): code that swallows one
// still fails the test. Thread safe; effects run under the simulator's lock.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/error.hpp"
#include "sim_order.hpp"

namespace ebbtide::test {

class SimDriver final : public mem::cuda::Driver {
 public:
  using Stream = mem::cuda::Stream;
  using Event = mem::cuda::Event;
  using DevicePtr = mem::cuda::DevicePtr;

  struct Options {
    int devices = 1;
    double d2h_bps = 1e9;
    double h2d_bps = 1e9;
    double copy_latency = 0;       // seconds added to every copy
    uint64_t seed = 0;             // nonzero: each copy takes a seeded 1x..3x its bandwidth time
    unsigned char poison = 0xAB;   // what a freed block holds from its free on
    // Pointers the allocator model did not hand out are device 0's memory
    // (tests that use host vectors as device buffers).
    bool foreign_pointers_are_device = true;
  };

  struct Copy {
    bool d2h = false;
    const void* host = nullptr;
    uint64_t dev = 0;
    size_t n = 0;
    Stream stream = 0;
    double start = 0;
    double end = 0;
    int device = 0;
    uint64_t seq = 0;
  };

  SimDriver(double d2h_bytes_per_s, double h2d_bytes_per_s)
      : SimDriver(Options{1, d2h_bytes_per_s, h2d_bytes_per_s}) {}
  explicit SimDriver(Options o) : opts_(o), rng_(o.seed) {
    EBB_CHECK(o.devices >= 1 && o.devices <= 16, "sim: ", o.devices, " devices");
  }
  ~SimDriver() override = default;

  // ------------------------------------------------------------ test side
  // A kernel of `seconds` on `s` (of device `device` when `s` is 0 or not
  // created by stream_create); `effect` runs at its end. Returns its start.
  double launch(Stream s, double seconds, std::function<void()> effect = {}, int device = 0) {
    Lock lock(mu_);
    const SKey k = test_key(s, device);
    return enqueue_locked(k, seconds, std::move(effect), "kernel").first;
  }
  // When everything enqueued on `s` so far has run.
  double tail(Stream s, int device = 0) {
    Lock lock(mu_);
    return streams_[test_key(s, device)].tail;
  }
  double host_time() {
    Lock lock(mu_);
    return host_;
  }
  // The host's clock moves on by `seconds` (work the CPU does); effects due run.
  void advance_host(double seconds) {
    Lock lock(mu_);
    advance_locked(host_ + seconds);
  }
  // The host waits for every stream of every device (cudaDeviceSynchronize everywhere).
  void synchronize_all() {
    Lock lock(mu_);
    for (auto& [k, st] : streams_) host_waits_for_locked(st);
  }
  // Declares `s` a stream of `device` (test streams that stream_create did not make).
  void declare_stream(Stream s, int device) {
    Lock lock(mu_);
    declared_[s] = device;
  }
  std::vector<Copy> copies() {
    Lock lock(mu_);
    return copies_;
  }
  uint64_t waits_on(Stream s, int device = 0) {
    Lock lock(mu_);
    return streams_[test_key(s, device)].waits;
  }
  int registers() {
    Lock lock(mu_);
    return registers_;
  }
  int unregisters() {
    Lock lock(mu_);
    return unregisters_;
  }
  bool allow_register = true;
  // Threads that page-locked memory, in order.
  std::vector<std::thread::id> register_threads() {
    Lock lock(mu_);
    return register_threads_;
  }
  // Devices whose primary context a thread made current.
  std::set<int> contexts() {
    Lock lock(mu_);
    return contexts_;
  }
  // Host synchronisations that had to wait for the device (the event or stream
  // was not reached on the host's clock): a thread parked there on a GPU.
  struct Park {
    std::thread::id thread;
    std::string call;
  };
  std::vector<Park> parks() {
    Lock lock(mu_);
    return parks_;
  }
  // Races found by the allocator model, and every error the driver raised.
  std::vector<std::string> races() {
    Lock lock(mu_);
    return races_;
  }
  std::vector<std::string> errors() {
    Lock lock(mu_);
    return errors_;
  }
  static std::string join_lines(const std::vector<std::string>& v) {
    std::string out;
    for (const auto& s : v) out += "\n  " + s;
    return out;
  }

  // The allocator model (torch's caching allocator). `label` names the block
  // in race reports ("activation of entry 3").
  DevicePtr alloc(size_t n, Stream s, std::string label, int device = 0) {
    Lock lock(mu_);
    EBB_CHECK(n > 0, "sim alloc: 0 bytes");
    const SKey k = test_key(s, device);
    StreamState& st = streams_[k];
    VC point = st.vc;
    sim::join(point, host_vc_);
    // Most recently freed first: reuse as early as the model allows.
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      Block& b = *blocks_.at(*it);
      if (b.device != k.first || b.size < n || !b.mapped) continue;
      const bool same = b.stream == k;
      if (!same && !sim::covers(host_vc_, b.free_point)) continue;  // the host never saw s reach the free
      if (!sim::covers(host_vc_, b.use_points)) continue;            // record_stream: events not seen complete
      check_accessors_locked(b, point, detail::concat("reused by an allocation (", label, ") on ", sim::name(k)));
      b.accessors.clear();
      b.in_use = true;
      b.stream = k;
      b.label = std::move(label);
      b.uses.clear();
      b.use_points.clear();
      free_.erase(std::next(it).base());
      return b.ptr;
    }
    auto b = std::make_unique<Block>();
    b->mem.reset(new unsigned char[n]);
    std::memset(b->mem.get(), opts_.poison, n);
    b->ptr = reinterpret_cast<DevicePtr>(b->mem.get());
    b->size = n;
    b->device = k.first;
    b->stream = k;
    b->in_use = true;
    b->label = std::move(label);
    const DevicePtr p = b->ptr;
    blocks_.emplace(p, std::move(b));
    return p;
  }
  // The block's last use is the host's point now, in its allocation stream's
  // order: the stream may hand it out at once. Poisoned at that point.
  void free(DevicePtr p) {
    Lock lock(mu_);
    auto it = blocks_.find(p);
    EBB_CHECK(it != blocks_.end() && it->second->in_use, "sim free: 0x", std::hex, p, " is not an allocated block");
    Block& b = *it->second;
    StreamState& st = streams_[b.stream];
    sim::join(st.vc, host_vc_);
    b.use_points.clear();
    for (const SKey& u : b.uses) {
      if (u == b.stream) continue;
      sim::join(streams_[u].vc, host_vc_);
      b.use_points[u] = streams_[u].vc[u];
    }
    b.in_use = false;
    unsigned char* mem = b.mem.get();
    const size_t size = b.size;
    const unsigned char poison = opts_.poison;
    enqueue_locked(b.stream, 0, [mem, size, poison] { std::memset(mem, poison, size); }, "free");
    b.free_point = VC{{b.stream, st.vc[b.stream]}};
    free_.push_back(p);
  }
  // torch's Tensor.record_stream: the block is also used on `s`; after its
  // free it is handed out only once the host saw `s` reach the free.
  void record_stream(DevicePtr p, Stream s, int device = 0) {
    Lock lock(mu_);
    Block& b = block_of_locked(p);
    b.uses.push_back(test_key(s, device));
  }
  // torch.cuda.empty_cache(): the free blocks of `device` are unmapped. With
  // expandable segments only each block's own stream is synchronised first;
  // otherwise (cudaFree) the whole device is.
  void empty_cache(int device, bool expandable_segments) {
    Lock lock(mu_);
    if (!expandable_segments) {
      for (auto& [k, st] : streams_)
        if (k.first == device) host_waits_for_locked(st);
    }
    for (auto it = free_.begin(); it != free_.end();) {
      Block& b = *blocks_.at(*it);
      if (b.device != device) {
        ++it;
        continue;
      }
      if (expandable_segments) host_waits_for_locked(streams_[b.stream]);
      check_accessors_locked(b, host_vc_, "unmapped by empty_cache");
      b.mapped = false;
      it = free_.erase(it);
    }
  }
  // The block's bytes (for effects and checks).
  unsigned char* bytes(DevicePtr p) { return reinterpret_cast<unsigned char*>(p); }

  // CUDA graph capture of `s` by the calling thread (torch.cuda.graph:
  // global mode); end_capture fails when a stream joined and did not rejoin.
  void begin_capture(Stream s, int device = 0) {
    Lock lock(mu_);
    const SKey k = test_key(s, device);
    EBB_CHECK(!capturing_.count(k), "sim: ", sim::name(k), " is already capturing");
    auto cap = std::make_shared<Capture>();
    cap->origin = k;
    cap->thread = std::this_thread::get_id();
    cap->errors_at_begin = errors_.size();
    capturing_[k] = cap;
  }
  void end_capture(Stream s, int device = 0) {
    Lock lock(mu_);
    const SKey k = test_key(s, device);
    auto it = capturing_.find(k);
    EBB_CHECK(it != capturing_.end() && it->second->origin == k, "sim: ", sim::name(k), " is not capturing");
    auto cap = it->second;
    std::string unjoined;
    for (auto jt = capturing_.begin(); jt != capturing_.end();) {
      if (jt->second != cap) {
        ++jt;
        continue;
      }
      if (jt->first != k && cap->rejoined[jt->first] != cap->ops[jt->first]) unjoined += " " + sim::name(jt->first);
      jt = capturing_.erase(jt);
    }
    if (!unjoined.empty()) fail_locked("cuStreamEndCapture", "CUDA_ERROR_STREAM_CAPTURE_UNJOINED (streams" + unjoined + " joined the capture and never rejoined)");
    if (errors_.size() > cap->errors_at_begin)
      fail_locked("cuStreamEndCapture", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (an illegal call during the capture)");
  }
  uint64_t captured_ops() {
    Lock lock(mu_);
    return captured_ops_;
  }
  // The next `times` calls of `call` ("cuEventRecord", ...) made on threads
  // other than `spare` fail with CUDA_ERROR_UNKNOWN (error paths).
  void inject_failure(std::string call, int times = 1, std::thread::id spare = {}) {
    Lock lock(mu_);
    inject_ = {std::move(call), times, spare};
  }

  // --------------------------------------------------------- driver side
  void bind_context_of(DevicePtr p) override {
    Lock lock(mu_);
    auto it = owner_of_locked(p);
    int dev = 0;
    if (it != nullptr) dev = it->device;
    else if (!opts_.foreign_pointers_are_device) fail_locked("cuPointerGetAttribute", "CUDA_ERROR_INVALID_VALUE (not device memory)");
    make_current_locked(dev);
  }
  void bind_device(int d) override {
    Lock lock(mu_);
    if (d < 0 || d >= opts_.devices) fail_locked("cuDeviceGet", detail::concat("CUDA_ERROR_INVALID_DEVICE (device ", d, ")"));
    make_current_locked(d);
  }
  mem::cuda::Context current_context() override {
    Lock lock(mu_);
    return static_cast<mem::cuda::Context>(current_locked() + 1);
  }
  void set_current_context(mem::cuda::Context c) override {
    Lock lock(mu_);
    const int d = static_cast<int>(c) - 1;
    if (d < 0) current_[thread_token()] = -1;
    else make_current_locked(d);
  }
  bool is_device_pointer(const void* p) override {
    Lock lock(mu_);
    return owner_of_locked(reinterpret_cast<DevicePtr>(p)) != nullptr || opts_.foreign_pointers_are_device;
  }
  void memcpy_dtoh_async(void* dst, DevicePtr src, size_t n, Stream s) override {
    Lock lock(mu_);
    copy_locked(true, dst, src, n, s);
  }
  void memcpy_htod_async(DevicePtr dst, const void* src, size_t n, Stream s) override {
    Lock lock(mu_);
    copy_locked(false, const_cast<void*>(src), dst, n, s);
  }
  Event event_create() override {
    Lock lock(mu_);
    return event_create_locked();
  }
  Event event_create_timed() override {
    Lock lock(mu_);
    const Event e = event_create_locked();
    events_[e].timed = true;
    return e;
  }
  void event_destroy(Event e) override {
    Lock lock(mu_);
    events_.erase(e);
  }
  void event_record(Event e, Stream s) override {
    Lock lock(mu_);
    injected_locked("cuEventRecord");
    const int dev = need_context_locked("cuEventRecord");
    EventState& ev = event_locked(e, "cuEventRecord");
    const SKey k = key_locked(s, "cuEventRecord");
    if (ev.device != dev || k.first != dev)
      fail_locked("cuEventRecord", detail::concat("CUDA_ERROR_INVALID_HANDLE (event of device ", ev.device, ", ", sim::name(k),
                                                 ", device ", dev, " current)"));
    StreamState& st = streams_[k];
    sim::join(st.vc, host_vc_);
    ev.vc = st.vc;
    ev.time = std::max(st.tail, host_);
    ev.recorded = true;
    ev.capture.reset();
    if (auto c = capturing_.find(k); c != capturing_.end()) {
      ev.capture = c->second;
      ev.capture_stream = k;
      ev.capture_ops = c->second->ops[k];
    }
  }
  void event_synchronize(Event e) override {
    Lock lock(mu_);
    injected_locked("cuEventSynchronize");
    unsafe_in_capture_locked("cuEventSynchronize");
    EventState& ev = event_locked(e, "cuEventSynchronize");
    captured_event_locked(ev, "cuEventSynchronize");
    if (ev.time > host_) parks_.push_back({std::this_thread::get_id(), "cuEventSynchronize"});
    sim::join(host_vc_, ev.vc);
    advance_locked(std::max(host_, ev.time));
  }
  bool event_query(Event e) override {
    Lock lock(mu_);
    injected_locked("cuEventQuery");
    unsafe_in_capture_locked("cuEventQuery");
    EventState& ev = event_locked(e, "cuEventQuery");
    captured_event_locked(ev, "cuEventQuery");
    if (ev.time > host_) return false;
    sim::join(host_vc_, ev.vc);
    return true;
  }
  float event_elapsed_ms(Event a, Event b) override {
    Lock lock(mu_);
    const char* call = "cuEventElapsedTime";
    double t[2] = {0, 0};
    int i = 0;
    for (Event e : {a, b}) {
      EventState& ev = event_locked(e, call);
      if (!ev.timed) fail_locked(call, detail::concat("CUDA_ERROR_INVALID_HANDLE (event ", e, " was created without timing)"));
      if (!ev.recorded || ev.capture)
        fail_locked(call, detail::concat("CUDA_ERROR_INVALID_HANDLE (event ", e, " was not recorded outside a capture)"));
      if (ev.time > host_) fail_locked(call, detail::concat("CUDA_ERROR_NOT_READY (event ", e, " not reached yet)"));
      t[i++] = ev.time;
    }
    return static_cast<float>((t[1] - t[0]) * 1e3);
  }
  void stream_wait_event(Stream s, Event e) override {
    Lock lock(mu_);
    injected_locked("cuStreamWaitEvent");
    need_context_locked("cuStreamWaitEvent");
    EventState& ev = event_locked(e, "cuStreamWaitEvent");
    const SKey k = key_locked(s, "cuStreamWaitEvent");
    auto cap = capturing_.find(k);
    if (cap != capturing_.end() && ev.capture != cap->second)
      fail_locked("cuStreamWaitEvent", "CUDA_ERROR_STREAM_CAPTURE_ISOLATION (a capturing stream waits on an event recorded outside the capture)");
    if (cap == capturing_.end() && ev.capture) {
      capturing_[k] = ev.capture;  // the stream joins the capture
    }
    if (cap != capturing_.end() && ev.capture == cap->second && ev.capture_stream != k)
      cap->second->rejoined[ev.capture_stream] = ev.capture_ops;
    StreamState& st = streams_[k];
    if (capturing_.count(k)) return;
    sim::join(st.vc, ev.vc);
    st.tail = std::max(st.tail, ev.time);
    st.waits += 1;
  }
  Stream stream_create() override { return stream_create_with_priority(kLeastPriority); }
  // As a GPU of compute capability 9: priorities 0 (least) to -5.
  static constexpr int kLeastPriority = 0;
  static constexpr int kGreatestPriority = -5;
  std::pair<int, int> stream_priority_range() override {
    Lock lock(mu_);
    need_context_locked("cuCtxGetStreamPriorityRange");
    return {kLeastPriority, kGreatestPriority};
  }
  Stream stream_create_with_priority(int priority) override {
    Lock lock(mu_);
    unsafe_in_capture_locked("cuStreamCreate");
    const int dev = need_context_locked("cuStreamCreate");
    const Stream s = 100 + ++next_stream_;
    created_[s] = dev;
    priority_[s] = std::clamp(priority, kGreatestPriority, kLeastPriority);
    return s;
  }
  // The priority `s` was created with (least for streams the sim did not create).
  int priority_of(Stream s) {
    Lock lock(mu_);
    auto it = priority_.find(s);
    return it == priority_.end() ? kLeastPriority : it->second;
  }
  void stream_destroy(Stream s) override {
    Lock lock(mu_);
    created_.erase(s);
    priority_.erase(s);
  }
  void stream_synchronize(Stream s) override {
    Lock lock(mu_);
    injected_locked("cuStreamSynchronize");
    unsafe_in_capture_locked("cuStreamSynchronize");
    const SKey k = key_locked(s, "cuStreamSynchronize");
    if (capturing_.count(k))  // in any capture mode, relaxed included
      fail_locked("cuStreamSynchronize", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (the stream is being captured)");
    StreamState& st = streams_[k];
    if (st.tail > host_) parks_.push_back({std::this_thread::get_id(), "cuStreamSynchronize"});
    host_waits_for_locked(st);
  }
  bool stream_is_capturing(Stream s) override {
    Lock lock(mu_);
    return capturing_.count(key_locked(s, "cuStreamIsCapturing")) != 0;
  }
  void relax_capture_mode() override {
    Lock lock(mu_);
    relaxed_.insert(thread_token());
  }
  // Relaxed or not is what the model knows of a thread's mode: global and
  // thread-local both forbid the unsafe calls (a capture on another thread
  // in thread-local mode is not modelled).
  int exchange_capture_mode(int mode) override {
    Lock lock(mu_);
    injected_locked("cuThreadExchangeStreamCaptureMode");
    const bool was = relaxed_.count(thread_token()) != 0;
    if (mode == mem::cuda::kCaptureModeRelaxed) relaxed_.insert(thread_token());
    else relaxed_.erase(thread_token());
    return was ? mem::cuda::kCaptureModeRelaxed : mem::cuda::kCaptureModeGlobal;
  }
  // Page-locking needs a current context; it succeeds unless a test refuses
  // it (as a container with a small RLIMIT_MEMLOCK would). Both calls are counted.
  bool host_register(void* p, size_t n) override {
    Lock lock(mu_);
    unsafe_in_capture_locked("cuMemHostRegister");
    need_context_locked("cuMemHostRegister");
    ++registers_;
    register_threads_.push_back(std::this_thread::get_id());
    if (allow_register) registered_[p] = n;
    return allow_register;
  }
  void host_unregister(void* p) override {
    Lock lock(mu_);
    unsafe_in_capture_locked("cuMemHostUnregister");
    need_context_locked("cuMemHostUnregister");
    if (!registered_.erase(p)) fail_locked("cuMemHostUnregister", "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED");
    ++unregisters_;
  }
  int device_count() override { return opts_.devices; }
  std::string device_name(int) override { return "sim"; }
  DevicePtr mem_alloc(size_t n) override {
    int dev = 0;
    {
      Lock lock(mu_);
      unsafe_in_capture_locked("cuMemAlloc");
      dev = need_context_locked("cuMemAlloc");
    }
    return alloc(n, 0, "cuMemAlloc", dev);
  }
  void mem_free(DevicePtr p) override { free(p); }

 private:
  using Lock = std::unique_lock<std::recursive_mutex>;
  using SKey = sim::SKey;
  using VC = sim::VC;
  using Access = sim::Access;

  using Capture = sim::Capture;
  using StreamState = sim::StreamState;
  using EventState = sim::EventState;
  using Block = sim::Block;

  // A thread's identity for its context and capture mode: unlike
  // std::thread::id, never reused by a later thread, which starts with no
  // context as on a real driver.
  static uint64_t thread_token() {
    static std::atomic<uint64_t> next{0};
    thread_local const uint64_t token = ++next;
    return token;
  }
  int current_locked() {
    auto it = current_.find(thread_token());
    return it == current_.end() ? -1 : it->second;
  }
  void make_current_locked(int d) {
    current_[thread_token()] = d;
    contexts_.insert(d);
  }
  struct Injection {
    std::string call;
    int times = 0;
    std::thread::id spare;
  };
  void injected_locked(const char* call) {
    if (inject_.times <= 0 || inject_.call != call || std::this_thread::get_id() == inject_.spare) return;
    inject_.times -= 1;
    fail_locked(call, "CUDA_ERROR_UNKNOWN (injected)");
  }
  [[noreturn]] void fail_locked(const char* call, const std::string& what) {
    std::string msg = detail::concat("sim ", call, ": ", what);
    errors_.push_back(msg);
    throw IoError(EIO, "", -1, msg);
  }
  int need_context_locked(const char* call) {
    const int d = current_locked();
    if (d < 0) fail_locked(call, "CUDA_ERROR_INVALID_CONTEXT (no context current on this thread)");
    return d;
  }
  // An event recorded inside a capture that is still under way is a node of
  // the graph, not a point in a stream: no mode lets the host query or wait
  // for it.
  void captured_event_locked(const EventState& ev, const char* call) {
    if (!ev.capture) return;
    for (const auto& [k, cap] : capturing_)
      if (cap == ev.capture)
        fail_locked(call, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (the event was recorded inside a capture under way)");
  }
  // Global-mode capture: a thread that did not relax its mode may not make
  // potentially unsafe calls while it, or any thread, captures.
  void unsafe_in_capture_locked(const char* call) {
    if (capturing_.empty() || relaxed_.count(thread_token())) return;
    fail_locked(call, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (a CUDA graph capture is under way)");
  }
  // A stream handle in the current context: 0 is the context's default
  // stream; a created stream must belong to it.
  SKey key_locked(Stream s, const char* call) {
    const int cur = current_locked();
    if (s == 0) {
      if (cur < 0) fail_locked(call, "CUDA_ERROR_INVALID_CONTEXT (the default stream with no context current)");
      return {cur, 0};
    }
    int dev = 0;
    if (auto it = created_.find(s); it != created_.end()) dev = it->second;
    else if (auto jt = declared_.find(s); jt != declared_.end()) dev = jt->second;
    if (cur >= 0 && cur != dev)
      fail_locked(call, detail::concat("CUDA_ERROR_INVALID_HANDLE (", sim::name({dev, s}), " used while device ", cur,
                                       "'s context is current)"));
    return {dev, s};
  }
  SKey test_key(Stream s, int device) {
    if (s == 0) return {device, 0};
    if (auto it = created_.find(s); it != created_.end()) return {it->second, s};
    if (auto jt = declared_.find(s); jt != declared_.end()) return {jt->second, s};
    return {device, s};
  }
  Event event_create_locked() {
    const int dev = need_context_locked("cuEventCreate");
    Event e = ++next_event_;
    events_[e].device = dev;
    return e;
  }
  EventState& event_locked(Event e, const char* call) {
    auto it = events_.find(e);
    if (it == events_.end()) fail_locked(call, detail::concat("CUDA_ERROR_INVALID_HANDLE (event ", e, ")"));
    return it->second;
  }
  Block* owner_of_locked(DevicePtr p) {
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) return nullptr;
    --it;
    Block& b = *it->second;
    return p < b.ptr + b.size ? &b : nullptr;
  }
  Block& block_of_locked(DevicePtr p) {
    Block* b = owner_of_locked(p);
    EBB_CHECK(b != nullptr, "sim: 0x", std::hex, p, " is not a block of the allocator model");
    return *b;
  }
  void check_accessors_locked(Block& b, const VC& point, const std::string& how) {
    for (const Access& a : b.accessors) {
      auto it = point.find(a.stream);
      if (it != point.end() && it->second >= a.seq) continue;
      races_.push_back(detail::concat("block '", b.label, "' (", b.size, " bytes on device ", b.device, ") ", how,
                                      " while ", a.what, " touching it is not ordered before that"));
    }
  }

  // An operation of `seconds` on stream `k`; returns {start, end}.
  std::pair<double, double> enqueue_locked(const SKey& k, double seconds, std::function<void()> effect, const char* what,
                                           double* engine = nullptr) {
    StreamState& st = streams_[k];
    sim::join(st.vc, host_vc_);
    auto cap = capturing_.find(k);
    if (cap != capturing_.end()) {  // captured: recorded into the graph, nothing runs
      cap->second->ops[k] += 1;
      captured_ops_ += 1;
      return {st.tail, st.tail};
    }
    const uint64_t seq = ++st.vc[k];
    double start = std::max(st.tail, host_);
    if (engine != nullptr) start = std::max(start, *engine);
    const double end = start + seconds;
    if (engine != nullptr) *engine = end;
    st.tail = end;
    last_seq_ = seq;
    if (effect) pending_.emplace(std::make_pair(end, ++order_), std::move(effect));
    (void)what;
    return {start, end};
  }

  void copy_locked(bool d2h, void* host, DevicePtr dev, size_t n, Stream s) {
    const char* call = d2h ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync";
    injected_locked(call);
    const int cur = need_context_locked(call);
    const SKey k = key_locked(s, call);
    Block* b = owner_of_locked(dev);
    if (b == nullptr && !opts_.foreign_pointers_are_device) fail_locked(call, "CUDA_ERROR_INVALID_VALUE (not device memory)");
    if (b != nullptr && b->device != cur)
      fail_locked(call, detail::concat("device memory of device ", b->device, " copied on device ", cur, "'s stream"));
    if (b != nullptr && (!b->mapped || dev + n > b->ptr + b->size))
      fail_locked(call, detail::concat("CUDA_ERROR_ILLEGAL_ADDRESS (block '", b->label, "' unmapped or overrun)"));
    if (b != nullptr && !b->in_use)
      races_.push_back(detail::concat("a ", d2h ? "device-to-host" : "host-to-device", " copy on ", sim::name(k),
                                      " touches block '", b->label, "' after it was freed"));
    double seconds = static_cast<double>(n) / (d2h ? opts_.d2h_bps : opts_.h2d_bps);
    if (opts_.seed != 0) seconds *= 1.0 + 2.0 * std::uniform_real_distribution<double>(0, 1)(rng_);
    seconds += opts_.copy_latency;
    auto pr = priority_.find(k.second);
    const bool high = pr != priority_.end() && pr->second < kLeastPriority;
    auto& engines = engines_[{k.first, high}];
    double& engine = d2h ? engines.first : engines.second;
    auto* dst = d2h ? static_cast<unsigned char*>(host) : reinterpret_cast<unsigned char*>(dev);
    const auto* src = d2h ? reinterpret_cast<const unsigned char*>(dev) : static_cast<const unsigned char*>(host);
    const bool captured = capturing_.count(k) != 0;
    auto [start, end] = enqueue_locked(k, seconds, [dst, src, n] { std::memmove(dst, src, n); }, call, &engine);
    if (captured) return;
    const uint64_t seq = last_seq_;
    const std::string what = detail::concat(d2h ? "device-to-host" : "host-to-device", " copy #", copies_.size() + 1,
                                            " of ", n, " bytes on ", sim::name(k));
    if (b != nullptr) b->accessors.push_back(Access{k, seq, what});
    host_accesses_.check(static_cast<const unsigned char*>(host), n, d2h, Access{k, seq, what}, streams_[k].vc, host_vc_,
                         races_);
    copies_.push_back(Copy{d2h, host, dev, n, s, start, end, k.first, seq});
  }


  // The host has waited for everything enqueued on a stream so far.
  void host_waits_for_locked(const StreamState& st) {
    sim::join(host_vc_, st.vc);
    advance_locked(std::max(host_, st.tail));
  }

  void advance_locked(double t) {
    host_ = std::max(host_, t);
    while (!pending_.empty() && pending_.begin()->first.first <= host_) {
      auto fn = std::move(pending_.begin()->second);
      pending_.erase(pending_.begin());
      fn();
    }
  }

  Options opts_;
  std::mt19937_64 rng_;
  std::recursive_mutex mu_;
  std::map<SKey, StreamState> streams_;
  std::map<Event, EventState> events_;
  std::map<Stream, int> created_;
  std::map<Stream, int> declared_;
  std::map<uint64_t, int> current_;  // by thread_token()
  std::set<uint64_t> relaxed_;
  // Per device and priority class (above the least or not): d2h, h2d engines free at.
  std::map<std::pair<int, bool>, std::pair<double, double>> engines_;
  std::map<Stream, int> priority_;  // created streams' priorities
  std::multimap<std::pair<double, uint64_t>, std::function<void()>> pending_;
  uint64_t order_ = 0;
  uint64_t last_seq_ = 0;
  VC host_vc_;
  double host_ = 0;
  std::vector<Copy> copies_;
  std::map<DevicePtr, std::unique_ptr<Block>> blocks_;
  std::vector<DevicePtr> free_;
  std::map<SKey, std::shared_ptr<Capture>> capturing_;
  uint64_t captured_ops_ = 0;
  std::map<void*, size_t> registered_;
  int registers_ = 0;
  int unregisters_ = 0;
  std::vector<std::thread::id> register_threads_;
  std::set<int> contexts_;
  std::vector<Park> parks_;
  std::vector<std::string> races_;
  sim::HostAccesses host_accesses_;
  std::vector<std::string> errors_;
  Injection inject_;
  Event next_event_ = 0;
  Stream next_stream_ = 0;
};

// A simulated driver with two devices.
inline SimDriver::Options two_devices() {
  SimDriver::Options o;
  o.devices = 2;
  return o;
}

// The compute stream the cache tests pass to unpack and launch on.
inline constexpr mem::cuda::Stream kCompute = 7;

}  // namespace ebbtide::test
