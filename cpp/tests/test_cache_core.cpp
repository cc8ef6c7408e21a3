#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/cache/tensor_cache.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::cache {
namespace {

// A store that can hold puts at a gate (to stage races) and fail gets.
class GatedStore final : public Store {
 public:
  explicit GatedStore(uint64_t capacity = 0) : inner_(make_host_store(HostStoreOptions{capacity})) {}
  Location put(const mem::Buffer& src, int tier) override {
    gate_.pass();
    return inner_->put(src, tier);
  }
  void get(Location loc, const mem::Buffer& dst) override {
    if (fail_gets_) throw IoError(EIO, "gated", 0, "injected read error");
    inner_->get(loc, dst);
  }
  void free(Location loc) override { inner_->free(loc); }
  StoreStats stats() const override { return inner_->stats(); }
  std::string describe() const override { return "gated"; }

  void close_gate() { gate_.set_open(false); }
  void open_gate() { gate_.set_open(true); }
  void wait_puts_started(int n) { gate_.wait_started(n); }
  std::atomic<bool> fail_gets_{false};

 private:
  std::unique_ptr<Store> inner_;
  test::Gate gate_;
};

struct Fixture {
  explicit Fixture(uint64_t window = 1 << 20, unsigned workers = 1, uint64_t capacity = 0) {
    auto s = std::make_unique<GatedStore>(capacity);
    store = s.get();
    CacheOptions o;
    o.prefetch_window_bytes = window;
    o.workers = workers;
    cache = std::make_unique<TensorCache>(std::move(s), o);
    cache->begin_step();
  }
  EntryId save(const std::vector<unsigned char>& buf, uint64_t key, int mb = 0, bool offload = true) {
    SaveRequest r;
    r.key = key;
    r.src = test::host_buffer(buf);
    r.microbatch = mb;
    r.offload = offload;
    auto res = cache->save(r);
    done.insert(done.end(), res.done.begin(), res.done.end());  // completions come with saves too
    return res.id;
  }
  // Every completion since the last call: those the saves took, then poll()'s.
  std::vector<Completion> poll() {
    auto out = std::move(done);
    done.clear();
    auto more = cache->poll();
    out.insert(out.end(), more.begin(), more.end());
    return out;
  }
  std::vector<Completion> done;
  GatedStore* store;
  std::unique_ptr<TensorCache> cache;
};

TEST(CacheCore, StoreThenReloadRoundTrips) {
  Fixture f;
  auto data = test::random_bytes(10000, 1);
  EntryId id = f.save(data, 11);
  f.cache->drain();
  EXPECT_EQ(f.cache->state(id), EntryState::kStored);
  auto done = f.poll();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, id);
  EXPECT_TRUE(done[0].ok);
  EXPECT_EQ(f.cache->stats().resident_bytes, 0u);
  ASSERT_EQ(f.cache->request(id), Reload::kNeedBuffer);
  std::vector<unsigned char> out(data.size());
  f.cache->start_load(id, out.data(), 0);
  EXPECT_EQ(f.cache->request(id), Reload::kPending);
  f.cache->wait(id, 0);
  EXPECT_EQ(out, data);
  EXPECT_EQ(f.cache->stats().resident_bytes, data.size());
  EXPECT_TRUE(f.cache->consume(id));
  EXPECT_EQ(f.cache->state(id), EntryState::kStored);
  // A second backward (retain_graph) reloads again.
  ASSERT_EQ(f.cache->request(id), Reload::kNeedBuffer);
  std::vector<unsigned char> out2(data.size());
  f.cache->start_load(id, out2.data(), 0);
  f.cache->wait(id, 0);
  EXPECT_EQ(out2, data);
  auto s = f.cache->stats();
  EXPECT_EQ(s.step.bytes_offloaded, data.size());
  EXPECT_EQ(s.step.bytes_reloaded, 2 * data.size());
  EXPECT_EQ(s.step.tensors_offloaded, 1u);
  EXPECT_EQ(s.step.tensors_reloaded, 2u);
  EXPECT_EQ(s.step.peak_resident_bytes, data.size());
  EXPECT_TRUE(f.cache->release(id));
  EXPECT_FALSE(f.cache->contains(id));
  EXPECT_EQ(f.cache->stats().store.blobs, 0u);
  EXPECT_EQ(f.cache->stats().resident_bytes, 0u);
}

