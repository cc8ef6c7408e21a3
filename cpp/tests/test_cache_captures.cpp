// The tensor cache against the simulated GPU (Note [Simulated GPU]) while
// CUDA graphs are captured (Note [Graph capture], Note [Queries during a
// capture]) and with copies on two devices (Note [Release points on several
// devices]): each test stages one way a capture or a second device breaks a
// careless stream-ordered program, and checks that no race is found, that the
// bytes a kernel reads are the right ones, and that no driver call was
// illegal. The fixtures are cache_race_fixtures.hpp's, as in
// test_cache_races.cpp.
#include <gtest/gtest.h>

#include <climits>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cache_race_fixtures.hpp"
#include "ebbtide/cache/store.hpp"
#include "ebbtide/cache/tensor_cache.hpp"
#include "sim_driver.hpp"
#include "test_utils.hpp"

namespace ebbtide::cache {
namespace {

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
