// The tensor cache's device path against the hostile simulated GPU (Note
// [Simulated GPU]): each test stages one way a careless stream-ordered
// program corrupts memory on real hardware (issue 28's findings) and checks
// that the simulator's allocator model finds no race, that the bytes a
// kernel reads are the right ones, and that no driver call was illegal.
// The test plays the glue: saved tensors and reload buffers are blocks of the
// simulator's caching allocator, owned by glue objects whose deleters free
// them (on the thread that drops them, as torch's would).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/cache/tensor_cache.hpp"
#include "gated_ssd.hpp"
#include "sim_driver.hpp"
#include "test_utils.hpp"

namespace ebbtide::cache {
namespace {

using test::GatedSsd;
using test::SimDriver;
using DevicePtr = mem::cuda::DevicePtr;
using test::kCompute;
constexpr mem::cuda::Stream kSide = 9;
constexpr uint64_t kBytes = 1 << 20;

// The glue's side: allocations of the simulator's allocator held by glue
// objects, kernels that write and check them.
struct Glue {
  SimDriver& drv;
  int device = 0;
  std::atomic<int> freed{0};

  // A block of `n` bytes on `stream` owned by the returned object; dropping
  // the object frees it on the dropping thread.
  GlueObj block(DevicePtr& out, uint64_t n, mem::cuda::Stream stream, const std::string& label) {
    out = drv.alloc(n, stream, label, device);
    const DevicePtr p = out;
    return GlueObj(new int(0), [this, p](void* q) {
      delete static_cast<int*>(q);
      drv.free(p);
      freed += 1;
    });
  }
  // A kernel on `stream` writing `data` into `p`.
  void write(mem::cuda::Stream stream, DevicePtr p, const std::vector<unsigned char>& data, double seconds = 1e-4) {
    auto src = std::make_shared<std::vector<unsigned char>>(data);
    drv.launch(stream, seconds, [p, src] { std::memcpy(reinterpret_cast<void*>(p), src->data(), src->size()); },
               device);
  }
  // A kernel on `stream` that reads `p` and records whether it held `want`.
  void check(mem::cuda::Stream stream, DevicePtr p, const std::vector<unsigned char>& want, bool& ok) {
    const unsigned char* w = want.data();
    const size_t n = want.size();
    ok = false;
    drv.launch(stream, 1e-5, [p, w, n, &ok] { ok = std::memcmp(reinterpret_cast<const void*>(p), w, n) == 0; }, device);
  }
};

SaveRequest device_request(DevicePtr p, uint64_t key, mem::cuda::Stream stream, GlueObj live, int device = 0,
                           int tier = kTierFirst) {
  SaveRequest r;
  r.key = key;
  r.src = {reinterpret_cast<void*>(p), kBytes, device, stream};
  r.live = std::move(live);
  r.tier = tier;
  return r;
}

std::unique_ptr<TensorCache> host_cache(SimDriver& drv, unsigned workers = 1) {
  HostStoreOptions ho;
  ho.driver = &drv;
  CacheOptions co;
  co.driver = &drv;
  co.workers = workers;
  co.device_inflight_bytes = 0;
  co.prefetch_window_bytes = 64 * kBytes;
  return std::make_unique<TensorCache>(make_host_store(ho), co);
}

std::unique_ptr<TensorCache> ssd_cache(SimDriver& drv, test::Gate& gate, unsigned workers = 1) {
  CacheOptions co;
  co.driver = &drv;
  co.workers = workers;
  co.device_inflight_bytes = 0;
  co.prefetch_window_bytes = 64 * kBytes;
  return std::make_unique<TensorCache>(std::make_unique<GatedSsd>(gate), co);
}

// A link slow enough that every copy outlasts the kernels around it.
SimDriver::Options slow_link(int devices = 1) {
  SimDriver::Options o;
  o.devices = devices;
  o.d2h_bps = 1e8;  // 1 MiB: ~10 ms
  o.h2d_bps = 1e8;
  return o;
}

// No race, and no driver error but the ones a test injected.
void expect_clean(SimDriver& drv) {
  drv.synchronize_all();
  EXPECT_TRUE(drv.races().empty()) << SimDriver::join_lines(drv.races());
  std::vector<std::string> errors;
  for (auto& e : drv.errors())
    if (e.find("(injected)") == std::string::npos) errors.push_back(e);
  EXPECT_TRUE(errors.empty()) << SimDriver::join_lines(errors);
}

// Runs `fn` on another thread and fails (instead of hanging) when it does not
// return: a deadlock watchdog, never a timing assertion on the passing path.
template <class F>
void returns_without_waiting_for_the_gate(test::Gate& gate, F fn) {
  auto f = std::async(std::launch::async, fn);
  const bool returned = f.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  if (!returned) gate.set_open(true);  // let it finish, then fail
  f.get();
  EXPECT_TRUE(returned) << "the call waited for a worker's I/O (the gate is closed)";
}

// Saves one device tensor written by a kernel on `stream`, releases its copy
// and drops the tensor (the glue's ack). Returns the entry.
// Saves one device tensor allocated on `stream` and written there by a kernel
// (its block's address in `*at` when given); the glue holds it until released.
SaveResult save_one(Glue& g, TensorCache& c, const std::vector<unsigned char>& data, mem::cuda::Stream stream,
                    uint64_t key, int tier = kTierFirst, DevicePtr* at = nullptr) {
  DevicePtr act = 0;
  GlueObj live = g.block(act, kBytes, stream, "activation " + std::to_string(key));
  g.write(stream, act, data);
  if (at != nullptr) *at = act;
  return c.save(device_request(act, key, stream, std::move(live), g.device, tier));
}

EntryId offload_one(Glue& g, TensorCache& c, const std::vector<unsigned char>& data, mem::cuda::Stream stream,
                    uint64_t key, int tier = kTierFirst) {
  SaveResult res = save_one(g, c, data, stream, key, tier);
  EXPECT_TRUE(res.offloaded);
  c.release_copies(0, INT64_MAX, stream);
  for (auto& done : c.poll()) done.live.reset();  // the glue drops the tensor
  return res.id;
}

// Finding 1: a reload buffer whose host-to-device copy no unpack waited for is
// dropped (the graph died after phase("backward") prefetched it, the unpack
// used the original, the step's backward raised). Its stream must wait for
// the copy before the caching allocator hands the block out again.
enum class Drop { kRelease, kOriginal, kReleaseStep, kReuse };
class ReloadBufferDrop : public ::testing::TestWithParam<Drop> {};

TEST_P(ReloadBufferDrop, IsOrderedAfterItsCopy) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  const auto data = test::random_bytes(kBytes, 1);
  const EntryId id = offload_one(g, *c, data, kCompute, 1);
  ASSERT_EQ(g.freed, 1) << "the activation was dropped at its release";
  DevicePtr buf = 0;
  {
    GlueObj owner = g.block(buf, kBytes, kCompute, "reload buffer of entry " + std::to_string(id));
    c->start_loads({id}, {{static_cast<uintptr_t>(buf), owner}}, kCompute);  // phase("backward") prefetched it
  }
  switch (GetParam()) {
    case Drop::kRelease: EXPECT_TRUE(c->release(id)); break;
    case Drop::kOriginal: {
      Unpacked u = c->unpack(id, kCompute, -1, /*have_original=*/true);
      EXPECT_EQ(u.kind, Unpacked::Kind::kLive);
      break;
    }
    case Drop::kReleaseStep: EXPECT_EQ(c->release_step(c->current_step()).size(), 1u); break;
    case Drop::kReuse: c->reuse(id); break;
  }
  ASSERT_EQ(g.freed, 2) << "the core dropped the reload buffer";
  // The next allocation of the compute stream gets the block at once.
  DevicePtr next = drv.alloc(kBytes, kCompute, "next activation");
  EXPECT_EQ(next, buf) << "the allocator model reuses the freed block";
  const auto fresh = test::random_bytes(kBytes, 2);
  g.write(kCompute, next, fresh);
  bool ok = false;
  g.check(kCompute, next, fresh, ok);
  expect_clean(drv);
  EXPECT_TRUE(ok) << "the late reload overwrote the next tensor";
  if (GetParam() != Drop::kRelease && GetParam() != Drop::kReleaseStep) c->release(id);
  c->close();
}

INSTANTIATE_TEST_SUITE_P(Ways, ReloadBufferDrop,
                         ::testing::Values(Drop::kRelease, Drop::kOriginal, Drop::kReleaseStep, Drop::kReuse),
                         [](const auto& info) {
                           switch (info.param) {
                             case Drop::kRelease: return std::string("Release");
                             case Drop::kOriginal: return std::string("AnsweredFromTheOriginal");
                             case Drop::kReleaseStep: return std::string("ReleaseStep");
                             case Drop::kReuse: return std::string("Reuse");
                           }
                           return std::string("?");
                         });

// Finding 2: the forward ran on a side stream (make_graphed_callables' warmup,
// a user's stream), so its tensors are freed to the side stream's pool. The
// release point on the glue's current stream must also make the side stream
// wait for the copies, or its next allocation overwrites what they read.
TEST(CacheRaces, SavesOnASideStreamAreReleasedOnThatStream) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  const auto data = test::random_bytes(kBytes, 3);
  DevicePtr act = 0;
  SaveResult res = save_one(g, *c, data, kSide, 3, kTierFirst, &act);
  c->release_copies(0, INT64_MAX, kCompute);  // the glue's current stream is the default one
  for (auto& done : c->poll()) done.live.reset();
  ASSERT_EQ(g.freed, 1);
  DevicePtr next = drv.alloc(kBytes, kSide, "next activation on the side stream");
  ASSERT_EQ(next, act);
  g.write(kSide, next, test::random_bytes(kBytes, 4));
  // Backward reloads it and reads it.
  DevicePtr buf = 0;
  GlueObj owner = g.block(buf, kBytes, kCompute, "reload buffer");
  ASSERT_EQ(c->request(res.id), Reload::kNeedBuffer);
  c->start_load(res.id, reinterpret_cast<void*>(buf), kCompute, owner);
  c->wait(res.id, kCompute);
  bool ok = false;
  g.check(kCompute, buf, data, ok);
  c->consume(res.id);
  owner.reset();
  c->release(res.id);
  expect_clean(drv);
  EXPECT_TRUE(ok) << "the copy read the side stream's next tensor";
  c->close();
}

