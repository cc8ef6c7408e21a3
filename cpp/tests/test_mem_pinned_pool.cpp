#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/util/error.hpp"
#include "sim_driver.hpp"

namespace ebbtide::mem {
namespace {

TEST(PinnedPool, RoundsBuffersUpToPagesAndAlignsThem) {
  const size_t page = PinnedPool::page_size();
  PinnedPool pool(page + 1, 3);
  EXPECT_EQ(pool.buffer_bytes(), 2 * page);
  EXPECT_EQ(pool.count(), 3u);
  EXPECT_EQ(pool.total_bytes(), 6 * page);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool.base()) % page, 0u);
  std::set<void*> seen;
  std::vector<PinnedPool::Lease> leases;
  for (int i = 0; i < 3; ++i) {
    leases.push_back(pool.acquire());
    auto& l = leases.back();
    ASSERT_TRUE(l);
    EXPECT_EQ(l.size(), 2 * page);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(l.data()) % page, 0u);
    EXPECT_GE(static_cast<char*>(l.data()), static_cast<char*>(pool.base()));
    EXPECT_LE(static_cast<char*>(l.data()) + l.size(),
              static_cast<char*>(pool.base()) + pool.total_bytes());
    EXPECT_EQ(l.data(), pool.buffer(pool.index_of(l)));
    std::memset(l.data(), 0xA0 + i, l.size());  // the whole buffer is writable
    seen.insert(l.data());
  }
  EXPECT_EQ(seen.size(), 3u);
  // No buffer overlapped another: each still holds its own pattern.
  for (int i = 0; i < 3; ++i) {
    auto* p = static_cast<unsigned char*>(leases[i].data());
    EXPECT_EQ(p[0], 0xA0 + i);
    EXPECT_EQ(p[leases[i].size() - 1], 0xA0 + i);
  }
  EXPECT_EQ(pool.in_use(), 3u);
}

TEST(PinnedPool, ReleasedBuffersAreReused) {
  PinnedPool pool(4096, 2);
  void* first = nullptr;
  {
    auto l = pool.acquire();
    first = l.data();
    EXPECT_EQ(pool.in_use(), 1u);
  }
  EXPECT_EQ(pool.in_use(), 0u);
  for (int i = 0; i < 10; ++i) {
    auto l = pool.acquire();
    EXPECT_EQ(l.data(), first);  // most recently returned buffer comes back first
  }
  auto a = pool.acquire();
  auto b = pool.acquire();
  void* pa = a.data();
  void* pb = b.data();
  EXPECT_NE(pa, pb);
  a.reset();
  EXPECT_FALSE(a);
  EXPECT_EQ(pool.in_use(), 1u);
  auto c = pool.acquire();
  EXPECT_EQ(c.data(), pa);
}

TEST(PinnedPool, TryAcquireReturnsNulloptWhenExhausted) {
  PinnedPool pool(4096, 2);
  auto a = pool.try_acquire();
  auto b = pool.try_acquire();
  ASSERT_TRUE(a.has_value());
  ASSERT_TRUE(b.has_value());
  EXPECT_FALSE(pool.try_acquire().has_value());
  EXPECT_EQ(pool.in_use(), 2u);
  void* freed = a->data();
  a.reset();  // destroys the Lease inside the optional
  auto c = pool.try_acquire();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->data(), freed);
}