TEST(CacheCore, ReuseOfALiveOriginalCountsOncePerEntryAndStep) {
  Fixture f;
  auto data = test::random_bytes(4096, 3);
  EntryId id = f.save(data, 12);
  f.cache->drain();
  f.poll();
  EXPECT_TRUE(f.cache->reuse(id));
  EXPECT_FALSE(f.cache->reuse(id));  // a second handle of the same entry
  auto s = f.cache->stats();
  EXPECT_EQ(s.step.tensors_reused, 1u);
  EXPECT_EQ(s.step.bytes_reused, data.size());
  EXPECT_EQ(s.step.bytes_reloaded, 0u);
  EXPECT_EQ(f.cache->state(id), EntryState::kStored);  // nothing was loaded
  f.cache->end_step();
  f.cache->begin_step();  // a retained graph's backward in a later step counts again
  EXPECT_TRUE(f.cache->reuse(id));
  s = f.cache->stats();
  EXPECT_EQ(s.step.tensors_reused, 1u);
  EXPECT_EQ(s.total.tensors_reused, 1u);
  f.cache->end_step();
  EXPECT_EQ(f.cache->stats().total.bytes_reused, 2 * data.size());
  EXPECT_TRUE(f.cache->release(id));
}

TEST(CacheCore, DedupByKeyCountsBytesOnceAndLivesUntilLastHandle) {
  Fixture f;
  auto data = test::random_bytes(4096, 2);
  EntryId a = f.save(data, 7);
  EntryId b = f.save(data, 7);
  EXPECT_EQ(a, b);
  auto s = f.cache->stats();
  EXPECT_EQ(s.step.tensors_saved, 2u);
  EXPECT_EQ(s.step.tensors_deduped, 1u);
  EXPECT_EQ(s.step.saved_bytes_total, 4096u);
  EXPECT_EQ(s.entries, 1u);
  f.cache->drain();
  f.poll();
  // Two handles: the buffer stays until both views were unpacked.
  std::vector<unsigned char> out(data.size());
  ASSERT_EQ(f.cache->request(a), Reload::kNeedBuffer);
  f.cache->start_load(a, out.data(), 0);
  f.cache->wait(a, 0);
  EXPECT_FALSE(f.cache->consume(a));
  EXPECT_TRUE(f.cache->consume(a));
  EXPECT_FALSE(f.cache->release(a));
  EXPECT_TRUE(f.cache->contains(a));
  EXPECT_TRUE(f.cache->release(a));
  EXPECT_FALSE(f.cache->contains(a));
  // The key is free again: a new storage may take it.
  auto other = test::random_bytes(100, 3);
  EntryId c = f.save(other, 7);
  EXPECT_NE(c, a);
  f.cache->close();  // before the buffers go: a store may still read them
}

TEST(CacheCore, DedupNeedsSameBytesAndVersion) {
  Fixture f;
  auto x = test::random_bytes(100, 1), y = test::random_bytes(200, 2);
  EntryId a = f.save(x, 5);
  EXPECT_NE(f.save(y, 5), a);  // same key, other bytes (storage resized): new entry
  SaveRequest r;
  r.key = 9;
  r.src = test::host_buffer(x);
  EntryId b = f.cache->save(r).id;
  r.version = 1;  // modified in place since: the old snapshot must not serve
  EntryId c = f.cache->save(r).id;
  EXPECT_NE(b, c);
  r.version = 0;
  EXPECT_EQ(f.cache->save(r).id, b);
  EXPECT_EQ(f.cache->stats().step.tensors_deduped, 1u);
  f.cache->close();  // before the buffers go: a store may still read them
}