// Finding 3: the graph died during forward, before the entry's release
// point: its tensor is dropped while its copy may not have run. Its stream
// waits for the copy first, so neither the next allocation nor an unmap by
// empty_cache() with expandable segments (which synchronises only that
// stream) can pull the memory from under the copy.
class UnreleasedErase : public ::testing::TestWithParam<bool> {};

TEST_P(UnreleasedErase, WaitsForTheCopyOnTheTensorsStream) {
  const bool expandable = GetParam();
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  const auto data = test::random_bytes(kBytes, 5);
  DevicePtr act = 0;
  SaveResult res = save_one(g, *c, data, kCompute, 5, kTierFirst, &act);  // its graph dies in forward
  EXPECT_EQ(g.freed, 0) << "held until its release point";
  EXPECT_TRUE(c->release(res.id));
  EXPECT_EQ(g.freed, 1) << "the core dropped the tensor";
  if (expandable) {
    drv.empty_cache(0, /*expandable_segments=*/true);
  } else {
    DevicePtr next = drv.alloc(kBytes, kCompute, "next activation");
    ASSERT_EQ(next, act);
    g.write(kCompute, next, test::random_bytes(kBytes, 6));
  }
  expect_clean(drv);
  c->close();
}

INSTANTIATE_TEST_SUITE_P(Ways, UnreleasedErase, ::testing::Bool(), [](const auto& info) {
  return std::string(info.param ? "EmptyCacheWithExpandableSegments" : "NextAllocation");
});

