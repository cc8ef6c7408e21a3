// The seam between the glue and the core: glue objects the core keeps for an
// entry (Note [Glue objects]), host copies on the caller's thread (Note [Host
// copies on the caller]), one call per unpack (Note [One call per unpack]) and
// torn snapshots (Note [Torn snapshots]).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/cache/tensor_cache.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::cache {
namespace {

// A glue object that records where and how it died.
struct Probe {
  std::atomic<int> destroyed{0};
  std::atomic<bool> off_thread{false};
  std::thread::id owner = std::this_thread::get_id();
  TensorCache* cache = nullptr;  // when set, the deleter calls into it (takes its lock)
};

GlueObj probe_obj(Probe& p) {
  return GlueObj(new int(0), [&p](void* q) {
    delete static_cast<int*>(q);
    if (std::this_thread::get_id() != p.owner) p.off_thread = true;
    if (p.cache != nullptr) (void)p.cache->entry_count();  // would deadlock under the cache's lock
    p.destroyed += 1;
  });
}

SaveRequest host_request(const std::vector<unsigned char>& buf, uint64_t key) {
  SaveRequest r;
  r.key = key;
  r.version = 7;
  r.src = test::host_buffer(buf);
  return r;
}

std::vector<unsigned char> bytes_of(const Unpacked& u) {
  const auto* p = static_cast<const unsigned char*>(u.data);
  return {p, p + u.nbytes};
}

TEST(CacheGlue, SmallHostEntriesAreCopiedInSaveAndReloadedInUnpack) {
  TensorCache c(make_host_store(HostStoreOptions{}), CacheOptions{});
  c.begin_step();
  auto x = test::random_bytes(1000, 1);
  const auto want = x;
  auto live = std::make_shared<int>(0);
  SaveRequest r = host_request(x, 1);
  r.live = live;
  SaveResult res = c.save(r);
  r.live.reset();  // the request's copy
  EXPECT_TRUE(res.offloaded);
  EXPECT_EQ(c.state(res.id), EntryState::kStored) << "stored before save() returned, no worker";
  EXPECT_EQ(live.use_count(), 1) << "the cache does not hold a tensor it has copied";
  EXPECT_EQ(c.stats().resident_bytes, 0u);
  EXPECT_EQ(c.stats().store.blobs, 1u);
  std::memset(x.data(), 0, x.size());  // the snapshot was taken in save()
  Unpacked u = c.unpack(res.id, 0);
  ASSERT_EQ(u.kind, Unpacked::Kind::kBuffer);
  EXPECT_TRUE(u.host_buffer);
  EXPECT_EQ(bytes_of(u), want);
  EXPECT_EQ(c.state(res.id), EntryState::kStored) << "its only handle consumed it";
  EXPECT_EQ(c.stats().window_bytes, 0u);
  EXPECT_EQ(c.stats().step.tensors_reloaded, 1u);
  EXPECT_EQ(bytes_of(u), want) << "the buffer lives as long as the answer holds it";
  EXPECT_TRUE(c.release_handle(res.handle, res.id));
  EXPECT_EQ(c.stats().store.blobs, 0u);
}

TEST(CacheGlue, DedupedHandlesShareOneReloadBuffer) {
  TensorCache c(make_host_store(HostStoreOptions{}), CacheOptions{});
  c.begin_step();
  auto x = test::random_bytes(512, 2);
  SaveResult a = c.save(host_request(x, 1));
  SaveResult b = c.save(host_request(x, 1));
  ASSERT_EQ(a.id, b.id);
  Unpacked u1 = c.unpack(a.id, 0);
  EXPECT_EQ(c.state(a.id), EntryState::kLoaded) << "one more handle to unpack";
  Unpacked u2 = c.unpack(a.id, 0);
  EXPECT_EQ(u1.obj.get(), u2.obj.get());
  EXPECT_EQ(bytes_of(u2), x);
  EXPECT_EQ(c.state(a.id), EntryState::kStored);
  EXPECT_EQ(c.stats().step.tensors_reloaded, 1u);
}

TEST(CacheGlue, LargeHostStoresRunOnWorkersAndTheirCompletionReturnsTheTensor) {
  CacheOptions o;
  o.inline_copy_bytes = 100;
  TensorCache c(make_host_store(HostStoreOptions{}), o);
  c.begin_step();
  auto x = test::random_bytes(1000, 3);
  auto live = std::make_shared<int>(0);
  SaveRequest r = host_request(x, 1);
  r.live = live;
  SaveResult res = c.save(r);
  r.live.reset();  // the request's copy
  EXPECT_EQ(live.use_count(), 2) << "held until its store is done";
  c.drain();
  auto done = c.poll();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].ok);
  EXPECT_EQ(done[0].live.get(), live.get());
  EXPECT_EQ(done[0].version, 7u);
  done.clear();
  EXPECT_EQ(live.use_count(), 1);
  Unpacked u = c.unpack(res.id, 0);
  ASSERT_EQ(u.kind, Unpacked::Kind::kBuffer);
  EXPECT_EQ(bytes_of(u), x);
}

