// HostMapping and HostBufferPool: page-aligned mappings, reuse by size, the
// spare bound, and registration with the driver only when asked (against the
// simulated driver, which counts cuMemHostRegister / Unregister calls).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "ebbtide/mem/buffer_pool.hpp"
#include "ebbtide/mem/host_mapping.hpp"
#include "ebbtide/util/error.hpp"
#include "sim_driver.hpp"

namespace ebbtide::mem {
namespace {

bool page_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % HostMapping::page_size() == 0; }

HostBufferPoolOptions pinning_with(test::SimDriver& drv) {
  HostBufferPoolOptions o;
  o.driver = &drv;
  return o;
}

TEST(HostMapping, MapsWholeZeroedPages) {
  const size_t page = HostMapping::page_size();
  HostMapping m(page + 1, "test");
  ASSERT_TRUE(m);
  EXPECT_TRUE(page_aligned(m.data()));
  EXPECT_EQ(m.size(), 2 * page);
  auto* p = static_cast<unsigned char*>(m.data());
  EXPECT_EQ(p[0], 0);
  EXPECT_EQ(p[m.size() - 1], 0);
  std::memset(p, 7, m.size());
  EXPECT_FALSE(m.pinned());
  EXPECT_FALSE(m.pin(nullptr)) << "no driver: stays unpinned";
  EXPECT_FALSE(m.pin_tried());
}

// Note [Huge-page buffers]: an I/O buffer of 2 MiB or more starts on a 2 MiB
// boundary, keeps exactly its page-rounded size (the slack around the
// alignment is unmapped: ASan and the kernel would see a leak or a double
// unmap), and populate still hands back zeroed, writable memory.
TEST(HostMapping, IoBuffersOfTwoMiBAndMoreAreHugePageAligned) {
  constexpr size_t kHuge = HostMapping::kHugePage;
  const size_t page = HostMapping::page_size();
  for (bool populate : {false, true}) {
    for (size_t bytes : {kHuge, 3 * kHuge + page + 1, 64 * kHuge}) {
      HostMapping m(bytes, "test", populate, /*huge=*/true);
      ASSERT_TRUE(m);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(m.data()) % kHuge, 0u) << bytes;
      EXPECT_EQ(m.size(), (bytes + page - 1) / page * page);
      auto* p = static_cast<unsigned char*>(m.data());
      EXPECT_EQ(p[0], 0);
      EXPECT_EQ(p[m.size() - 1], 0);
      std::memset(p, 5, m.size());
      HostMapping moved(std::move(m));
      EXPECT_EQ(static_cast<unsigned char*>(moved.data())[moved.size() / 2], 5);
    }
  }
  HostMapping small(kHuge - page, "test", false, /*huge=*/true);  // below 2 MiB: plain pages
  EXPECT_TRUE(page_aligned(small.data()));
  EXPECT_EQ(small.size(), kHuge - page);
}

TEST(HostMapping, RejectsBadSizesNamingTheOwner) {
  try {
    HostMapping(0, "snapshot arena");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("snapshot arena"), std::string::npos) << e.what();
  }
  EXPECT_THROW(HostMapping(std::numeric_limits<size_t>::max(), "test"), InvalidArgument);
}

TEST(HostMapping, PinsOnceAndUnregistersWithTheSameDriver) {
  test::SimDriver drv(1e9, 1e9);
  {
    HostMapping m(4096, "test");
    EXPECT_TRUE(m.pin(&drv));
    EXPECT_TRUE(m.pin(&drv)) << "idempotent";
    EXPECT_EQ(drv.registers(), 1);
    HostMapping moved(std::move(m));
    EXPECT_FALSE(m);  // NOLINT(bugprone-use-after-move): a moved-from mapping is empty
    EXPECT_TRUE(moved.pinned());
    EXPECT_EQ(drv.unregisters(), 0) << "a move hands the registration over";
  }
  EXPECT_EQ(drv.unregisters(), 1);
}

TEST(HostMapping, ARefusedPinIsNotRetried) {
  test::SimDriver drv(1e9, 1e9);
  drv.allow_register = false;
  {
    HostMapping m(4096, "test");
    EXPECT_FALSE(m.pin(&drv));
    EXPECT_TRUE(m.pin_tried());
    EXPECT_FALSE(m.pin(&drv));
    EXPECT_EQ(drv.registers(), 1);
  }
  EXPECT_EQ(drv.unregisters(), 0) << "nothing to unregister";
}

TEST(HostBufferPool, AlignedReusedAndBounded) {
  HostBufferPool pool;
  void* a = pool.take(5000).data;
  void* b = pool.take(5000).data;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % HostBufferPoolOptions{}.align, 0u);
  EXPECT_EQ(pool.out_bytes(), 2 * 8192u);
  std::memset(a, 1, 5000);
  pool.give(a);
  pool.give(b);
  EXPECT_EQ(pool.spare_bytes(), 2 * 8192u);
  void* c = pool.take(8000).data;  // same rounded size: reused
  EXPECT_TRUE(c == a || c == b);
  EXPECT_EQ(pool.reused(), 1u);
  EXPECT_THROW(pool.give(reinterpret_cast<void*>(0x1000)), StateError);
  pool.give(c);
  void* big = pool.take(1 << 20).data;  // more than ever out: spares stay bounded
  pool.give(big);
  EXPECT_LE(pool.spare_bytes(), (1u << 20) + 8192u);
  EXPECT_THROW(pool.take(0), InvalidArgument);
}