// Finding 3, worker path (a blob that could not be page-locked): a device
// entry forwarded and released while its worker still copies it keeps its
// tensor until the copy ended; the release itself does not wait (finding 6).
TEST(CacheRaces, AbandonedWorkerStoreKeepsItsTensorUntilTheCopyEnds) {
  SimDriver drv(1e9, 1e9);
  drv.allow_register = false;  // the worker path
  test::Gate gate;
  HostStoreOptions ho;
  ho.driver = &drv;
  // The worker's put, held at the gate: a long store.
  struct Gated final : Store {
    std::unique_ptr<Store> inner;
    test::Gate& gate;
    Gated(std::unique_ptr<Store> s, test::Gate& g) : inner(std::move(s)), gate(g) {}
    Location put(const mem::Buffer& src, int tier) override {
      gate.pass();
      return inner->put(src, tier);
    }
    void get(Location loc, const mem::Buffer& dst) override { inner->get(loc, dst); }
    void free(Location loc) override { inner->free(loc); }
    StoreStats stats() const override { return inner->stats(); }
    std::string describe() const override { return "gated host"; }
    HostSpace reserve_host(uint64_t n) override { return inner->reserve_host(n); }
    bool has_tier(int t) const override { return inner->has_tier(t); }
    int tier_of(Location l) const override { return inner->tier_of(l); }
  };
  CacheOptions co;
  co.driver = &drv;
  co.workers = 1;
  auto c = std::make_unique<TensorCache>(std::make_unique<Gated>(make_host_store(ho), gate), co);
  Glue g{drv};
  drv.bind_device(0);  // the training thread has used the device
  c->begin_step();
  gate.set_open(false);
  DevicePtr act = 0;
  GlueObj live = g.block(act, kBytes, kCompute, "activation stored by a worker");
  SaveResult res = c->save(device_request(act, 7, kCompute, std::move(live)));
  gate.wait_started(1);  // the worker is copying it
  Unpacked u = c->unpack(res.id, kCompute);  // backward came first: forwarded
  EXPECT_EQ(u.kind, Unpacked::Kind::kLive);
  u = Unpacked{};
  returns_without_waiting_for_the_gate(gate, [&] { EXPECT_TRUE(c->release(res.id)); });
  EXPECT_EQ(g.freed, 0) << "the tensor was dropped while the worker still copies it";
  gate.set_open(true);
  c->drain();
  EXPECT_EQ(g.freed, 1) << "dropped once the copy ended";
  EXPECT_EQ(c->stats().store.blobs, 0u);
  EXPECT_EQ(c->stats().step.bytes_discarded, kBytes);
  c->close();
}

// Finding 6: backward releases an entry whose SSD write runs: no wait.
TEST(CacheRaces, ReleaseDuringASpillDoesNotWaitForTheWrite) {
  SimDriver drv(1e9, 1e9);
  test::Gate gate;
  auto c = ssd_cache(drv, gate);
  Glue g{drv};
  c->begin_step();
  gate.set_open(false);
  const EntryId res_id = offload_one(g, *c, test::random_bytes(kBytes, 8), kCompute, 8, kTierSsd);
  drv.advance_host(1.0);  // the copy into the bounce blob ran
  gate.wait_started(1);   // the spill is writing
  returns_without_waiting_for_the_gate(gate, [&] { EXPECT_TRUE(c->release(res_id)); });
  gate.set_open(true);
  c->drain();
  EXPECT_EQ(c->stats().store.blobs, 0u) << "the abandoned spill's space is freed";
  EXPECT_EQ(c->stats().step.bytes_discarded, kBytes);
  expect_clean(drv);
  c->close();
}

// Finding 6: a worker never parks on a copy the device has not reached (it
// would spin there behind the compute stream while loads queue up): spills
// are taken once a query finds their copy done.
TEST(CacheRaces, WorkersNeverParkOnUnfinishedCopies) {
  SimDriver drv(slow_link());
  test::Gate gate;
  auto c = ssd_cache(drv, gate);
  Glue g{drv};
  c->begin_step();
  std::vector<std::vector<unsigned char>> data;
  std::vector<EntryId> ids;
  for (uint64_t k = 0; k < 3; ++k) {
    data.push_back(test::random_bytes(kBytes, 10 + k));
    ids.push_back(save_one(g, *c, data.back(), kCompute, 10 + k, kTierSsd).id);
  }
  c->release_copies(0, INT64_MAX, kCompute);
  for (auto& done : c->poll()) done.live.reset();
  c->drain();  // synchronises the copy stream first, then the spills run
  EXPECT_EQ(c->stats().store.blobs, 3u);
  // Backward: reloads from the SSD through bounce blobs.
  for (size_t i = 0; i < ids.size(); ++i) {
    DevicePtr buf = 0;
    GlueObj owner = g.block(buf, kBytes, kCompute, "reload buffer");
    ASSERT_EQ(c->request(ids[i]), Reload::kNeedBuffer);
    c->start_load(ids[i], reinterpret_cast<void*>(buf), kCompute, owner);
    c->wait(ids[i], kCompute);
    bool ok = false;
    g.check(kCompute, buf, data[i], ok);
    c->consume(ids[i]);
    owner.reset();
    c->release(ids[i]);
    drv.synchronize_all();
    EXPECT_TRUE(ok) << "entry " << ids[i];
  }
  for (const auto& p : drv.parks())
    EXPECT_EQ(p.thread, std::this_thread::get_id()) << "a worker parked in " << p.call;
  expect_clean(drv);
  c->close();
}

