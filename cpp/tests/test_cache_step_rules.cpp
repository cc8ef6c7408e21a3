// The rules of a GPU step that the planner's step model assumes of the cache
// (Note [Step model] in plan/step_model.cpp), each on the simulated GPU (Note
// [Simulated GPU]): release points by bytes (Note [Release by bytes]), a
// reload lead per entry (Note [Prefetch distance]), storages several blocks
// save (Note [Shared entries]), prefetch of entries whose original is alive
// (Note [Originals still alive]), loads made on demand on a priority stream
// (Note [Priority loads]) and the device time compute waits on the cache
// (Note [Device waits]). The test plays the glue: saved tensors and reload
// buffers are blocks of the simulator's caching allocator held by glue
// objects; times are the simulator's virtual clock, never the machine's.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <future>
#include <map>
#include <memory>
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

using test::SimDriver;
using DevicePtr = mem::cuda::DevicePtr;
using test::kCompute;
constexpr uint64_t kMiB = 1 << 20;
constexpr double kLink = 1e8;  // bytes/s each way: 1 MiB takes ~10.5 ms
constexpr double kCopy = static_cast<double>(kMiB) / kLink;

// One step's glue over the simulated device: activations written by kernels
// on the compute stream and saved, dropped when a release reports them;
// reload buffers allocated on the compute stream.
struct Step {
  SimDriver drv{SimDriver::Options{1, kLink, kLink}};
  test::Gate ssd_gate;  // open: the SSD's puts never wait
  test::Gate get_gate;  // open: nor its reads
  std::unique_ptr<TensorCache> cache;
  struct Saved {
    std::vector<unsigned char> data;
    DevicePtr act = 0;
    DevicePtr buf = 0;
    GlueObj live;  // the glue's own reference, dropped at the release
  };
  std::map<EntryId, Saved> saved;
  std::vector<EntryId> released;  // in the order poll() reported them
  uint64_t next_key = 1;

  explicit Step(uint64_t window = 64 * kMiB, bool ssd = false) {
    CacheOptions co;
    co.driver = &drv;
    co.workers = 1;
    co.device_inflight_bytes = 0;
    co.prefetch_window_bytes = window;
    if (ssd) {
      cache = std::make_unique<TensorCache>(std::make_unique<test::GatedSsd>(ssd_gate, &get_gate), co);
    } else {
      HostStoreOptions ho;
      ho.driver = &drv;
      cache = std::make_unique<TensorCache>(make_host_store(ho), co);
    }
    cache->begin_step();
  }
  ~Step() {
    saved.clear();
    cache->close();
  }

