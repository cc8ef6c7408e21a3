// make_store: which tiers each target name builds, the SSD write cap, bad targets;
// the pool of idle stores (Note [Store pool]), across fork (Note [Objects
// across fork]).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/cache/store_pool.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::cache {
namespace {

StoreSpec spec(const std::string& target, const test::TempDir& dir) {
  StoreSpec s;
  s.target = target;
  s.dirs = {dir.path()};
  return s;
}

TEST(MakeStore, CpuIsHostMemoryOfTheCapacity) {
  test::TempDir dir;
  StoreSpec s = spec("cpu", dir);
  s.capacity_bytes = 1 << 20;
  auto store = make_store(s);
  EXPECT_TRUE(store->has_tier(kTierCpu));
  EXPECT_FALSE(store->has_tier(kTierSsd));
  EXPECT_EQ(store->stats().capacity, 1u << 20);
}

TEST(MakeStore, SsdIsTheSlabsWithTheWriteCap) {
  test::TempDir dir;
  StoreSpec s = spec("ssd", dir);
  s.host_budget_bytes = 1 << 20;  // ignored: "ssd" has no host tier
  s.max_write_bps = 5e6;
  auto store = make_store(s);
  EXPECT_FALSE(store->has_tier(kTierCpu));
  EXPECT_TRUE(store->has_tier(kTierSsd));
  EXPECT_DOUBLE_EQ(store->stats().tiers[kTierSsd].write_limit_bps, 5e6);
}

TEST(MakeStore, AutoPutsHostMemoryInFrontOnlyWithABudget) {
  test::TempDir dir;
  StoreSpec s = spec("auto", dir);
  auto ssd_only = make_store(s);
  EXPECT_FALSE(ssd_only->has_tier(kTierCpu));
  EXPECT_TRUE(ssd_only->has_tier(kTierSsd));
  s.host_budget_bytes = 1 << 20;
  auto both = make_store(s);
  EXPECT_TRUE(both->has_tier(kTierCpu));
  EXPECT_TRUE(both->has_tier(kTierSsd));
}

TEST(StorePool, AStoreGivenBackServesTheNextCacheOfTheSameSettingsOnly) {
  release_pooled_stores();
  test::TempDir dir;
  StoreSpec s = spec("ssd", dir);
  s.max_write_bps = 5e6;
  std::function<void(std::unique_ptr<Store>)> give_back;
  auto first = take_pooled_store(s, &give_back);
  Store* raw = first.get();
  first->set_write_limit(kTierSsd, 1e6);  // changed while in use: restored on return
  give_back(std::move(first));
  StoreSpec other = spec("cpu", dir);
  std::function<void(std::unique_ptr<Store>)> give_other;
  auto cpu = take_pooled_store(other, &give_other);
  EXPECT_NE(cpu.get(), raw) << "another setting got the idle store";
  std::function<void(std::unique_ptr<Store>)> give_again;
  auto again = take_pooled_store(s, &give_again);
  EXPECT_EQ(again.get(), raw) << "the idle store of the same settings was not reused";
  EXPECT_DOUBLE_EQ(again->stats().tiers[kTierSsd].write_limit_bps, 5e6);
  // A store that still holds blobs is not pooled.
  std::vector<char> bytes(4096, 'x');
  Location loc = again->put(mem::Buffer{bytes.data(), bytes.size()}, kTierFirst);
  give_again(std::move(again));
  std::function<void(std::unique_ptr<Store>)> give_third;
  auto third = take_pooled_store(s, &give_third);
  EXPECT_EQ(third->stats().blobs, 0u);
  (void)loc;
  give_third(std::move(third));
  give_other(std::move(cpu));
  EXPECT_EQ(release_pooled_stores(), 2u);
  EXPECT_EQ(release_pooled_stores(), 0u);
}

// A forked child has the parent's idle store but not its engine's threads:
// it must neither lend it (its writes would wait for threads that do not
// exist) nor destroy it (its destructor joins them: a hang before the fix).
TEST(StorePool, AForkedChildNeitherLendsNorDestroysTheParentsStores) {
  release_pooled_stores();
  test::TempDir dir;
  const StoreSpec s = spec("ssd", dir);
  std::function<void(std::unique_ptr<Store>)> give_back;
  auto first = take_pooled_store(s, &give_back);
  Store* raw = first.get();
  give_back(std::move(first));
  std::vector<char> bytes(4096, 'x');
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // no gtest assertions here: a bit of the exit status per failed check
    ::alarm(60);   // a destructor waiting for the parent's threads ends the child by SIGALRM
    int failed = 0;
    std::function<void(std::unique_ptr<Store>)> give_mine;
    auto mine = take_pooled_store(s, &give_mine);
    if (mine.get() == raw) failed |= 1;
    Location loc = mine->put(mem::Buffer{bytes.data(), bytes.size()}, kTierFirst);
    std::vector<char> back(bytes.size());
    mine->get(loc, mem::Buffer{back.data(), back.size()});
    if (back != bytes) failed |= 2;
    mine->free(loc);
    give_mine(std::move(mine));
    if (release_pooled_stores() != 2) failed |= 4;  // the parent's let go, the child's own destroyed
    ::_exit(failed);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died (signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                 << "; SIGALRM is " << SIGALRM << ": a hang)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "failed checks in the child (bits: 0 lent the parent's store, "
                                       "1 its own store's round trip, 2 release count)";
  // The parent's store is pooled and works as before.
  std::function<void(std::unique_ptr<Store>)> give_again;
  auto again = take_pooled_store(s, &give_again);
  EXPECT_EQ(again.get(), raw);
  Location loc = again->put(mem::Buffer{bytes.data(), bytes.size()}, kTierFirst);
  std::vector<char> back(bytes.size());
  again->get(loc, mem::Buffer{back.data(), back.size()});
  EXPECT_EQ(back, bytes);
  again->free(loc);
  give_again(std::move(again));
  EXPECT_EQ(release_pooled_stores(), 1u);
}

TEST(MakeStore, UnknownTargetNamesItAndTheValidOnes) {
  test::TempDir dir;
  try {
    make_store(spec("nvme", dir));
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'nvme'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("auto, ssd, cpu"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ebbtide::cache