// Finding 4: inside a CUDA graph capture the cache steps aside: the tensor
// stays resident, and nothing illegal during a capture is called (queries,
// host registration, stream creation, waits on events from outside it).
TEST(CacheRaces, SavesDuringGraphCaptureStayResident) {
  SimDriver drv(1e9, 1e9);
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  // A copy from before the capture is still held when the capture begins.
  DevicePtr before = 0;
  GlueObj live0 = g.block(before, kBytes, kCompute, "activation before the capture");
  SaveResult r0 = c->save(device_request(before, 20, kCompute, std::move(live0)));
  drv.begin_capture(kCompute);
  DevicePtr act = 0;
  GlueObj live = g.block(act, kBytes, kCompute, "activation in the capture");
  SaveResult r1 = c->save(device_request(act, 21, kCompute, live));
  EXPECT_FALSE(r1.offloaded);
  EXPECT_EQ(c->state(r1.id), EntryState::kKept);
  c->release_copies(0, INT64_MAX, kCompute);  // a block's release point inside the capture
  EXPECT_TRUE(c->poll().empty()) << "nothing released inside the capture";
  Unpacked u = c->unpack(r1.id, kCompute);
  EXPECT_EQ(u.kind, Unpacked::Kind::kLive);
  u = Unpacked{};
  drv.end_capture(kCompute);
  EXPECT_EQ(c->stats().step.tensors_in_capture, 1u);
  EXPECT_EQ(drv.captured_ops(), 0u) << "the cache enqueued nothing into the graph";
  c->release_copies(0, INT64_MAX, kCompute);  // outside the capture again
  auto done = c->poll();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, r0.id);
  done.clear();
  live.reset();
  c->release(r0.id);
  c->release(r1.id);
  expect_clean(drv);
  c->close();
}

// Finding 4: a capture on the training thread (global mode) must not fail a
// worker's queries: workers relax their capture mode.
TEST(CacheRaces, WorkersKeepWorkingDuringACaptureElsewhere) {
  SimDriver drv(1e9, 1e9);
  test::Gate gate;
  auto c = ssd_cache(drv, gate);
  Glue g{drv};
  c->begin_step();
  c->pause_stores(true);
  const EntryId res_id = offload_one(g, *c, test::random_bytes(kBytes, 30), kCompute, 30, kTierSsd);
  drv.begin_capture(kSide);  // the training thread captures a graph on another stream
  drv.advance_host(1.0);
  c->pause_stores(false);
  // The worker finds the copy done and writes, or fails: during the capture.
  // (stats() makes no driver call; the loop ends on the outcome, not on time.)
  for (int i = 0; i < 600000; ++i) {
    const auto st = c->stats();
    if (st.store.blobs != 0 || st.step.store_failures != 0) break;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  drv.end_capture(kSide);
  c->drain();
  EXPECT_EQ(c->stats().step.store_failures, 0u);
  EXPECT_EQ(c->stats().store.blobs, 1u);
  c->release(res_id);
  expect_clean(drv);
  c->close();
}

// Finding 5: a cache on device 1 makes no context on device 0: not on the
// training thread, not on its workers (they bind the device before they pin
// a bounce blob), not when it reads its device waits, not at close.
TEST(CacheRaces, ACacheOnDeviceOneMakesNoContextOnDeviceZero) {
  SimDriver drv(slow_link(2));
  drv.declare_stream(kCompute, 1);
  test::Gate gate;
  auto c = ssd_cache(drv, gate, 2);
  Glue g{drv, 1};
  c->begin_step();
  const auto data = test::random_bytes(kBytes, 40);
  const EntryId res_id = offload_one(g, *c, data, kCompute, 40, kTierSsd);
  c->drain();
  DevicePtr buf = 0;
  GlueObj owner = g.block(buf, kBytes, kCompute, "reload buffer on device 1");
  ASSERT_EQ(c->request(res_id), Reload::kNeedBuffer);
  c->start_load(res_id, reinterpret_cast<void*>(buf), kCompute, owner);
  c->wait(res_id, kCompute);
  bool ok = false;
  g.check(kCompute, buf, data, ok);
  c->consume(res_id);
  owner.reset();
  c->release(res_id);
  drv.synchronize_all();
  // The reload's wait was timed on device 1 and is read there (Note [Device waits]).
  EXPECT_GT(c->stats().step.load_wait_seconds, 0.0);
  c->close();
  expect_clean(drv);
  EXPECT_TRUE(ok);
  EXPECT_EQ(drv.contexts(), std::set<int>{1});
}

// Finding 4, review: capturing a whole step after an eager one: begin_step
// inside the capture makes no driver call (the last step's fenced frees wait).
TEST(CacheRaces, BeginStepInsideACaptureMakesNoIllegalCall) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  SaveResult r = save_one(g, *c, test::random_bytes(kBytes, 50), kCompute, 50);
  c->release(r.id);  // its blob's free is fenced on the copy
  c->end_step();
  drv.begin_capture(kCompute);
  c->begin_step();
  drv.end_capture(kCompute);
  expect_clean(drv);
  c->close();
}