  GlueObj block(DevicePtr& out, uint64_t n, const std::string& label) {
    out = drv.alloc(n, kCompute, label);
    const DevicePtr p = out;
    SimDriver* d = &drv;
    return GlueObj(new int(0), [d, p](void* q) {
      delete static_cast<int*>(q);
      d->free(p);
    });
  }
  // A kernel of `seconds` writes a fresh tensor of `n` bytes, then the save.
  SaveResult save(uint64_t n = kMiB, uint64_t lead = 0, bool offload = true, double seconds = 1e-4) {
    Saved s;
    s.data = test::random_bytes(n, next_key);
    GlueObj live = block(s.act, n, "activation " + std::to_string(next_key));
    auto src = std::make_shared<std::vector<unsigned char>>(s.data);
    const DevicePtr p = s.act;
    drv.launch(kCompute, seconds, [p, src] { std::memcpy(reinterpret_cast<void*>(p), src->data(), src->size()); });
    SaveResult res = again(s.act, n, next_key++, lead, offload, live);
    s.live = std::move(live);
    ack(res.done);
    saved.emplace(res.id, std::move(s));
    return res;
  }
  // A save of a storage already saved (`act`, `key`): a later block's.
  SaveResult again(DevicePtr act, uint64_t n, uint64_t key, uint64_t lead = 0, bool offload = true,
                   GlueObj live = {}) {
    SaveRequest r;
    r.key = key;
    r.src = {reinterpret_cast<void*>(act), n, 0, kCompute};
    r.offload = offload;
    r.lead_bytes = lead;
    r.live = std::move(live);
    SaveResult res = cache->save(r);
    ack(res.done);
    return res;
  }
  void ack(std::vector<Completion>& done) {
    for (auto& c : done) {
      c.live.reset();
      auto it = saved.find(c.id);
      if (it != saved.end()) it->second.live.reset();
      released.push_back(c.id);
    }
    done.clear();
  }
  void poll() {
    auto done = cache->poll();
    ack(done);
  }
  void release(int64_t scope, uint64_t max_bytes = UINT64_MAX) {
    cache->release_copies(0, scope, kCompute, max_bytes);
    poll();
  }
  // Prefetch candidates' ids, in the order the walk offered them.
  static std::vector<EntryId> ids(const std::vector<Candidate>& cands) {
    std::vector<EntryId> out;
    for (const auto& c : cands) out.push_back(c.id);
    return out;
  }
  // The glue's prefetch: buffers on the compute stream, loads on the load stream.
  void prefetch(const std::vector<Candidate>& cands) {
    std::vector<EntryId> want;
    std::vector<std::pair<uintptr_t, GlueObj>> bufs;
    for (const auto& c : cands) {
      DevicePtr p = 0;
      bufs.emplace_back(0, block(p, c.nbytes, "reload buffer of entry " + std::to_string(c.id)));
      bufs.back().first = static_cast<uintptr_t>(p);
      saved.at(c.id).buf = p;
      want.push_back(c.id);
    }
    cache->start_loads(want, bufs, kCompute);
  }
  // An unpack: on demand when no prefetch started it; then a kernel reads
  // the bytes. Returns whether they were the saved ones (once the device ran).
  std::shared_ptr<bool> unpack(EntryId id) {
    Saved& s = saved.at(id);
    Unpacked u = cache->unpack(id, kCompute);
    if (u.kind == Unpacked::Kind::kNeedBuffer) {
      GlueObj owner = block(s.buf, u.nbytes, "reload buffer of entry " + std::to_string(id));
      cache->start_load(id, reinterpret_cast<void*>(s.buf), kCompute, owner);
      u = cache->unpack(id, kCompute);
    }
    EXPECT_EQ(u.kind, Unpacked::Kind::kBuffer) << "entry " << id;
    auto ok = std::make_shared<bool>(false);
    const DevicePtr p = s.buf;
    const auto* want = &s.data;
    drv.launch(kCompute, 1e-5, [ok, p, want] {
      *ok = std::memcmp(reinterpret_cast<const void*>(p), want->data(), want->size()) == 0;
    });
    return ok;
  }
  // Two scopes on the SSD: scope 0 saves 2 entries, scope 1 saves 4, all
  // released and written, their bounce blobs freed (loads read the SSD).
  std::vector<EntryId> spilled_scopes() {
    std::vector<EntryId> ids;
    for (int scope = 0; scope < 2; ++scope) {
      for (int i = 0; i < (scope == 0 ? 2 : 4); ++i) ids.push_back(save().id);
      cache->scope_end(0, scope);
    }
    release(INT64_MAX);
    cache->drain();
    return ids;
  }
  // The reloads into the glue's buffers since copy `from`, in the order they
  // were enqueued: (entry, stream).
  std::vector<std::pair<EntryId, mem::cuda::Stream>> reloads_since(size_t from) {
    std::vector<std::pair<EntryId, mem::cuda::Stream>> out;
    const auto copies = drv.copies();
    for (size_t i = from; i < copies.size(); ++i) {
      for (const auto& [id, s] : saved)
        if (!copies[i].d2h && s.buf != 0 && copies[i].dev == s.buf) out.emplace_back(id, copies[i].stream);
    }
    return out;
  }
  static std::vector<EntryId> entries_of(const std::vector<std::pair<EntryId, mem::cuda::Stream>>& loads) {
    std::vector<EntryId> out;
    for (const auto& l : loads) out.push_back(l.first);
    return out;
  }
  // No race, no driver error.
  void expect_clean() {
    drv.synchronize_all();
    EXPECT_TRUE(drv.races().empty()) << SimDriver::join_lines(drv.races());
    EXPECT_TRUE(drv.errors().empty()) << SimDriver::join_lines(drv.errors());
  }
};