TEST(CacheCore, RequestBeforeStoreStartsForwardsAndCancels) {
  Fixture f;
  auto x = test::random_bytes(1000, 1), y = test::random_bytes(2000, 2);
  f.store->close_gate();
  EntryId a = f.save(x, 1);
  f.store->wait_puts_started(1);  // worker holds a; b waits in the queue
  EntryId b = f.save(y, 2);
  EXPECT_EQ(f.cache->state(b), EntryState::kQueued);
  EXPECT_EQ(f.cache->request(b), Reload::kForward);
  EXPECT_EQ(f.cache->state(b), EntryState::kForwarded);
  EXPECT_EQ(f.cache->request(b), Reload::kResident);
  f.store->open_gate();
  f.cache->drain();
  EXPECT_EQ(f.cache->state(b), EntryState::kForwarded);
  EXPECT_EQ(f.cache->state(a), EntryState::kStored);
  auto s = f.cache->stats();
  EXPECT_EQ(s.store.blobs, 1u);  // b was never stored
  EXPECT_EQ(s.step.tensors_forwarded, 1u);
  EXPECT_EQ(s.step.bytes_discarded, 0u);  // a cancelled store writes nothing
  EXPECT_EQ(s.resident_bytes, x.size() + y.size());  // a not yet polled
  auto done = f.poll();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, a);
  EXPECT_EQ(f.cache->stats().resident_bytes, y.size());
}

TEST(CacheCore, RequestWhileStoringForwardsAndFreesTheFinishedCopy) {
  Fixture f;
  auto x = test::random_bytes(1000, 1);
  f.store->close_gate();
  EntryId a = f.save(x, 1);
  f.store->wait_puts_started(1);
  EXPECT_EQ(f.cache->state(a), EntryState::kStoring);
  EXPECT_EQ(f.cache->request(a), Reload::kForward);
  f.store->open_gate();
  f.cache->drain();
  EXPECT_EQ(f.cache->state(a), EntryState::kForwarded);
  EXPECT_TRUE(f.poll().empty());
  EXPECT_EQ(f.cache->stats().store.blobs, 0u);
  EXPECT_EQ(f.cache->stats().step.bytes_offloaded, 0u);
  EXPECT_EQ(f.cache->stats().step.bytes_discarded, x.size());  // written, never read
}

TEST(CacheCore, ReleaseWaitsForARunningStore) {
  Fixture f;
  auto x = test::random_bytes(1000, 1);
  f.store->close_gate();
  EntryId a = f.save(x, 1);
  f.store->wait_puts_started(1);
  std::atomic<bool> released{false};
  std::thread t([&] {
    f.cache->release(a);
    released = true;
  });
  f.store->open_gate();
  t.join();
  EXPECT_TRUE(released);
  f.cache->drain();
  EXPECT_FALSE(f.cache->contains(a));
  EXPECT_EQ(f.cache->stats().store.blobs, 0u);
  EXPECT_TRUE(f.poll().empty() || !f.cache->contains(a));
}

std::vector<EntryId> ids_of(const std::vector<Candidate>& v) {
  std::vector<EntryId> out;
  for (auto& p : v) out.push_back(p.id);
  return out;
}

TEST(CacheCore, PrefetchGoesInReverseForwardOrderWithinTheWindow) {
  Fixture f(/*window=*/250);
  std::vector<std::vector<unsigned char>> bufs;
  for (int i = 0; i < 5; ++i) bufs.push_back(test::random_bytes(100, i));
  std::vector<EntryId> ids;
  for (int i = 0; i < 5; ++i) {
    ids.push_back(f.save(bufs[i], 100 + i));
    f.cache->scope_end(0, i);
  }
  f.cache->drain();
  f.poll();
  auto p = f.cache->prefetch_scope(0, 4);
  EXPECT_EQ(ids_of(p), (std::vector<EntryId>{ids[4], ids[3]}));
  std::vector<std::vector<unsigned char>> outs(5, std::vector<unsigned char>(100));
  for (auto [id, n, orig] : p) {
    EXPECT_EQ(n, 100u);
    f.cache->start_load(id, outs[id - ids[0]].data(), 0);
  }
  EXPECT_TRUE(f.cache->prefetch_scope(0, 4).empty());  // window full
  f.cache->wait(ids[4], 0);
  EXPECT_TRUE(f.cache->consume(ids[4]));
  EXPECT_EQ(outs[4], bufs[4]);
  // One slot free in the window; scope 2 ends after entry 2.
  EXPECT_EQ(ids_of(f.cache->prefetch_scope(0, 2)), (std::vector<EntryId>{ids[2]}));
  // An early unpack prefetches what precedes it.
  EXPECT_EQ(ids_of(f.cache->prefetch_before(ids[2])), (std::vector<EntryId>{ids[1]}));
  f.cache->wait(ids[3], 0);
  EXPECT_EQ(outs[3], bufs[3]);
}