// Finding 4, review: an entry prefetched before a capture and unpacked inside
// it is refused with a clear error, and no illegal wait reaches the driver.
TEST(CacheRaces, UnpackOfAPrefetchedEntryInsideACaptureIsRefusedCleanly) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  const EntryId id = offload_one(g, *c, test::random_bytes(kBytes, 51), kCompute, 51);
  DevicePtr buf = 0;
  {
    GlueObj owner = g.block(buf, kBytes, kCompute, "reload buffer");
    c->start_loads({id}, {{static_cast<uintptr_t>(buf), owner}}, kCompute);
  }
  drv.begin_capture(kCompute);
  EXPECT_THROW(c->unpack(id, kCompute), StateError);
  EXPECT_THROW(c->wait(id, kCompute), StateError);
  drv.end_capture(kCompute);
  c->release(id);
  expect_clean(drv);
  c->close();
}

// A reload started inside a capture is refused before the entry takes the
// buffer: the caller's buffer is freed when the caller drops it, and a
// reload after the capture loads into a new one.
TEST(CacheRaces, AReloadRefusedInACaptureLeavesTheBufferToTheCaller) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  const auto data = test::random_bytes(kBytes, 58);
  const EntryId id = offload_one(g, *c, data, kCompute, 58);
  const int freed = g.freed;
  drv.begin_capture(kCompute);
  {
    DevicePtr buf = 0;
    GlueObj owner = g.block(buf, kBytes, kCompute, "refused reload buffer");
    EXPECT_THROW(c->start_load(id, reinterpret_cast<void*>(buf), kCompute, std::move(owner)), StateError);
  }
  EXPECT_EQ(g.freed, freed + 1) << "the entry kept the buffer of a refused load";
  EXPECT_NO_THROW(drv.end_capture(kCompute)) << SimDriver::join_lines(drv.errors());
  DevicePtr buf = 0;
  GlueObj owner = g.block(buf, kBytes, kCompute, "reload buffer");
  c->start_load(id, reinterpret_cast<void*>(buf), kCompute, std::move(owner));
  c->wait(id, kCompute);
  bool ok = false;
  g.check(kCompute, buf, data, ok);
  drv.synchronize_all();
  EXPECT_TRUE(ok);
  c->release(id);
  expect_clean(drv);
  c->close();
}

// Finding 2, review: a release point that cannot wait for a producing stream
// (it is being captured) releases nothing: no tensor is dropped unordered.
TEST(CacheRaces, AReleasePointThatCannotWaitReleasesNothing) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  SaveResult r = save_one(g, *c, test::random_bytes(kBytes, 52), kSide, 52);
  drv.begin_capture(kSide);
  c->release_copies(0, INT64_MAX, kCompute);
  drv.end_capture(kSide);
  EXPECT_TRUE(c->poll().empty()) << "released without the side stream waiting";
  // An injected failure of the wait itself: nothing released either.
  drv.inject_failure("cuStreamWaitEvent");
  EXPECT_ANY_THROW(c->release_copies(0, INT64_MAX, kCompute));
  EXPECT_TRUE(c->poll().empty());
  c->release_copies(0, INT64_MAX, kCompute);
  auto done = c->poll();
  ASSERT_EQ(done.size(), 1u);
  done.clear();
  EXPECT_EQ(g.freed, 1);
  DevicePtr next = drv.alloc(kBytes, kSide, "next activation on the side stream");
  g.write(kSide, next, test::random_bytes(kBytes, 53));
  c->release(r.id);
  expect_clean(drv);
  c->close();
}

// Finding 4, review: a cache closed inside a capture (the last handle of an
// offload() block died there) frees nothing a copy may still touch, and
// makes no illegal call but the one that tells it so.
TEST(CacheRaces, CloseDuringACaptureFreesNothingACopyMayTouch) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  save_one(g, *c, test::random_bytes(kBytes, 54), kCompute, 54);
  c->release_copies(0, INT64_MAX, kCompute);
  for (auto& d : c->poll()) d.live.reset();
  drv.begin_capture(kSide);
  c->close();
  EXPECT_ANY_THROW(drv.end_capture(kSide)) << "the close's synchronisation invalidates the capture";
  drv.synchronize_all();  // the copy lands in memory that must still be there
  EXPECT_TRUE(drv.races().empty()) << SimDriver::join_lines(drv.races());
  EXPECT_EQ(c->stats().store.bytes_held, kBytes) << "the host copy is held, not freed under the copy";
}

// Review: error paths after a copy was enqueued free nothing under it: an SSD
// reload whose completion event cannot be recorded.
TEST(CacheRaces, AFailedReloadFreesNothingItsCopyTouches) {
  SimDriver drv(slow_link());
  test::Gate gate;
  auto c = ssd_cache(drv, gate);
  Glue g{drv};
  c->begin_step();
  const EntryId r_id = offload_one(g, *c, test::random_bytes(kBytes, 55), kCompute, 55, kTierSsd);
  c->drain();
  drv.inject_failure("cuEventRecord", 1, std::this_thread::get_id());  // the worker's record fails
  DevicePtr buf = 0;
  {
    GlueObj owner = g.block(buf, kBytes, kCompute, "reload buffer");
    ASSERT_EQ(c->request(r_id), Reload::kNeedBuffer);
    c->start_load(r_id, reinterpret_cast<void*>(buf), kCompute, owner);
  }
  EXPECT_ANY_THROW(c->wait(r_id, kCompute));  // the load's error, whenever the worker failed
  EXPECT_EQ(c->state(r_id), EntryState::kStored);
  c->release(r_id);  // drops the reload buffer
  EXPECT_EQ(g.freed, 2);
  DevicePtr next = drv.alloc(kBytes, kCompute, "next activation");
  g.write(kCompute, next, test::random_bytes(kBytes, 56));
  expect_clean(drv);
  c->close();
}