TEST(CacheGlue, UnpackAnswersFromTheTensorWhileItsStoreIsPending) {
  CacheOptions o;
  o.inline_copy_bytes = 0;
  TensorCache c(make_host_store(HostStoreOptions{}), o);
  c.begin_step();
  c.pause_stores(true);
  auto x = test::random_bytes(1000, 4);
  auto live = std::make_shared<int>(0);
  SaveRequest r = host_request(x, 1);
  r.live = live;
  SaveResult res = c.save(r);
  r.live.reset();  // the request's copy
  Unpacked u = c.unpack(res.id, 0);
  ASSERT_EQ(u.kind, Unpacked::Kind::kLive);
  EXPECT_EQ(u.obj.get(), live.get());
  EXPECT_EQ(c.state(res.id), EntryState::kForwarded);
  c.pause_stores(false);
  c.drain();
  EXPECT_EQ(c.stats().store.blobs, 0u) << "the cancelled store never ran";
}

TEST(CacheGlue, ATornSnapshotIsAnsweredFromTheTensorTheGlueGaveBack) {
  CacheOptions o;
  o.inline_copy_bytes = 0;
  TensorCache c(make_host_store(HostStoreOptions{}), o);
  c.begin_step();
  auto x = test::random_bytes(1000, 5);
  auto live = std::make_shared<int>(0);
  SaveRequest r = host_request(x, 1);
  r.live = live;
  SaveResult res = c.save(r);
  r.live.reset();  // the request's copy
  c.drain();
  auto done = c.poll();
  ASSERT_EQ(done.size(), 1u);
  c.hold_live(res.id, std::move(done[0].live));  // the glue saw a newer version
  Unpacked u = c.unpack(res.id, 0);
  ASSERT_EQ(u.kind, Unpacked::Kind::kLive) << "the glue's version check must see the tensor";
  EXPECT_EQ(u.obj.get(), live.get());
}

TEST(CacheGlue, PrefetchCandidatesCarryTheirOriginAndLoadIntoPoolBuffers) {
  CacheOptions o;
  o.inline_copy_bytes = 100;  // 1000-byte entries go through the workers and are prefetched
  TensorCache c(make_host_store(HostStoreOptions{}), o);
  c.begin_step();
  std::vector<std::vector<unsigned char>> xs;
  std::vector<SaveResult> res;
  std::vector<std::shared_ptr<int>> origs;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(test::random_bytes(1000, 10 + i));
    origs.push_back(std::make_shared<int>(i));
    SaveRequest r = host_request(xs.back(), 100 + i);
    r.orig = origs.back();
    res.push_back(c.save(r));
  }
  c.scope_end(0, 0);
  c.drain();
  c.poll();
  auto cands = c.prefetch_scope(0, 0);
  ASSERT_EQ(cands.size(), 3u);
  EXPECT_EQ(cands[0].id, res[2].id) << "reverse forward order";
  EXPECT_EQ(cands[0].orig.get(), origs[2].get());
  std::vector<EntryId> ids;
  for (const auto& cand : cands) ids.push_back(cand.id);
  c.start_loads(ids, {}, 0);
  for (int i = 2; i >= 0; --i) {
    Unpacked u = c.unpack(res[static_cast<size_t>(i)].id, 0);
    ASSERT_EQ(u.kind, Unpacked::Kind::kBuffer);
    EXPECT_EQ(bytes_of(u), xs[static_cast<size_t>(i)]);
  }
  EXPECT_EQ(c.stats().step.tensors_reloaded, 3u);
  EXPECT_EQ(c.stats().window_bytes, 0u);
}

TEST(CacheGlue, SmallHostEntriesAreNotPrefetched) {
  TensorCache c(make_host_store(HostStoreOptions{}), CacheOptions{});
  c.begin_step();
  auto x = test::random_bytes(1000, 20);
  c.save(host_request(x, 1));
  c.scope_end(0, 0);
  EXPECT_TRUE(c.prefetch_scope(0, 0).empty()) << "a copy at unpack costs less than a hand-off";
}

TEST(CacheGlue, ReusingAPrefetchedEntryFreesItsBuffer) {
  CacheOptions o;
  o.inline_copy_bytes = 0;
  TensorCache c(make_host_store(HostStoreOptions{}), o);
  c.begin_step();
  auto x = test::random_bytes(1000, 21);
  SaveResult res = c.save(host_request(x, 1));
  c.drain();
  c.poll();
  c.start_loads({res.id}, {}, 0);
  c.drain();
  EXPECT_EQ(c.stats().window_bytes, 1000u);
  EXPECT_FALSE(c.reuse(res.id)) << "its bytes were counted as reloaded";  // answered from the original after all
  EXPECT_EQ(c.state(res.id), EntryState::kStored);
  EXPECT_EQ(c.stats().window_bytes, 0u);
  const auto s = c.stats().step;
  EXPECT_EQ(s.bytes_reloaded + s.bytes_reused, s.bytes_offloaded);
}