TEST(HostBufferPool, ReusesByRoundedSizeOnly) {
  HostBufferPoolOptions o;
  o.align = 64;
  HostBufferPool pool(o);
  HostBufferPool::Buffer a = pool.take(100);
  EXPECT_EQ(a.bytes, 128u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data) % 64, 0u);
  EXPECT_FALSE(a.pinned);
  pool.give(a.data);
  HostBufferPool::Buffer b = pool.take(200);  // 256 bytes: no spare of that size
  EXPECT_EQ(b.bytes, 256u);
  EXPECT_EQ(pool.reused(), 0u);
  HostBufferPool::Buffer c = pool.take(65);  // 128 bytes: a's buffer again
  EXPECT_EQ(c.data, a.data);
  EXPECT_EQ(pool.reused(), 1u);
  pool.give(b.data);
  pool.give(c.data);
  EXPECT_THROW(pool.give(c.data), StateError) << "given back twice";
  o.align = 48;
  EXPECT_THROW(HostBufferPool{o}, InvalidArgument);
}

TEST(HostBufferPool, SparesNeverExceedTheMostBytesEverOut) {
  HostBufferPool pool;
  void* a = pool.take(4096).data;
  void* b = pool.take(4096).data;
  void* c = pool.take(4096).data;
  pool.give(a);
  pool.give(b);
  pool.give(c);
  EXPECT_EQ(pool.spare_bytes(), 3 * 4096u);  // the high water: 12 KiB out at once
  void* d = pool.take(8192).data;            // no spare of this size: a new buffer
  EXPECT_EQ(pool.reused(), 0u);
  pool.give(d);
  EXPECT_EQ(pool.spare_bytes(), 3 * 4096u) << "12 + 8 KiB of spares would pass the 12 KiB high water";
  EXPECT_EQ(pool.out_bytes(), 0u);
}

TEST(HostBufferPool, PlainBuffersNeverTouchTheDriver) {
  test::SimDriver drv(1e9, 1e9);
  {
    HostBufferPool pool(pinning_with(drv));
    HostBufferPool::Buffer a = pool.take(10000);
    EXPECT_FALSE(a.pinned);
    pool.give(a.data);
    pool.give(pool.take(10000).data);
  }
  EXPECT_EQ(drv.registers(), 0);
  EXPECT_EQ(drv.unregisters(), 0);
}

TEST(HostBufferPool, PinnedBuffersAreRegisteredOnceAndReusedRegistered) {
  test::SimDriver drv(1e9, 1e9);
  {
    HostBufferPool pool(pinning_with(drv));
    HostBufferPool::Buffer a = pool.take(5000, /*pin=*/true);
    EXPECT_TRUE(a.pinned);
    EXPECT_TRUE(page_aligned(a.data));
    EXPECT_EQ(a.bytes, 2 * HostMapping::page_size());
    pool.give(a.data);
    HostBufferPool::Buffer plain = pool.take(5000);  // a plain request never gets the pinned spare
    EXPECT_NE(plain.data, a.data);
    EXPECT_FALSE(plain.pinned);
    HostBufferPool::Buffer again = pool.take(5000, /*pin=*/true);
    EXPECT_EQ(again.data, a.data);
    EXPECT_TRUE(again.pinned);
    EXPECT_EQ(drv.registers(), 1);
    pool.give(plain.data);
    pool.give(again.data);
    EXPECT_EQ(drv.unregisters(), 0) << "spares stay registered";
  }
  EXPECT_EQ(drv.unregisters(), 1) << "the pool unregisters its pinned buffers when it dies";
}

TEST(HostBufferPool, ARefusedBufferIsReusedUnpinnedWithoutAskingAgain) {
  test::SimDriver drv(1e9, 1e9);
  drv.allow_register = false;
  {
    HostBufferPool pool(pinning_with(drv));
    HostBufferPool::Buffer a = pool.take(4096, /*pin=*/true);
    EXPECT_FALSE(a.pinned);
    EXPECT_TRUE(page_aligned(a.data));
    pool.give(a.data);
    HostBufferPool::Buffer b = pool.take(4096, /*pin=*/true);
    EXPECT_EQ(b.data, a.data);
    EXPECT_FALSE(b.pinned);
    EXPECT_EQ(drv.registers(), 1);
    // A driver that accepts again gets asked for new buffers only; the
    // refused one stays second choice behind pinned spares.
    drv.allow_register = true;
    HostBufferPool::Buffer c = pool.take(4096, /*pin=*/true);
    EXPECT_TRUE(c.pinned);
    EXPECT_EQ(drv.registers(), 2);
    pool.give(b.data);
    pool.give(c.data);
    HostBufferPool::Buffer d = pool.take(4096, /*pin=*/true);
    EXPECT_EQ(d.data, c.data) << "a pinned spare comes before a refused one";
    pool.give(d.data);
  }
  EXPECT_EQ(drv.unregisters(), 1);
}

TEST(HostBufferPool, PinWithoutADriverMapsUnpinnedPages) {
  HostBufferPool pool;
  HostBufferPool::Buffer a = pool.take(100, /*pin=*/true);
  EXPECT_FALSE(a.pinned);
  EXPECT_TRUE(page_aligned(a.data));
  EXPECT_EQ(a.bytes, HostMapping::page_size());
  pool.give(a.data);
}

}  // namespace
}  // namespace ebbtide::mem