// Note [Priority loads], review: a prefetched reload's buffer whose drop was
// deferred (the unpack answered from the original inside a capture) is
// freed after the capture once its stream passed that load's event. A
// second load of the entry, on demand on the priority stream, must not
// re-record that event: its completion does not imply the first load's,
// which runs on the other stream and may still write the buffer, nor may
// the fence of the blob both read: the second load waits for the first.
TEST(CacheRaces, ADeferredReloadBufferWaitsForItsOwnLoadNotALaterOne) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  const auto d1 = test::random_bytes(kBytes, 60), d2 = test::random_bytes(kBytes, 61);
  const EntryId e1 = offload_one(g, *c, d1, kCompute, 60);
  const EntryId e2 = offload_one(g, *c, d2, kCompute, 61);
  DevicePtr b1 = 0;
  {
    // Prefetched behind e2's load: e1's load runs late on the load stream.
    DevicePtr b2 = 0;
    GlueObj o2 = g.block(b2, kBytes, kCompute, "reload buffer of entry 2");
    GlueObj o1 = g.block(b1, kBytes, kCompute, "reload buffer of entry 1");
    c->start_loads({e2, e1}, {{static_cast<uintptr_t>(b2), o2}, {static_cast<uintptr_t>(b1), o1}}, kCompute);
  }
  drv.begin_capture(kCompute);
  Unpacked u = c->unpack(e1, kCompute, -1, /*have_original=*/true);  // no wait possible: deferred drop
  EXPECT_EQ(u.kind, Unpacked::Kind::kLive);
  u = Unpacked{};
  drv.end_capture(kCompute);
  // A retained graph's next backward loads e1 on demand (the priority stream).
  DevicePtr b1_again = 0;
  {
    GlueObj owner = g.block(b1_again, kBytes, kCompute, "second reload buffer of entry 1");
    ASSERT_EQ(c->request(e1), Reload::kNeedBuffer);
    c->start_load(e1, reinterpret_cast<void*>(b1_again), kCompute, owner);
  }
  c->release_copies(0, INT64_MAX, kCompute);  // a call outside the capture: the deferred drop goes
  EXPECT_EQ(g.freed, 3) << "the first buffer of entry 1 was dropped";
  DevicePtr next = drv.alloc(kBytes, kCompute, "next activation");
  EXPECT_EQ(next, b1);
  g.write(kCompute, next, test::random_bytes(kBytes, 62));
  c->wait(e1, kCompute);
  bool ok = false;
  g.check(kCompute, b1_again, d1, ok);
  c->consume(e1);
  // The entry goes: its host blob returns to the store once the host saw the
  // last load that read it done (a fenced free), and the next offload's copy
  // writes it; the first load must be done by then too.
  const auto blob = drv.copies().front().host;
  c->release(e1);
  drv.advance_host(drv.copies().back().end - drv.host_time());
  save_one(g, *c, test::random_bytes(kBytes, 63), kCompute, 63);
  EXPECT_EQ(drv.copies().back().host, blob) << "the next offload reuses entry 1's blob";
  c->release(e2);
  expect_clean(drv);
  EXPECT_TRUE(ok);
  c->close();
}

// Note [Device waits], review: stats() may run on another thread while the
// training thread captures a graph (global mode): reading the waits measured
// so far makes no call the capture forbids, and they are read.
TEST(CacheRaces, StatsDuringACaptureElsewhereMakeNoIllegalCall) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  SaveResult r = save_one(g, *c, test::random_bytes(kBytes, 64), kCompute, 64);
  c->release_copies(0, INT64_MAX, kCompute);  // waits for the copy: a timed wait
  for (auto& d : c->poll()) d.live.reset();
  drv.advance_host(1.0);  // the device passed it
  drv.begin_capture(kSide);
  double seen = -1;
  std::thread([&] { seen = c->stats().step.copy_wait_seconds; }).join();
  EXPECT_NO_THROW(drv.end_capture(kSide)) << SimDriver::join_lines(drv.errors());
  EXPECT_GT(seen, 0.0);
  c->release(r.id);
  expect_clean(drv);
  c->close();
}