TEST(PinnedPool, LeasesMoveWithoutDoubleRelease) {
  PinnedPool pool(4096, 2);
  PinnedPool::Lease a = pool.acquire();
  void* p = a.data();
  PinnedPool::Lease b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from state is specified
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(pool.in_use(), 1u);
  PinnedPool::Lease c = pool.acquire();
  c = std::move(b);  // c's own buffer returns to the pool
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(pool.in_use(), 1u);
  PinnedPool::Lease empty;
  EXPECT_FALSE(empty);
  empty.reset();  // no-op
  c = std::move(empty);
  EXPECT_FALSE(c);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(PinnedPool, BlockingAcquireWakesWhenAnotherThreadReleases) {
  PinnedPool pool(4096, 1);
  auto held = pool.acquire();
  void* p = held.data();
  std::atomic<bool> released{false};
  std::atomic<bool> got_after_release{false};
  void* got = nullptr;
  std::thread waiter([&] {
    auto l = pool.acquire();  // blocks: the only buffer is held
    got_after_release = released.load();
    got = l.data();
  });
  released = true;  // set before the release, so the waiter must observe it
  held.reset();
  waiter.join();
  EXPECT_TRUE(got_after_release) << "acquire() returned while every buffer was leased";
  EXPECT_EQ(got, p);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(PinnedPool, ConcurrentUsersNeverShareABuffer) {
  PinnedPool pool(4096, 3);
  constexpr int kThreads = 6;
  constexpr int kRounds = 300;
  std::atomic<int> conflicts{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        auto l = (i % 2) ? pool.acquire() : [&] {
          for (;;) {
            if (auto o = pool.try_acquire()) return std::move(*o);
            std::this_thread::yield();
          }
        }();
        auto* words = static_cast<uint32_t*>(l.data());
        const uint32_t mark = static_cast<uint32_t>(t * kRounds + i);
        for (size_t k = 0; k < 64; ++k) words[k] = mark;
        std::this_thread::yield();
        for (size_t k = 0; k < 64; ++k)
          if (words[k] != mark) ++conflicts;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(conflicts.load(), 0);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(PinnedPool, RejectsBadSizes) {
  EXPECT_THROW(PinnedPool(0, 4), InvalidArgument);
  EXPECT_THROW(PinnedPool(4096, 0), InvalidArgument);
  EXPECT_THROW(PinnedPool(std::numeric_limits<size_t>::max(), 1), InvalidArgument);
  EXPECT_THROW(PinnedPool(size_t{1} << 40, size_t{1} << 40), InvalidArgument);
  try {
    PinnedPool(0, 1);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("buffer size"), std::string::npos) << e.what();
  }
  PinnedPool pool(4096, 2);
  EXPECT_THROW(pool.buffer(2), InvalidArgument);
  PinnedPool other(4096, 1);
  auto l = other.acquire();
  EXPECT_THROW(pool.index_of(l), InvalidArgument);
}

TEST(PinnedPool, MmapFailureIsIoError) {
  // 2^46 bytes of address space: accepted by the size checks, refused by mmap
  // (larger than the machine's memory under the default overcommit heuristic,
  // or than the address space left).
  try {
    PinnedPool pool(size_t{1} << 36, 1024, PinnedPoolOptions{.populate = false, .cuda_register = false});
    GTEST_SKIP() << "the kernel granted a 64 TiB mapping (overcommit=1?)";
  } catch (const IoError& e) {
    EXPECT_NE(e.err(), 0);
    EXPECT_NE(std::string(e.what()).find("mmap"), std::string::npos) << e.what();
  }
}

TEST(PinnedPool, OptionsPopulateAndNoRegistration) {
  PinnedPool pool(8192, 2, PinnedPoolOptions{.populate = true, .cuda_register = false});
  EXPECT_FALSE(pool.registered());
  auto l = pool.acquire();
  auto* p = static_cast<unsigned char*>(l.data());
  EXPECT_EQ(p[0], 0);  // anonymous memory starts zeroed
  EXPECT_EQ(p[l.size() - 1], 0);
}

TEST(PinnedPool, RegisteredExactlyWhenADriverAccepts) {
  if (cuda::driver() != nullptr) cuda::driver()->bind_device(0);  // the device the pool serves
  PinnedPool pool(1 << 20, 2);
  if (cuda::driver() == nullptr) {
    EXPECT_FALSE(pool.registered());
  } else {
    // A refusal is legal (one warning) but unexpected on a normal GPU machine.
    EXPECT_TRUE(pool.registered()) << "cuMemHostRegister refused the staging pool";
  }
}

TEST(PinnedPool, RegistersOnFirstNeedWhenMadeHostOnly) {
  PinnedPoolOptions o;
  o.cuda_register = false;
  PinnedPool pool(4096, 2, o);
  EXPECT_FALSE(pool.registered());
  const bool expect = cuda::driver() != nullptr;
  if (expect) cuda::driver()->bind_device(0);  // the device the pool serves
  EXPECT_EQ(pool.ensure_registered(), expect);
  EXPECT_EQ(pool.registered(), expect);
  EXPECT_EQ(pool.ensure_registered(), expect) << "idempotent";
  auto lease = pool.acquire();
  std::memset(lease.data(), 1, lease.size());
}

using test::two_devices;

PinnedPoolOptions registering_with(cuda::Driver& drv) {
  PinnedPoolOptions o;
  o.driver = &drv;
  return o;
}

// Note [Registration context] in host_mapping.cpp: a pool registers in the
// context current where it is made and is released in it on any thread,
// leaving that thread's context as it was (none here: the test's thread never
// bound one, so no context is made on device 0).
TEST(PinnedPool, RegistersInTheContextCurrentAndIsReleasedInItAnywhere) {
  test::SimDriver drv(two_devices());
  std::optional<PinnedPool> pool;
  std::thread([&] {
    drv.bind_device(1);
    pool.emplace(4096, 2, registering_with(drv));
    EXPECT_TRUE(pool->registered());
  }).join();
  pool.reset();
  EXPECT_EQ(drv.current_context(), 0u);
  EXPECT_EQ(drv.registers(), 1);
  EXPECT_EQ(drv.unregisters(), 1);
  EXPECT_EQ(drv.contexts(), std::set<int>{1});
  EXPECT_TRUE(drv.errors().empty()) << test::SimDriver::join_lines(drv.errors());
}

// A pool made where no context is current stays pageable (no context is made
// for it) until ensure_registered() runs with its device bound, or is given one.
TEST(PinnedPool, MadeWithoutAContextWaitsForEnsureRegistered) {
  test::SimDriver drv(two_devices());
  std::thread([&] {
    PinnedPool pool(4096, 2, registering_with(drv));
    EXPECT_FALSE(pool.registered());
    EXPECT_EQ(drv.registers(), 0);
    try {
      pool.ensure_registered();
      ADD_FAILURE() << "registered without a context";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("cuMemHostRegister"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(pool.ensure_registered(1));
    EXPECT_EQ(drv.current_context(), 0u) << "ensure_registered(1) left device 1 bound";
    EXPECT_TRUE(pool.ensure_registered(0)) << "idempotent, binding nothing";
  }).join();
  EXPECT_EQ(drv.registers(), 1);
  EXPECT_EQ(drv.unregisters(), 1);
  EXPECT_EQ(drv.contexts(), std::set<int>{1});
  EXPECT_EQ(drv.errors().size(), 1u) << test::SimDriver::join_lines(drv.errors());
}

TEST(BorrowPinnedPool, RegistersWithTheProcessDriverOnly) {
  test::SimDriver drv(1e9, 1e9);
  EXPECT_THROW(borrow_pinned_pool(4096, 1, registering_with(drv)), InvalidArgument);
}

// Note [Reused staging]: a borrowed pool of the same shape comes back (the
// same memory), other shapes get their own, concurrent borrowers never share
// one, and idle bytes stay bounded.
TEST(BorrowPinnedPool, ReturnsIdlePoolsOfTheSameShapeAndBoundsIdleBytes) {
  const size_t page = PinnedPool::page_size();
  PinnedPoolOptions host_only;
  host_only.cuda_register = false;
  const size_t before = idle_pinned_bytes();
  void* base = nullptr;
  {
    auto a = borrow_pinned_pool(3 * page + 1, 5, host_only);  // rounded to 4 pages, as the pool does
    base = a->base();
    std::memset(a->buffer(4), 0x5A, a->buffer_bytes());
  }
  EXPECT_EQ(idle_pinned_bytes(), before + 20 * page);
  {
    auto again = borrow_pinned_pool(4 * page, 5, host_only);
    EXPECT_EQ(again->base(), base);
    EXPECT_EQ(static_cast<unsigned char*>(again->buffer(4))[0], 0x5A);  // the same memory, not zeroed
    EXPECT_EQ(idle_pinned_bytes(), before);
    auto other = borrow_pinned_pool(4 * page, 5, host_only);  // a second borrower: a pool of its own
    EXPECT_NE(other->base(), base);
    auto shape = borrow_pinned_pool(4 * page, 6, host_only);
    EXPECT_NE(shape->base(), base);
    EXPECT_EQ(shape->count(), 6u);
  }
  EXPECT_EQ(idle_pinned_bytes(), before + 20 * page + 20 * page + 24 * page);
  {  // A pool too large to keep idle is unmapped when it comes back.
    auto big = borrow_pinned_pool(kMaxIdlePinnedBytes / 2 + page, 2, host_only);
  }
  EXPECT_LE(idle_pinned_bytes(), kMaxIdlePinnedBytes);
  EXPECT_EQ(idle_pinned_bytes(), before + 64 * page);
  // Leave the cache as found for the tests after this one.
  auto x = borrow_pinned_pool(4 * page, 5, host_only), y = borrow_pinned_pool(4 * page, 5, host_only);
  auto z = borrow_pinned_pool(4 * page, 6, host_only);
  EXPECT_EQ(idle_pinned_bytes(), before);
  for (PinnedPool* p : {x.release(), y.release(), z.release()}) delete p;  // unmapped, not returned
}

TEST(PinnedPoolDeathTest, DestroyingWithLeasesOutAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto* pool = new PinnedPool(4096, 2);
        auto lease = pool->acquire();
        delete pool;
      },
      "still leased");
}

}  // namespace
}  // namespace ebbtide::mem