// Note [Prefetch distance]: resident entries between the point backward has
// reached and a stored one count towards the window, so a stored early block
// is not reloaded at the start of backward while later ones (forwarded: their
// stores lagged compute) are still resident.
// Bytes the glue kept without entries (note_kept) count towards the
// distance too: a reload waits until backward has passed them.
TEST(CacheCore, KeptBytesWithoutEntriesCountTowardsThePrefetchDistance) {
  Fixture f(/*window=*/250);
  auto a = test::random_bytes(100, 1);
  EntryId id = f.save(a, 100);
  f.cache->scope_end(0, 0);
  f.cache->note_kept(0, 300);  // blocks 1..3 kept in the glue
  f.cache->scope_end(0, 3);
  f.cache->drain();
  f.poll();
  EXPECT_TRUE(f.cache->prefetch_scope(0, 3).empty()) << "300 kept bytes ahead of it: beyond the window";
  EXPECT_EQ(ids_of(f.cache->prefetch_scope(0, 0)), (std::vector<EntryId>{id}));
}

TEST(CacheCore, ResidentEntriesCountTowardsThePrefetchDistance) {
  Fixture f(/*window=*/250);
  std::vector<std::vector<unsigned char>> bufs;
  for (int i = 0; i < 5; ++i) bufs.push_back(test::random_bytes(100, i));
  std::vector<EntryId> ids;
  auto save = [&](int i) {
    ids.push_back(f.save(bufs[i], 100 + i));
    f.cache->scope_end(0, i);
  };
  save(0);
  save(1);
  f.cache->drain();
  f.poll();  // 0 and 1 stored
  f.store->close_gate();
  save(2);
  f.store->wait_puts_started(3);  // 2 is storing
  save(3);
  save(4);
  // Backward order: 4 forwards and cancels the queued 3 (Note [Late stores]);
  // 2 is storing and forwards on its own. 2..4 resident.
  EXPECT_EQ(f.cache->request(ids[4]), Reload::kForward);
  EXPECT_EQ(f.cache->request(ids[3]), Reload::kResident);
  EXPECT_EQ(f.cache->request(ids[2]), Reload::kForward);
  EXPECT_TRUE(f.cache->prefetch_scope(0, 4).empty());  // 4, 3, 2: 300 bytes ahead > 250
  // From 3: 2 and 1 are 200 bytes ahead; 0 would be 300.
  EXPECT_EQ(ids_of(f.cache->prefetch_before(ids[3])), (std::vector<EntryId>{ids[1]}));
  EXPECT_EQ(ids_of(f.cache->prefetch_before(ids[2])), (std::vector<EntryId>{ids[1], ids[0]}));
  f.store->open_gate();
  f.cache->drain();
}

// Note [Late stores]: when backward of a micro-batch begins, its stores that
// have not started are cancelled; a running one finishes; other micro-batches
// keep theirs; a new forward of the micro-batch stores again.
TEST(CacheCore, BackwardCancelsTheMicroBatchsStoresNotYetStarted) {
  Fixture f;
  std::vector<std::vector<unsigned char>> bufs;
  for (int i = 0; i < 5; ++i) bufs.push_back(test::random_bytes(100, i));
  f.store->close_gate();
  EntryId a = f.save(bufs[0], 1, 0);
  f.store->wait_puts_started(1);  // a is storing
  EntryId b = f.save(bufs[1], 2, 0), c = f.save(bufs[2], 3, 0);
  f.cache->scope_end(0, 0);
  EntryId d = f.save(bufs[3], 4, 1);  // another micro-batch's forward
  EXPECT_TRUE(f.cache->prefetch_scope(0, 0).empty());  // backward of micro-batch 0 begins
  EXPECT_EQ(f.cache->state(a), EntryState::kStoring);
  EXPECT_EQ(f.cache->state(b), EntryState::kForwarded);
  EXPECT_EQ(f.cache->state(c), EntryState::kForwarded);
  EXPECT_EQ(f.cache->state(d), EntryState::kQueued);
  EXPECT_EQ(f.cache->stats().step.tensors_forwarded, 2u);
  EXPECT_EQ(f.cache->request(c), Reload::kResident);
  f.store->open_gate();
  f.cache->drain();
  EXPECT_EQ(f.cache->state(a), EntryState::kStored);
  EXPECT_EQ(f.cache->state(d), EntryState::kStored);
  auto s = f.cache->stats();
  EXPECT_EQ(s.step.tensors_offloaded, 2u);
  EXPECT_EQ(s.store.blobs, 2u);
  EXPECT_EQ(s.resident_bytes, 4 * 100u);  // a and d not polled yet; b, c resident
  f.poll();
  // A new forward of micro-batch 0 (say a retained graph's second forward)
  // stores again, and its backward cancels again.
  f.store->close_gate();
  EntryId e = f.save(bufs[4], 5, 0);
  f.store->wait_puts_started(3);
  EXPECT_EQ(f.cache->state(e), EntryState::kStoring);
  auto g = f.save(bufs[0], 6, 0);
  EXPECT_EQ(f.cache->state(g), EntryState::kQueued);
  EXPECT_EQ(f.cache->request(e), Reload::kForward);  // an unpack meets an unfinished store
  EXPECT_EQ(f.cache->state(g), EntryState::kForwarded);
  f.store->open_gate();
  f.cache->drain();
  EXPECT_EQ(f.cache->stats().step.bytes_discarded, 100u);  // e's copy, written in vain
}