// Note [One call per unpack]: an unpack that fails (its entry went with an
// aborted step) after taking the completions since the last call hands them
// back to the next call; it never drops their tensors itself. Dropped, the
// glue never compares their versions (Note [Torn snapshots]); dropped under
// the core's lock, the glue's deleter takes the interpreter's lock there
// (against a thread that holds it and waits for the core's, Note [Glue
// objects]), and a dying tensor may free its graph, whose handles release
// their entries (Handle::~Handle: the core's lock again, on this thread).
TEST(CacheRaces, AFailedUnpackHandsBackTheCompletionsItTook) {
  SimDriver drv(slow_link());
  Glue g{drv};
  auto c = host_cache(drv);
  c->begin_step();
  const EntryId other = save_one(g, *c, test::random_bytes(kBytes, 70), kCompute, 70).id;
  DevicePtr act = 0;
  GlueObj block = g.block(act, kBytes, kCompute, "activation 71");
  g.write(kCompute, act, test::random_bytes(kBytes, 71));
  bool in_call = false, dropped_in_call = false, released_other = false;
  GlueObj live(new int(0), [&, block](void* q) mutable {
    delete static_cast<int*>(q);
    if (in_call) {
      dropped_in_call = true;  // a release here would take the lock the call holds
    } else {
      released_other = c->release(other);  // its graph's handles go with it
    }
    block.reset();
  });
  block.reset();  // the tensor's object holds the block now
  const EntryId id = c->save(device_request(act, 71, kCompute, std::move(live))).id;
  c->release_copies(0, INT64_MAX, kCompute);  // both copies released: two completions wait for a call
  in_call = true;
  EXPECT_THROW(c->unpack(id + 100, kCompute), StateError);
  in_call = false;
  EXPECT_FALSE(dropped_in_call) << "a tensor the failed call took was destroyed inside it";
  std::vector<Completion> done = c->poll();
  ASSERT_EQ(done.size(), 2u) << "the completions the failed call took were lost";
  for (const auto& d : done) EXPECT_TRUE(d.ok && d.live) << "entry " << d.id;
  done.clear();  // the glue drops the tensors, outside any call
  EXPECT_TRUE(released_other);
  EXPECT_EQ(g.freed, 2);
  c->release(id);
  expect_clean(drv);
  c->close();
}

// Two simulated devices on a slow link; kOther is device 1's compute stream.
constexpr mem::cuda::Stream kOther = 11;
struct TwoDevices {
  TwoDevices() : drv(slow_link(/*devices=*/2)) { drv.declare_stream(kOther, 1); }
  SimDriver drv;
  Glue g0{drv, 0};
  Glue g1{drv, 1};
};

// Review: a release point with copies held on two devices (Note [Release
// points on several devices]). The compute stream belongs to one of them:
// only that device's lane makes it wait (an event of one device cannot be
// recorded on, or waited for in, another device's context); the other lane's
// copies are ordered before the stream its tensor was made on, so the next
// allocation there cannot overwrite what the copy still reads, and that wait
// is timed too. Without the device named the call refuses and releases
// nothing once the cache works on two devices, whichever devices its range
// reaches and whatever earlier points released; while the compute stream is
// captured no lane releases anything, nor queries an event.
TEST(CacheRaces, ReleasePointWithCopiesOnTwoDevices) {
  TwoDevices two;
  auto& [drv, g0, g1] = two;
  auto c = host_cache(drv);
  c->begin_step();
  DevicePtr a0 = 0, a1 = 0;
  const SaveResult r1 = save_one(g1, *c, test::random_bytes(kBytes, 81), kOther, 81, kTierFirst, &a1);
  const SaveResult r0 = save_one(g0, *c, test::random_bytes(kBytes, 80), kCompute, 80, kTierFirst, &a0);
  ASSERT_TRUE(r0.offloaded && r1.offloaded);
  EXPECT_THROW(c->release_copies(0, INT64_MAX, kCompute), InvalidArgument);
  EXPECT_THROW(c->release_copies(0, INT64_MAX, kCompute, kBytes), InvalidArgument) << "device 1's copy only";
  EXPECT_TRUE(c->poll().empty()) << "a refused release point released nothing";
  drv.begin_capture(kCompute, 0);
  c->release_copies(0, INT64_MAX, kCompute, UINT64_MAX, /*compute_device=*/0);
  EXPECT_TRUE(c->poll().empty()) << "released inside a capture";
  EXPECT_NO_THROW(drv.end_capture(kCompute, 0)) << SimDriver::join_lines(drv.errors());
  c->release_copies(0, INT64_MAX, kCompute, UINT64_MAX, /*compute_device=*/0);
  for (auto& d : c->poll()) d.live.reset();
  ASSERT_EQ(g0.freed, 1);
  ASSERT_EQ(g1.freed, 1);
  // Each device's next allocation on the stream the tensor was made on gets
  // its block back at once and writes it.
  DevicePtr n1 = drv.alloc(kBytes, kOther, "device 1's next activation", 1);
  ASSERT_EQ(n1, a1);
  g1.write(kOther, n1, test::random_bytes(kBytes, 82));
  DevicePtr n0 = drv.alloc(kBytes, kCompute, "device 0's next activation", 0);
  ASSERT_EQ(n0, a0);
  g0.write(kCompute, n0, test::random_bytes(kBytes, 83));
  EXPECT_GE(drv.waits_on(kCompute, 0), 1u) << "device 0's compute stream waited for its copy";
  EXPECT_GE(drv.waits_on(kOther, 1), 1u) << "device 1's stream waited for its copy";
  expect_clean(drv);
  const auto st = c->stats().step;
  EXPECT_EQ(st.copy_waits, 2u);
  // Simulated time: each copy of 1 MiB at 1e8 B/s takes ~10 ms on its own
  // device's engine, and both devices' waits are timed.
  EXPECT_GT(st.copy_wait_seconds, 1.5 * kBytes / 1e8);
  // Refused whatever earlier points released: only device 0 holds a copy now.
  const SaveResult r2 = save_one(g0, *c, test::random_bytes(kBytes, 84), kCompute, 84);
  EXPECT_THROW(c->release_copies(0, INT64_MAX, kCompute), InvalidArgument);
  c->release_copies(0, INT64_MAX, kCompute, UINT64_MAX, /*compute_device=*/0);
  for (auto& d : c->poll()) d.live.reset();
  EXPECT_EQ(g0.freed, 2);
  expect_clean(drv);
  for (EntryId id : {r0.id, r1.id, r2.id}) c->release(id);
  c->close();
}

