// make_store: which tiers each target name builds, the SSD write cap, bad targets.
#include <gtest/gtest.h>

#include <string>

#include "ebbtide/cache/store.hpp"
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