TEST(CacheCore, MicroBatchRecordsAreSeparate) {
  Fixture f;
  auto x0 = test::random_bytes(100, 1), x1 = test::random_bytes(100, 2);
  auto y0 = test::random_bytes(100, 3), y1 = test::random_bytes(100, 4);
  // Two forwards interleaved (1F1B): mb 0 then mb 1.
  EntryId a0 = f.save(x0, 1, 0), a1 = f.save(x1, 2, 0);
  f.cache->scope_end(0, 0);
  EntryId b0 = f.save(y0, 3, 1), b1 = f.save(y1, 4, 1);
  f.cache->scope_end(1, 0);
  f.cache->drain();
  f.poll();
  EXPECT_EQ(ids_of(f.cache->prefetch_scope(1, 0)), (std::vector<EntryId>{b1, b0}));
  EXPECT_EQ(ids_of(f.cache->prefetch_before(a1)), (std::vector<EntryId>{a0}));
  EXPECT_TRUE(f.cache->prefetch_scope(7, 0).empty());
}

// Note [Joint resident peak]: the glue's kept bytes arrive as changes from
// threads that hold no lock in common, in any order. As levels, a fall that
// overtook its rise (level 0 sent after level 100) left 100 for good; as
// changes the sum is right whatever the order, and a sum below zero for a
// moment counts as nothing.
TEST(CacheCore, KeptBytesArriveAsChangesInAnyOrder) {
  Fixture f;
  auto x = test::random_bytes(300, 1);
  f.cache->add_kept_resident(-100);  // the fall overtook its rise
  EntryId k = f.save(x, 1, 0, /*offload=*/false);
  EXPECT_EQ(f.cache->stats().step.peak_resident_bytes, 300u);
  f.cache->add_kept_resident(100);
  EXPECT_EQ(f.cache->stats().step.peak_resident_bytes, 300u);
  f.cache->add_kept_resident(200);
  EXPECT_EQ(f.cache->stats().step.peak_resident_bytes, 500u);
  f.cache->add_kept_resident(-200);
  f.cache->release(k);
  f.poll();
  f.cache->end_step();
  f.cache->begin_step();
  EXPECT_EQ(f.cache->stats().step.peak_resident_bytes, 0u);  // nothing kept: no stale level
  f.cache->end_step();
}

TEST(CacheCore, KeptEntriesAreResidentAndCounted) {
  Fixture f;
  auto x = test::random_bytes(300, 1), y = test::random_bytes(500, 2);
  EntryId k = f.save(x, 1, 0, /*offload=*/false);
  EntryId o = f.save(y, 2);
  EXPECT_EQ(f.cache->state(k), EntryState::kKept);
  EXPECT_EQ(f.cache->request(k), Reload::kResident);
  f.cache->drain();
  auto s = f.cache->stats();
  EXPECT_EQ(s.step.peak_resident_bytes, 800u);
  EXPECT_EQ(s.step.tensors_kept, 1u);
  EXPECT_EQ(s.step.saved_bytes_total, 800u);
  f.poll();
  EXPECT_EQ(f.cache->stats().resident_bytes, 300u);
  f.cache->release(o);
  f.cache->release(k);
  f.cache->end_step();
  s = f.cache->stats();
  EXPECT_EQ(s.total.saved_bytes_total, 800u);
  EXPECT_EQ(s.total.peak_resident_bytes, 800u);
  EXPECT_EQ(s.steps, 1u);
  EXPECT_EQ(s.entries, 0u);
}

