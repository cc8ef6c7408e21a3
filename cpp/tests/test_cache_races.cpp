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

#include "cache_race_fixtures.hpp"
#include "ebbtide/cache/store.hpp"
#include "ebbtide/cache/tensor_cache.hpp"
#include "sim_driver.hpp"
#include "test_utils.hpp"

namespace ebbtide::cache {
namespace {

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

}  // namespace
}  // namespace ebbtide::cache