TEST(CacheGlue, AHandleAnsweredFromItsOriginalAfterAReloadCountsEachByteOnce) {
  TensorCache c(make_host_store(HostStoreOptions{}), CacheOptions{});
  c.begin_step();
  auto x = test::random_bytes(1000, 22);
  SaveResult a = c.save(host_request(x, 1));
  SaveResult b = c.save(host_request(x, 1));  // a second view of the same storage
  ASSERT_EQ(a.id, b.id);
  Unpacked u1 = c.unpack(a.id, 0);  // its own tensor is gone: reloaded
  ASSERT_EQ(u1.kind, Unpacked::Kind::kBuffer);
  Unpacked u2 = c.unpack(b.id, 0, -1, /*have_original=*/true);  // this one's tensor is alive
  EXPECT_EQ(u2.kind, Unpacked::Kind::kLive);
  const auto s = c.stats().step;
  EXPECT_EQ(s.bytes_reloaded, 1000u);
  EXPECT_EQ(s.bytes_reused, 0u);
  EXPECT_EQ(c.state(a.id), EntryState::kStored);
}

TEST(CacheGlue, HandlesCopiedIntoTheirOwnBuffersCountOneReloadPerBackward) {
  TensorCache c(make_host_store(HostStoreOptions{}), CacheOptions{});
  c.begin_step();
  auto x = test::random_bytes(256, 23);
  SaveResult a = c.save(host_request(x, 1));
  SaveResult b = c.save(host_request(x, 1));
  ASSERT_EQ(a.id, b.id);
  std::vector<unsigned char> o1(256), o2(256), o3(256);
  EXPECT_EQ(c.unpack(a.id, 0, /*task=*/5, false, o1.data()).kind, Unpacked::Kind::kBuffer);
  EXPECT_EQ(c.unpack(b.id, 0, 5, false, o2.data()).kind, Unpacked::Kind::kBuffer);
  EXPECT_EQ(o1, x);
  EXPECT_EQ(o2, x);
  EXPECT_EQ(c.stats().step.tensors_reloaded, 1u);
  c.unpack(a.id, 0, /*task=*/6, false, o3.data());  // a retained graph's second backward
  EXPECT_EQ(o3, x);
  EXPECT_EQ(c.stats().step.tensors_reloaded, 2u);
  EXPECT_EQ(c.stats().store.blobs, 1u) << "no pool buffer was taken";
}

TEST(CacheGlue, GlueObjectsDieOnTheCallersThreadWithTheLockReleased) {
  CacheOptions o;
  o.inline_copy_bytes = 0;  // the tensor is held while a worker stores it
  auto c = std::make_unique<TensorCache>(make_host_store(HostStoreOptions{}), o);
  c->begin_step();
  Probe live, orig, kept;
  live.cache = orig.cache = kept.cache = c.get();
  auto x = test::random_bytes(1000, 30), y = test::random_bytes(1000, 31);
  SaveRequest r = host_request(x, 1);
  r.live = probe_obj(live);
  r.orig = probe_obj(orig);
  SaveResult a = c->save(r);
  r = SaveRequest{};
  c->drain();  // the worker stored it; the tensor is still held
  EXPECT_EQ(live.destroyed, 0);
  c->poll();   // returned to the caller, who drops it here
  EXPECT_EQ(live.destroyed, 1);
  r = host_request(y, 2);
  r.offload = false;
  r.live = probe_obj(kept);
  SaveResult b = c->save(r);
  r = SaveRequest{};
  EXPECT_TRUE(c->release_handle(a.handle, a.id));
  EXPECT_EQ(orig.destroyed, 1);
  EXPECT_EQ(kept.destroyed, 0);
  c->close();  // the kept entry's tensor goes with close()
  EXPECT_EQ(kept.destroyed, 1);
  EXPECT_FALSE(live.off_thread || orig.off_thread || kept.off_thread);
  (void)b;
}

TEST(CacheGlue, UnpackOfAReleasedEntryOrAClosedCacheFailsClearly) {
  TensorCache c(make_host_store(HostStoreOptions{}), CacheOptions{});
  c.begin_step();
  auto x = test::random_bytes(100, 40);
  SaveResult res = c.save(host_request(x, 1));
  EXPECT_TRUE(c.release_handle(res.handle, res.id));
  EXPECT_THROW(c.unpack(res.id, 0), StateError);
  c.close();
  EXPECT_THROW(c.unpack(res.id, 0), StateError);
}

}  // namespace
}  // namespace ebbtide::cache