TEST(CacheCore, StoreFailureKeepsTheRestOfTheStepResident) {
  Fixture f(1 << 20, 1, /*capacity=*/1500);
  auto x = test::random_bytes(1000, 1), y = test::random_bytes(1000, 2), z = test::random_bytes(100, 3);
  EntryId a = f.save(x, 1);
  EntryId b = f.save(y, 2);  // does not fit
  f.cache->drain();
  EXPECT_EQ(f.cache->state(a), EntryState::kStored);
  EXPECT_EQ(f.cache->state(b), EntryState::kFailed);
  auto done = f.poll();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_TRUE(done[0].ok);
  EXPECT_FALSE(done[1].ok);
  EntryId c = f.save(z, 3);  // offloading is off for the rest of the step
  EXPECT_EQ(f.cache->state(c), EntryState::kKept);
  EXPECT_EQ(f.cache->request(b), Reload::kResident);
  EXPECT_EQ(f.cache->stats().step.store_failures, 1u);
  f.cache->release(c);
  f.cache->end_step();
  f.cache->begin_step();
  EntryId d = f.save(z, 4);
  f.cache->drain();
  EXPECT_EQ(f.cache->state(d), EntryState::kStored);
}

TEST(CacheCore, LoadFailureIsRethrownAndTheEntryStaysStored) {
  Fixture f;
  auto x = test::random_bytes(100, 1);
  EntryId a = f.save(x, 1);
  f.cache->drain();
  f.poll();
  f.store->fail_gets_ = true;
  std::vector<unsigned char> out(100);
  ASSERT_EQ(f.cache->request(a), Reload::kNeedBuffer);
  f.cache->start_load(a, out.data(), 0);
  EXPECT_THROW(f.cache->wait(a, 0), IoError);
  EXPECT_EQ(f.cache->state(a), EntryState::kStored);
  f.store->fail_gets_ = false;
  ASSERT_EQ(f.cache->request(a), Reload::kNeedBuffer);
  f.cache->start_load(a, out.data(), 0);
  f.cache->wait(a, 0);
  EXPECT_EQ(out, x);
}

TEST(CacheCore, ReleaseStepDropsEverythingAndLateReleasesAreIgnored) {
  Fixture f;
  auto x = test::random_bytes(100, 1), y = test::random_bytes(100, 2);
  EntryId a = f.save(x, 1);
  EntryId b = f.save(y, 2, 0, false);
  f.cache->drain();
  auto gone = f.cache->release_step(f.cache->current_step());
  EXPECT_EQ(gone.size(), 2u);
  EXPECT_EQ(f.cache->stats().entries, 0u);
  EXPECT_EQ(f.cache->stats().store.blobs, 0u);
  EXPECT_EQ(f.cache->stats().resident_bytes, 0u);
  EXPECT_TRUE(f.cache->release(a));
  EXPECT_TRUE(f.cache->release(b));
  EXPECT_THROW(f.cache->request(a), StateError);
}

TEST(CacheCore, ClosedCacheRejectsWork) {
  Fixture f;
  auto x = test::random_bytes(100, 1);
  EntryId a = f.save(x, 1);
  f.cache->close();
  EXPECT_TRUE(f.cache->closed());
  EXPECT_EQ(f.cache->stats().store.blobs, 0u);
  EXPECT_THROW(f.save(x, 2), StateError);
  EXPECT_THROW(f.cache->request(a), StateError);
  f.cache->close();  // idempotent
}