// Note [Release by bytes]: four 1 MiB entries in two scopes, their copies
// running back to back over the link. A point through scope 1 limited to
// 3 MiB releases the first three in copy order and no more; the compute
// stream waits for the third copy, not the fourth. The count is a position
// in the copy order: released entries count, so a point at 1 MiB then one at
// 3 MiB release entries 0, then 1 and 2.
TEST(CacheStepRules, ReleasePointsReleaseByOffloadedBytes) {
  Step st;
  std::vector<EntryId> ids;
  for (int scope = 0; scope < 2; ++scope) {
    ids.push_back(st.save().id);
    ids.push_back(st.save().id);
    st.cache->scope_end(0, scope);
  }
  const auto copies = st.drv.copies();
  ASSERT_EQ(copies.size(), 4u);
  st.release(1, kMiB);
  EXPECT_EQ(st.released, std::vector<EntryId>{ids[0]});
  EXPECT_DOUBLE_EQ(st.drv.tail(kCompute), copies[0].end);
  st.release(1, 3 * kMiB);
  EXPECT_EQ(st.released, (std::vector<EntryId>{ids[0], ids[1], ids[2]}));
  EXPECT_DOUBLE_EQ(st.drv.tail(kCompute), copies[2].end) << "the compute stream waits for the third copy only";
  EXPECT_LT(st.drv.tail(kCompute), copies[3].end);
  st.release(0);  // scope 0 is released already: nothing more
  EXPECT_EQ(st.released.size(), 3u);
  st.release(1);
  EXPECT_EQ(st.released.size(), 4u);
  EXPECT_EQ(st.cache->stats().step.copy_waits, 3u);
  for (EntryId id : ids) st.cache->release(id);
  st.expect_clean();
}

// Note [Prefetch distance]: an entry may start loading only within its own
// lead of the point backward has reached; one beyond it is skipped, and one
// further on, with a longer lead, still loads. Blocks of 1 MiB: A (lead
// 1 MiB), B (lead 4 MiB), C (lead 1 MiB), then 2 MiB kept.
TEST(CacheStepRules, EachEntryLoadsWithinItsOwnLead) {
  Step st;
  const EntryId a = st.save(kMiB, kMiB).id;
  st.cache->scope_end(0, 0);
  const EntryId b = st.save(kMiB, 4 * kMiB).id;
  st.cache->scope_end(0, 1);
  const EntryId c = st.save(kMiB, kMiB).id;
  st.cache->scope_end(0, 2);
  const EntryId k = st.save(2 * kMiB, 0, /*offload=*/false).id;  // kept: counts in the distance
  st.cache->scope_end(0, 3);
  st.release(INT64_MAX);
  // From the end: C is 3 MiB away (beyond its 1 MiB), B 4 MiB (within its
  // 4), A 5 MiB: past the longest lead, the walk ends.
  EXPECT_EQ(Step::ids(st.cache->prefetch_scope(0, 3)), std::vector<EntryId>{b});
  // Once backward passed the kept block, C is next to it.
  auto cands = st.cache->prefetch_scope(0, 2);
  EXPECT_EQ(Step::ids(cands), (std::vector<EntryId>{c, b}));
  // A lead of 0 is the window: with a 1 MiB window only the adjacent entry.
  {
    Step w(kMiB);
    const EntryId x = w.save().id;
    w.cache->scope_end(0, 0);
    const EntryId y = w.save().id;
    w.cache->scope_end(0, 1);
    w.release(INT64_MAX);
    EXPECT_EQ(Step::ids(w.cache->prefetch_scope(0, 1)), std::vector<EntryId>{y});
    w.cache->release(x);
    w.cache->release(y);
  }
  st.prefetch(cands);
  std::vector<std::shared_ptr<bool>> ok{st.unpack(c), st.unpack(b), st.unpack(a)};
  st.expect_clean();
  for (auto& x : ok) EXPECT_TRUE(*x);
  for (EntryId id : {a, b, c, k}) st.cache->release(id);
}

