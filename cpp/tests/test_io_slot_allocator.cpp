#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "ebbtide/io/detail/slot_allocator.hpp"
#include "ebbtide/util/error.hpp"

using ebbtide::io::detail::Extent;
using ebbtide::io::detail::SlotAllocator;

TEST(SlotAllocator, EmptySpaceAsksToGrow) {
  SlotAllocator a(4096);
  EXPECT_FALSE(a.allocate(1).has_value());
  EXPECT_EQ(a.shortfall(1), 4096u);
  a.grow(1 << 20);
  auto e = a.allocate(1);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->offset, 0u);
  EXPECT_EQ(e->length, 4096u);
  EXPECT_EQ(a.used(), 4096u);
  EXPECT_EQ(a.live(), 1u);
}

TEST(SlotAllocator, RejectsBadInput) {
  EXPECT_THROW(SlotAllocator(3000), ebbtide::InvalidArgument);
  SlotAllocator a(512);
  a.grow(8192);
  EXPECT_THROW(a.allocate(0), ebbtide::InvalidArgument);
  auto e = a.allocate(1000);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->length, 1024u);
  a.free(*e);
  EXPECT_THROW(a.free(*e), ebbtide::InvalidArgument);  // freed twice
  EXPECT_THROW(a.free(Extent{8192, 512}), ebbtide::InvalidArgument);  // outside
  EXPECT_THROW(a.grow(100), ebbtide::InvalidArgument);
}

TEST(SlotAllocator, CoalescesAndReuses) {
  SlotAllocator a(4096);
  a.grow(16 * 4096);
  std::vector<Extent> e;
  for (int i = 0; i < 4; ++i) e.push_back(*a.allocate(4 * 4096));
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_FALSE(a.allocate(1).has_value());
  a.free(e[1]);
  a.free(e[2]);  // coalesces with e[1]
  EXPECT_EQ(a.free_extents(), 1u);
  EXPECT_EQ(a.largest_free(), 8u * 4096);
  auto big = a.allocate(8 * 4096);  // fits only in the coalesced extent
  ASSERT_TRUE(big);
  EXPECT_EQ(big->offset, e[1].offset);
  a.free(*big);
  a.free(e[0]);
  a.free(e[3]);
  EXPECT_EQ(a.free_extents(), 1u);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.live(), 0u);
}

TEST(SlotAllocator, BestFitPicksSmallestHole) {
  SlotAllocator a(4096);
  a.grow(32 * 4096);
  auto a1 = *a.allocate(8 * 4096);
  auto sep1 = *a.allocate(4096);
  auto a2 = *a.allocate(2 * 4096);
  auto sep2 = *a.allocate(4096);
  a.free(a1);  // hole of 8 pages
  a.free(a2);  // hole of 2 pages
  auto e = a.allocate(2 * 4096);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->offset, a2.offset);
  (void)sep1;
  (void)sep2;
}

TEST(SlotAllocator, GrowMergesWithFreeTail) {
  SlotAllocator a(4096);
  a.grow(4 * 4096);
  auto x = *a.allocate(4096);
  EXPECT_EQ(a.shortfall(8 * 4096), 5u * 4096);  // 3 free pages at the tail count
  a.grow(9 * 4096);
  auto y = a.allocate(8 * 4096);
  ASSERT_TRUE(y);
  EXPECT_EQ(y->offset, 4096u);
  a.free(x);
  a.free(*y);
  EXPECT_EQ(a.free_extents(), 1u);
  EXPECT_EQ(a.capacity(), 9u * 4096);
}

TEST(SlotAllocator, RandomWorkloadKeepsInvariants) {
  SlotAllocator a(512);
  a.grow(1 << 22);
  std::mt19937 rng(7);
  std::vector<Extent> live;
  uint64_t sum = 0;
  for (int step = 0; step < 5000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      uint64_t n = 1 + rng() % 40000;
      if (auto e = a.allocate(n)) {
        for (const auto& o : live) ASSERT_TRUE(e->offset + e->length <= o.offset || o.offset + o.length <= e->offset);
        live.push_back(*e);
        sum += e->length;
      } else {
        a.grow(a.capacity() + a.shortfall(n));
      }
    } else {
      size_t i = rng() % live.size();
      a.free(live[i]);
      sum -= live[i].length;
      live.erase(live.begin() + static_cast<long>(i));
    }
    ASSERT_EQ(a.used(), sum);
  }
  for (auto& e : live) a.free(e);
  EXPECT_EQ(a.free_extents(), 1u);
  EXPECT_EQ(a.used(), 0u);
}