TEST(CacheCore, ManyEntriesUnderConcurrentWorkersRoundTrip) {
  Fixture f(/*window=*/64 << 10, /*workers=*/3);
  std::vector<std::vector<unsigned char>> bufs;
  std::vector<EntryId> ids;
  for (int i = 0; i < 200; ++i) bufs.push_back(test::random_bytes(100 + 37 * i, 1000 + i));
  for (int i = 0; i < 200; ++i) {
    ids.push_back(f.save(bufs[i], 5000 + i, i % 2));
    if (i % 10 == 9) f.cache->scope_end(i % 2, i / 10);
    if (i % 7 == 0) f.poll();
  }
  // Backward: walk each micro-batch in reverse, prefetching as we go; entries
  // whose store had not finished are forwarded.
  std::map<EntryId, std::vector<unsigned char>> bufs_out;
  int forwarded = 0;
  for (int mb = 0; mb < 2; ++mb) {
    for (int i = 199; i >= 0; --i) {
      if (i % 2 != mb) continue;
      f.poll();
      EntryId id = ids[i];
      Reload r = f.cache->request(id);
      if (r == Reload::kForward || r == Reload::kResident) {
        ++forwarded;
      } else {
        if (r == Reload::kNeedBuffer) {
          bufs_out[id].resize(bufs[i].size());
          f.cache->start_load(id, bufs_out[id].data(), 0);
        }
        for (auto [pid, n, orig] : f.cache->prefetch_before(id)) {
          bufs_out[pid].resize(n);
          f.cache->start_load(pid, bufs_out[pid].data(), 0);
        }
        f.cache->wait(id, 0);
        EXPECT_EQ(bufs_out[id], bufs[i]) << "entry " << i;
        EXPECT_TRUE(f.cache->consume(id));
      }
      EXPECT_TRUE(f.cache->release(id));
    }
  }
  EXPECT_EQ(f.cache->stats().entries, 0u);
  f.cache->drain();  // stores of released entries still running free their space when they end (Note [Abandoned work])
  auto s = f.cache->stats();
  EXPECT_EQ(s.store.blobs, 0u);
  EXPECT_EQ(s.resident_bytes, 0u);
  EXPECT_EQ(s.window_bytes, 0u);
  EXPECT_EQ(s.step.tensors_forwarded + s.step.tensors_reloaded, 200u);
  EXPECT_LE(s.step.peak_resident_bytes, s.step.saved_bytes_total);
  (void)forwarded;
}

TEST(HostStore, CapacityAndDoubleFree) {
  auto st = make_host_store(HostStoreOptions{1000});
  auto x = test::random_bytes(600, 1);
  Location a = st->put(test::host_buffer(x), kTierFirst);
  try {
    st->put(test::host_buffer(x), kTierFirst);
    FAIL() << "expected ENOSPC";
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), ENOSPC);
  }
  EXPECT_EQ(st->stats().bytes_held, 600u);
  std::vector<unsigned char> out(600);
  EXPECT_THROW(st->get(a, mem::Buffer{out.data(), 500}), InvalidArgument);
  st->get(a, mem::Buffer{out.data(), 600});
  EXPECT_EQ(out, x);
  st->free(a);
  EXPECT_THROW(st->free(a), StateError);
  EXPECT_EQ(st->stats().bytes_held, 0u);
  mem::Buffer dev{x.data(), 600, 0, 0};
  EXPECT_THROW(st->put(dev, kTierFirst), Unsupported);
  EXPECT_EQ(st->stats().bytes_held, 0u);
}

}  // namespace
}  // namespace ebbtide::cache

namespace ebbtide::cache {
namespace {

TEST(CacheCore, PausedStoresForwardEverything) {
  auto store = make_host_store(HostStoreOptions{});
  CacheOptions o;
  o.inline_copy_bytes = 0;  // every store through the (paused) workers
  TensorCache c(std::move(store), o);
  c.begin_step();
  c.pause_stores(true);
  auto x = test::random_bytes(1000, 1);
  SaveRequest r;
  r.key = 1;
  r.src = test::host_buffer(x);
  EntryId a = c.save(r).id;
  c.drain();  // returns although the store is held
  EXPECT_EQ(c.state(a), EntryState::kQueued);
  EXPECT_EQ(c.request(a), Reload::kForward);
  c.pause_stores(false);
  c.drain();
  EXPECT_EQ(c.stats().store.blobs, 0u);
}

TEST(CacheCore, InflightLimitMakesSaveWaitForStores) {
  CacheOptions o;
  o.max_inflight_bytes = 1500;
  TensorCache c(make_host_store(HostStoreOptions{}), o);
  c.begin_step();
  std::vector<std::vector<unsigned char>> bufs;
  for (int i = 0; i < 20; ++i) bufs.push_back(test::random_bytes(1000, i));
  uint64_t max_inflight = 0;
  for (int i = 0; i < 20; ++i) {
    SaveRequest r;
    r.key = 100 + i;
    r.src = test::host_buffer(bufs[i], 1000);
    c.save(r);
    max_inflight = std::max(max_inflight, c.stats().inflight_bytes);
    c.poll();
  }
  EXPECT_LE(max_inflight, 1500u);
  c.drain();
  EXPECT_EQ(c.stats().step.tensors_offloaded, 20u);
  EXPECT_LE(c.stats().step.peak_resident_bytes, 3000u);
}

// The glue lowers and raises the bound as budget plans change
// (Note [Budget guard] in ebbtide/cache/adaptive.py): a save waiting on the old
// bound re-checks against the new one, with the store still held.
TEST(CacheCore, SetMaxInflightWakesAWaitingSave) {
  Fixture f;
  f.store->close_gate();
  f.cache->set_max_inflight(1500);
  auto a = test::random_bytes(1000, 1), b = test::random_bytes(1000, 2);
  f.save(a, 1);
  f.store->wait_puts_started(1);  // a is held in the store: 1000 bytes in flight
  std::atomic<bool> saved{false};
  std::thread t([&] {
    f.save(b, 2);  // 2000 > 1500: waits
    saved = true;
  });
  f.cache->set_max_inflight(4000);
  t.join();
  EXPECT_TRUE(saved);
  EXPECT_EQ(f.cache->stats().inflight_bytes, 2000u);
  f.store->open_gate();
  f.cache->drain();
  EXPECT_EQ(f.cache->stats().step.tensors_offloaded, 2u);
}

}  // namespace
}  // namespace ebbtide::cache