// Note [Shared entries]: a storage block 0 saves and block 3 saves again
// (the rotary tables) moves to block 3's place: backward reaches it first
// and prefetches it there, with block 3's lead; its old place is skipped;
// its release count stays its first place's.
TEST(CacheStepRules, AStorageSavedByLaterBlocksIsReloadedAtItsLastSaver) {
  Step st(2 * kMiB);
  SaveResult table = st.save(kMiB, 3 * kMiB);
  const DevicePtr table_act = st.saved.at(table.id).act;
  std::vector<EntryId> blocks;
  st.cache->scope_end(0, 0);
  for (int scope = 1; scope <= 3; ++scope) {
    blocks.push_back(st.save().id);
    if (scope == 3) {
      SaveResult again = st.again(table_act, kMiB, 1, /*lead=*/kMiB);
      EXPECT_FALSE(again.is_new);
      EXPECT_EQ(again.id, table.id);
    }
    st.cache->scope_end(0, scope);
  }
  // Release by bytes: the table counts 1 MiB, at its first place.
  st.release(3, kMiB);
  EXPECT_EQ(st.released, std::vector<EntryId>{table.id});
  st.release(INT64_MAX);
  // Backward of block 3 begins: the table first (nothing saved after it),
  // then block 3's own entry; the window (2 MiB) is full.
  auto cands = st.cache->prefetch_scope(0, 3);
  EXPECT_EQ(Step::ids(cands), (std::vector<EntryId>{table.id, blocks[2]}));
  st.prefetch(cands);
  // Block 3's backward, then block 0's use of the table (autograd may
  // unpack a node's saves in any order): both handles, one reload.
  std::vector<std::shared_ptr<bool>> ok{st.unpack(blocks[2]), st.unpack(table.id), st.unpack(table.id)};
  EXPECT_EQ(st.cache->state(table.id), EntryState::kStored);
  // The table's old place, before block 1's entry, is not offered again.
  for (int scope = 2; scope >= 0; --scope) {
    for (EntryId id : Step::ids(st.cache->prefetch_scope(0, scope))) EXPECT_NE(id, table.id) << "scope " << scope;
  }
  ok.push_back(st.unpack(blocks[1]));
  ok.push_back(st.unpack(blocks[0]));
  st.expect_clean();
  for (auto& x : ok) EXPECT_TRUE(*x);
  EXPECT_EQ(st.cache->stats().step.tensors_reloaded, 4u);
  for (EntryId id : blocks) st.cache->release(id);
  st.cache->release(table.id);
  EXPECT_TRUE(st.cache->release(table.id));
}

// A later saver that keeps the storage, or one in the backward, leaves the
// entry where it was.
TEST(CacheStepRules, OnlyAnOffloadingSaveInTheForwardMovesASharedEntry) {
  Step st(kMiB);
  SaveResult table = st.save();
  const DevicePtr table_act = st.saved.at(table.id).act;
  st.cache->scope_end(0, 0);
  const EntryId b = st.save().id;
  st.again(table_act, kMiB, 1, 0, /*offload=*/false);  // block 1 keeps it
  st.cache->scope_end(0, 1);
  st.release(INT64_MAX);
  EXPECT_EQ(Step::ids(st.cache->prefetch_scope(0, 1)), std::vector<EntryId>{b});  // backward began
  st.again(table_act, kMiB, 1);  // a save in backward (a recompute's) does not move it either
  // From the order's end (an unknown scope): b, then the window is full.
  EXPECT_EQ(Step::ids(st.cache->prefetch_scope(0, 99)), std::vector<EntryId>{b});
  st.cache->release(b);
  for (int i = 0; i < 3; ++i) st.cache->release(table.id);
  st.expect_clean();
}