// Note [Queries during a capture]: the training thread captures device 1's
// stream into a graph in global mode (torch.cuda.graph's default) while it
// saves, releases and polls on device 0. The cache's queries of its own
// events (recorded outside any capture) are then legal only in the relaxed
// mode; device 1's copy, whose stream is captured, stays held until the
// capture ends.
TEST(CacheRaces, DeviceZeroWorksWhileDeviceOneIsCaptured) {
  TwoDevices two;
  auto& [drv, g0, g1] = two;
  HostStoreOptions ho;
  ho.driver = &drv;
  CacheOptions co;
  co.driver = &drv;
  co.device_inflight_bytes = kBytes;  // a second save on device 0 bounds (queries) the first copy
  co.prefetch_window_bytes = 64 * kBytes;
  auto c = std::make_unique<TensorCache>(make_host_store(ho), co);
  c->begin_step();
  const SaveResult r1 = save_one(g1, *c, test::random_bytes(kBytes, 91), kOther, 91);
  ASSERT_TRUE(r1.offloaded);
  drv.begin_capture(kOther, 1);
  const SaveResult r0 = save_one(g0, *c, test::random_bytes(kBytes, 90), kCompute, 90);
  SaveResult r2 = save_one(g0, *c, test::random_bytes(kBytes, 92), kCompute, 92);
  ASSERT_TRUE(r0.offloaded && r2.offloaded);
  ASSERT_EQ(r2.done.size(), 1u) << "the bound released the first copy (an event query)";
  for (auto& d : r2.done) d.live.reset();
  c->release_copies(0, INT64_MAX, kCompute, UINT64_MAX, /*compute_device=*/0);
  for (auto& d : c->poll()) d.live.reset();
  EXPECT_EQ(g0.freed, 2) << "device 0's copies released during device 1's capture";
  EXPECT_EQ(g1.freed, 0) << "device 1's copy released while its stream is captured";
  (void)c->stats();
  EXPECT_NO_THROW(drv.end_capture(kOther, 1)) << SimDriver::join_lines(drv.errors());
  c->release_copies(0, INT64_MAX, kCompute, UINT64_MAX, /*compute_device=*/0);
  for (auto& d : c->poll()) d.live.reset();
  EXPECT_EQ(g1.freed, 1);
  DevicePtr n1 = drv.alloc(kBytes, kOther, "device 1's next activation", 1);
  g1.write(kOther, n1, test::random_bytes(kBytes, 93));
  expect_clean(drv);
  for (EntryId id : {r0.id, r1.id, r2.id}) c->release(id);
  c->close();
}

// Note [Queries during a capture], the backward: reloads, waits and a drain
// on device 0 while the same thread captures device 1's stream; after each
// call the thread's capture mode is global again.
TEST(CacheRaces, BackwardOnDeviceZeroWhileDeviceOneIsCaptured) {
  TwoDevices two;
  auto& [drv, g0, g1] = two;
  auto c = host_cache(drv);
  auto global = [&](const char* after) {
    EXPECT_EQ(drv.exchange_capture_mode(mem::cuda::kCaptureModeGlobal), mem::cuda::kCaptureModeGlobal)
        << "the mode was left relaxed by " << after;
  };
  c->begin_step();
  const SaveResult r1 = save_one(g1, *c, test::random_bytes(kBytes, 101), kOther, 101);
  const auto da = test::random_bytes(kBytes, 102);
  const auto db = test::random_bytes(kBytes, 103);
  const EntryId a = save_one(g0, *c, da, kCompute, 102).id;
  const EntryId b = save_one(g0, *c, db, kCompute, 103).id;
  c->release_copies(0, INT64_MAX, kCompute, UINT64_MAX, /*compute_device=*/0);
  for (auto& d : c->poll()) d.live.reset();
  drv.begin_capture(kOther, 1);
  Unpacked u = c->unpack(a, kCompute);
  global("unpack");
  ASSERT_EQ(u.kind, Unpacked::Kind::kNeedBuffer);
  DevicePtr buf_a = 0, buf_b = 0;
  GlueObj owner_a = g0.block(buf_a, kBytes, kCompute, "reload a");
  GlueObj owner_b = g0.block(buf_b, kBytes, kCompute, "reload b");
  c->start_load(a, reinterpret_cast<void*>(buf_a), kCompute, std::move(owner_a));
  global("start_load");
  u = c->unpack(a, kCompute);  // waits for the load (an event query)
  global("unpack");
  ASSERT_EQ(u.kind, Unpacked::Kind::kBuffer);
  bool ok_a = false, ok_b = false;
  g0.check(kCompute, buf_a, da, ok_a);  // while the unpacked buffer is held
  u = Unpacked{};
  c->start_load(b, reinterpret_cast<void*>(buf_b), kCompute, std::move(owner_b));
  c->wait(b, kCompute);
  global("wait");
  g0.check(kCompute, buf_b, db, ok_b);
  c->consume(b);
  c->release(a);
  c->release(b);
  c->drain();
  global("drain");
  EXPECT_NO_THROW(drv.end_capture(kOther, 1)) << SimDriver::join_lines(drv.errors());
  drv.synchronize_all();
  EXPECT_TRUE(ok_a) << "reload a";
  EXPECT_TRUE(ok_b) << "reload b";
  c->release_copies(0, INT64_MAX, kCompute, UINT64_MAX, /*compute_device=*/0);
  for (auto& d : c->poll()) d.live.reset();
  c->release(r1.id);
  expect_clean(drv);
  c->close();
}

}  // namespace
}  // namespace ebbtide::cache