namespace ebbtide::cache {
namespace {

TEST(CacheCore, ConsumedEntriesAreNotPrefetchedAgainInTheSameBackward) {
  CacheOptions o;
  o.inline_copy_bytes = 0;  // small host entries are prefetched only through the workers
  TensorCache c(make_host_store(HostStoreOptions{}), o);
  c.begin_step();
  auto x = test::random_bytes(100, 1), y = test::random_bytes(100, 2);
  SaveRequest r;
  r.src = test::host_buffer(x, 100);
  r.key = 1;
  EntryId a = c.save(r).id;
  r.src.ptr = y.data();
  r.key = 2;
  EntryId b = c.save(r).id;
  c.drain();
  c.poll();
  std::vector<unsigned char> out(100);
  ASSERT_EQ(c.request(a), Reload::kNeedBuffer);
  c.start_load(a, out.data(), 0);
  c.wait(a, 0);
  EXPECT_TRUE(c.consume(a, /*task=*/5));
  // b's unpack in the same backward (task 5) must not reload a.
  EXPECT_TRUE(c.prefetch_before(b, 5).empty());
  // A later backward of the retained graph (task 6) may.
  EXPECT_EQ(c.prefetch_before(b, 6).size(), 1u);
}

}  // namespace
}  // namespace ebbtide::cache

namespace ebbtide::cache {
namespace {

const StatField* field(const StatRecord& r, std::string_view name) {
  for (const auto& f : r)
    if (f.name == name) return &f;
  return nullptr;
}

TEST(CacheStats, RecordNamesEveryFieldAndOnlyPresentTiers) {
  CacheStats s;
  s.step.bytes_offloaded = 7;
  s.total.stall_seconds = 0.5;
  s.store.bytes_staged = 3;
  s.store.tiers[kTierSsd].present = true;
  s.store.tiers[kTierSsd].bytes_written = 11;
  const StatRecord r = stat_record(s);
  ASSERT_NE(field(r, "step"), nullptr);
  const auto& step = std::get<StatRecord>(field(r, "step")->value);
  EXPECT_EQ(std::get<uint64_t>(field(step, "bytes_offloaded")->value), 7u);
  const auto& total = std::get<StatRecord>(field(r, "total")->value);
  EXPECT_EQ(std::get<double>(field(total, "stall_seconds")->value), 0.5);
  EXPECT_EQ(std::get<uint64_t>(field(r, "store_bytes_staged")->value), 3u);
  const auto& tiers = std::get<std::vector<StatRecord>>(field(r, "tiers")->value);
  ASSERT_EQ(tiers.size(), 1u);
  EXPECT_EQ(std::get<std::string_view>(field(tiers[0], "tier")->value), "ssd");
  EXPECT_EQ(std::get<uint64_t>(field(tiers[0], "bytes_written")->value), 11u);
}

}  // namespace
}  // namespace ebbtide::cache