// Note [Originals still alive]: an entry answered from its original is
// counted reused once per step and still offered to later prefetches.
TEST(CacheStepRules, EntriesReusedFromTheirOriginalAreStillPrefetched) {
  Step st;
  const EntryId id = st.save().id;
  st.cache->scope_end(0, 0);
  st.release(INT64_MAX);
  EXPECT_EQ(Step::ids(st.cache->prefetch_scope(0, 0)), std::vector<EntryId>{id});
  EXPECT_TRUE(st.cache->reuse(id));  // the glue saw its original alive
  EXPECT_FALSE(st.cache->reuse(id));
  // The original died: the next walk offers it, and it loads ahead of its unpack.
  auto cands = st.cache->prefetch_scope(0, 0);
  EXPECT_EQ(Step::ids(cands), std::vector<EntryId>{id});
  st.prefetch(cands);
  auto ok = st.unpack(id);
  st.expect_clean();
  EXPECT_TRUE(*ok);
  const auto s = st.cache->stats().step;
  EXPECT_EQ(s.tensors_reused, 0u) << "the reload wins: every offloaded byte counts once";
  EXPECT_EQ(s.tensors_reloaded, 1u);
  st.cache->release(id);
}

// Note [Priority loads]: four entries prefetched on the load stream take
// ~42 ms of link; an unpack of a fifth no prefetch reached loads it on the
// priority stream at once, after its buffer's allocation and its store copy,
// instead of behind them. SSD entries take the same stream through the worker.
TEST(CacheStepRules, LoadsMadeOnDemandRunOnThePriorityStream) {
  for (bool ssd : {false, true}) {
    SCOPED_TRACE(ssd ? "ssd" : "host");
    Step st(64 * kMiB, ssd);
    std::vector<EntryId> ids;
    for (int i = 0; i < 5; ++i) ids.push_back(st.save().id);
    st.cache->scope_end(0, 0);
    st.release(INT64_MAX);
    st.cache->drain();  // SSD: every spill written, the bounce blobs freed
    std::vector<Candidate> pre;
    for (int i = 1; i < 5; ++i) pre.push_back(Candidate{ids[static_cast<size_t>(i)], kMiB, {}});
    st.prefetch(pre);
    // SSD: the worker reads them and enqueues their copies (no device sync:
    // the loop ends on the outcome, its bound is a deadlock watchdog).
    for (int i = 0; i < 600000; ++i) {
      if (std::all_of(pre.begin(), pre.end(), [&](const Candidate& c) { return st.cache->state(c.id) == EntryState::kLoaded; }))
        break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    const double issued = st.drv.tail(kCompute);
    auto ok = st.unpack(ids[0]);  // not prefetched: loaded on demand
    std::vector<SimDriver::Copy> loads;
    for (const auto& c : st.drv.copies())
      if (!c.d2h) loads.push_back(c);
    ASSERT_EQ(loads.size(), 5u);
    const auto& mine = loads.back();
    EXPECT_EQ(st.drv.priority_of(mine.stream), SimDriver::kGreatestPriority);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(st.drv.priority_of(loads[i].stream), SimDriver::kLeastPriority);
    EXPECT_LT(mine.end, loads[3].end) << "the on-demand load queued behind the prefetches";
    EXPECT_GE(mine.start, issued) << "it waits for its buffer's allocation";
    EXPECT_NEAR(mine.end - mine.start, kCopy, 1e-9);
    st.expect_clean();
    EXPECT_TRUE(*ok);
    for (EntryId id : ids) st.cache->release(id);
  }
}

// Note [Priority loads]: a walk's candidates of the scope whose backward
// runs are needed now and load on the priority stream; the earlier scopes'
// prefetches queue on the load stream, at the walk from a scope's start as
// at the walk from an entry (prefetch_before).
TEST(CacheStepRules, TheRunningScopesPrefetchesTakeThePriorityStream) {
  Step st;
  std::vector<EntryId> ids;
  for (int scope = 0; scope < 3; ++scope) {
    for (int i = 0; i < 2; ++i) ids.push_back(st.save().id);
    st.cache->scope_end(0, scope);
  }
  st.release(INT64_MAX);
  const size_t before = st.drv.copies().size();
  auto loads_since = [&](size_t from) {
    const auto copies = st.drv.copies();
    std::vector<SimDriver::Copy> loads;
    for (size_t i = from; i < copies.size(); ++i)
      if (!copies[i].d2h) loads.push_back(copies[i]);
    return loads;
  };
  // Backward reaches scope 2: its entries and, within the window, scope 1's.
  auto cands = st.cache->prefetch_scope(0, 2);
  ASSERT_EQ(Step::ids(cands), (std::vector<EntryId>{ids[5], ids[4], ids[3], ids[2], ids[1], ids[0]}));
  cands.resize(4);  // as if the window ended there
  st.prefetch(cands);
  auto loads = loads_since(before);
  ASSERT_EQ(loads.size(), 4u);
  EXPECT_EQ(st.drv.priority_of(loads[0].stream), SimDriver::kGreatestPriority);
  EXPECT_EQ(st.drv.priority_of(loads[1].stream), SimDriver::kGreatestPriority);
  EXPECT_EQ(st.drv.priority_of(loads[2].stream), SimDriver::kLeastPriority);
  EXPECT_EQ(st.drv.priority_of(loads[3].stream), SimDriver::kLeastPriority);
  // From an entry of scope 1 (its unpack's walk): scope 0's are earlier, not urgent;
  // a walk from scope 0's last entry finds its own scope's first one urgent.
  const size_t mid = st.drv.copies().size();
  auto from_b = st.cache->prefetch_before(ids[2]);
  ASSERT_EQ(Step::ids(from_b), (std::vector<EntryId>{ids[1], ids[0]}));
  from_b.resize(1);
  st.prefetch(from_b);
  auto from_a = st.cache->prefetch_before(ids[1]);
  ASSERT_EQ(Step::ids(from_a), (std::vector<EntryId>{ids[0]}));
  st.prefetch(from_a);
  loads = loads_since(mid);
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_EQ(st.drv.priority_of(loads[0].stream), SimDriver::kLeastPriority);
  EXPECT_EQ(st.drv.priority_of(loads[1].stream), SimDriver::kGreatestPriority);
  for (EntryId id : ids) {
    auto ok = st.unpack(id);
    st.drv.synchronize_all();
    EXPECT_TRUE(*ok) << "entry " << id;
  }
  st.expect_clean();
  for (EntryId id : ids) st.cache->release(id);
}

// Note [Priority loads]: SSD entries of the running module go through the
// worker queue ahead of the other prefetches, in the order backward needs
// them: a walk's nearest candidate first, and a later walk's behind those an
// earlier walk queued. Scope 1 holds entries 2..5, scope 0 entries 0 and 1;
// the glue loads a prefix of each walk (as after an allocation failure), the
// worker parked in its first read: walk 1 loads 5; walk 2 (from 5) loads 4;
// walk 3 (from 4) loads 3, 2 (the running module's) and 1. Each pushed to
// the queue's front, 2 ran before 3 and both before 4: the unpack of 4, the
// next one backward makes, waited for the two loads behind it.
TEST(CacheStepRules, TheRunningModulesSsdLoadsQueueInBackwardsOrder) {
  Step st(64 * kMiB, /*ssd=*/true);
  const std::vector<EntryId> ids = st.spilled_scopes();
  const size_t before = st.drv.copies().size();
  st.get_gate.set_open(false);
  auto take = [](std::vector<Candidate> cands, size_t n) {
    cands.resize(std::min(n, cands.size()));
    return cands;
  };
  auto walk1 = st.cache->prefetch_scope(0, 1);
  ASSERT_EQ(Step::ids(walk1), (std::vector<EntryId>{ids[5], ids[4], ids[3], ids[2], ids[1], ids[0]}));
  st.prefetch(take(walk1, 1));
  st.get_gate.wait_started(1);  // the worker reads entry 5's bytes
  auto walk2 = st.cache->prefetch_before(ids[5]);
  ASSERT_EQ(Step::ids(walk2), (std::vector<EntryId>{ids[4], ids[3], ids[2], ids[1], ids[0]}));
  st.prefetch(take(walk2, 1));
  auto walk3 = st.cache->prefetch_before(ids[4]);
  ASSERT_EQ(Step::ids(walk3), (std::vector<EntryId>{ids[3], ids[2], ids[1], ids[0]}));
  st.prefetch(take(walk3, 3));
  st.get_gate.set_open(true);
  // The loop ends on the outcome; its bound is a deadlock watchdog.
  const std::vector<EntryId> loading{ids[5], ids[4], ids[3], ids[2], ids[1]};
  for (int i = 0; i < 600000; ++i) {
    if (std::all_of(loading.begin(), loading.end(),
                    [&](EntryId id) { return st.cache->state(id) == EntryState::kLoaded; }))
      break;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  EXPECT_EQ(Step::entries_of(st.reloads_since(before)), loading) << "the worker's loads ran out of backward's order";
  for (EntryId id : {ids[5], ids[4], ids[3], ids[2]}) {
    auto ok = st.unpack(id);
    st.drv.synchronize_all();
    EXPECT_TRUE(*ok) << "entry " << id;
  }
  st.expect_clean();
  for (EntryId id : ids) st.cache->release(id);
}

// Note [Priority loads]: an unpack of an entry whose worker load still
// waits in the queue, behind loads backward needs later (the glue's walk
// loaded ahead of where backward went: a scope skipped, an unpack the
// walks' order did not foresee), moves that load to the queue's front and
// onto the priority stream. The worker is parked in the read of entry 5;
// 4..1 and 0 queue behind it; the unpack of 0 runs next, not last.
TEST(CacheStepRules, AnUnpackPromotesItsQueuedLoad) {
  Step st(64 * kMiB, /*ssd=*/true);
  const std::vector<EntryId> ids = st.spilled_scopes();
  // One more save whose completion waits for a call: the unpack takes it
  // under the lock it queues with, so once the cache holds its tensor no
  // more, the unpack has queued (a signal, not a timing).
  const EntryId marker = st.save().id;
  st.cache->release_copies(0, INT64_MAX, kCompute);
  ASSERT_EQ(st.cache->held_lives(0).size(), 1u);
  const size_t before = st.drv.copies().size();
  st.get_gate.set_open(false);
  auto walk = st.cache->prefetch_scope(0, 1);
  ASSERT_EQ(Step::ids(walk), (std::vector<EntryId>{ids[5], ids[4], ids[3], ids[2], ids[1], ids[0]}));
  st.prefetch({walk[0]});
  st.get_gate.wait_started(1);  // the worker reads entry 5's bytes
  st.prefetch(std::vector<Candidate>(walk.begin() + 1, walk.end()));
  auto unpacked = std::async(std::launch::async, [&] { return st.cache->unpack(ids[0], kCompute); });
  // The loop ends on the outcome; its bound is a deadlock watchdog.
  for (int i = 0; i < 600000 && !st.cache->held_lives(0).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  EXPECT_TRUE(st.cache->held_lives(0).empty()) << "the unpack never took the completions";
  st.get_gate.set_open(true);
  Unpacked u = unpacked.get();
  EXPECT_EQ(u.kind, Unpacked::Kind::kBuffer);
  st.ack(u.done);
  st.cache->drain();
  const auto loads = st.reloads_since(before);
  EXPECT_EQ(Step::entries_of(loads), (std::vector<EntryId>{ids[5], ids[0], ids[4], ids[3], ids[2], ids[1]}))
      << "the unpack's load waited behind the queued prefetches";
  ASSERT_EQ(loads.size(), 6u);
  EXPECT_EQ(st.drv.priority_of(loads[1].second), SimDriver::kGreatestPriority);
  bool ok = false;
  const DevicePtr p = st.saved.at(ids[0]).buf;
  const auto* want = &st.saved.at(ids[0]).data;
  st.drv.launch(kCompute, 1e-5, [&ok, p, want] {
    ok = std::memcmp(reinterpret_cast<const void*>(p), want->data(), want->size()) == 0;
  });
  st.drv.synchronize_all();
  EXPECT_TRUE(ok) << "the unpacked bytes";
  st.expect_clean();
  for (EntryId id : ids) st.cache->release(id);
  st.cache->release(marker);
}

// Note [Device waits]: a reload that ends 10 ms after the compute stream
// reaches its unpack, and a release point 5 ms before the copy it waits for
// ends, are counted as the device time the stream stood, on the simulator's
// clock; a wait a host query saw done costs nothing. Read only once the
// device reached them, never waited for.
TEST(CacheStepRules, DeviceWaitsAreCountedInTheStep) {
  Step st;
  const EntryId a = st.save().id;
  const EntryId b = st.save().id;
  st.cache->scope_end(0, 0);
  const auto copies = st.drv.copies();
  ASSERT_EQ(copies.size(), 2u);
  st.drv.launch(kCompute, copies[1].end - 5e-3 - st.drv.tail(kCompute));  // compute runs until 5 ms before
  const double at_release = st.drv.tail(kCompute);
  st.release(INT64_MAX);
  EXPECT_DOUBLE_EQ(st.drv.tail(kCompute), copies[1].end);
  // Backward: b loads on demand while the compute stream is at t; a was
  // prefetched long before and its load is done when the host asks.
  st.prefetch({Candidate{a, kMiB, {}}});
  const double at_unpack = st.drv.tail(kCompute);
  auto ok_b = st.unpack(b);
  const auto loads = st.drv.copies();
  const double load_end = loads.back().end;
  EXPECT_EQ(st.cache->stats().step.device_wait_seconds, 0.0) << "counted before the device reached it";
  st.drv.synchronize_all();
  auto ok_a = st.unpack(a);  // done on the host's clock: no timing
  st.drv.synchronize_all();
  const auto s = st.cache->stats().step;
  const double copy_wait = copies[1].end - at_release;
  const double load_wait = load_end - at_unpack;
  EXPECT_NEAR(s.copy_wait_seconds, copy_wait, 1e-6);
  EXPECT_NEAR(s.load_wait_seconds, load_wait, 1e-6);
  EXPECT_GT(s.load_wait_seconds, 0.9 * kCopy);
  EXPECT_NEAR(s.device_wait_seconds, copy_wait + load_wait, 1e-6);
  EXPECT_EQ(s.stall_seconds, 0.0) << "the host never waited";
  EXPECT_TRUE(*ok_a && *ok_b);
  st.cache->end_step();
  EXPECT_NEAR(st.cache->stats().total.device_wait_seconds, copy_wait + load_wait, 1e-6);
  // Names in stats().
  const StatRecord r = stat_record(st.cache->stats());
  const auto& step = std::get<StatRecord>(r[0].value);
  int names = 0;
  for (const auto& f : step)
    names += f.name == "device_wait_seconds" || f.name == "copy_wait_seconds" || f.name == "load_wait_seconds";
  EXPECT_EQ(names, 3);
  st.cache->release(a);
  st.cache->release(b);
  st.expect_clean();
}

// A wait the device has not passed when the step ends is counted once it
// has: in the totals (the step's counters were folded).
TEST(CacheStepRules, DeviceWaitsReadAfterTheStepGoToTheTotals) {
  Step st;
  const EntryId a = st.save().id;
  st.cache->scope_end(0, 0);
  st.release(INT64_MAX);
  auto ok = st.unpack(a);
  st.cache->end_step();
  EXPECT_EQ(st.cache->stats().total.device_wait_seconds, 0.0);
  st.drv.synchronize_all();
  const auto s = st.cache->stats();
  EXPECT_GT(s.step.load_wait_seconds, 0.9 * kCopy);
  EXPECT_NEAR(s.total.device_wait_seconds, s.step.device_wait_seconds, 1e-9);
  st.cache->begin_step();
  EXPECT_EQ(st.cache->stats().step.device_wait_seconds, 0.0);
  EXPECT_NEAR(st.cache->stats().total.device_wait_seconds, s.total.device_wait_seconds, 1e-9);
  EXPECT_TRUE(*ok);
  st.cache->release(a);
  st.expect_clean();
}

}  // namespace
}  // namespace ebbtide::cache
