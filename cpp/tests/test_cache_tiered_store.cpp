// Tiered store: routing by tier hint, spill past the host budget, meters,
// the SSD write cap (token bucket), bad input.
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "ebbtide/cache/rate_limiter.hpp"
#include "ebbtide/cache/store.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::cache {
namespace {

std::unique_ptr<Store> host(uint64_t capacity) {
  HostStoreOptions o;
  o.capacity_bytes = capacity;
  return make_host_store(o);
}

std::unique_ptr<Store> ssd(const std::string& dir) {
  SsdStoreOptions o;
  o.dirs = {dir};
  o.apply_env = false;
  return make_ssd_store(o);
}

mem::Buffer buffer(std::vector<char>& v) { return mem::Buffer{v.data(), v.size()}; }

TEST(RateLimiter, BoundsTheRateAcrossThreads) {
  RateLimiter l(20e6);  // 20 MB/s
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < 2; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 5; ++i) l.acquire(1 << 20);
    });
  for (auto& t : ts) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // 10 MiB at 20 MB/s less one burst (<= 4 MiB): a lower bound only (sleeps never end early).
  EXPECT_GE(s, (10.0 * (1 << 20) - 4.0 * (1 << 20)) / 20e6);
}

TEST(RateLimiter, UnlimitedNeverSleepsAndBadRatesThrow) {
  RateLimiter l;
  EXPECT_EQ(l.acquire(1ull << 40), 0.0);
  EXPECT_THROW(l.set_rate(-1), InvalidArgument);
  EXPECT_THROW(RateLimiter{std::nan("")}, InvalidArgument);
  l.set_rate(1e6);
  EXPECT_DOUBLE_EQ(l.rate(), 1e6);
}

TEST(TieredStore, HostFirstThenSpillsToSsdAndRoundTrips) {
  test::TempDir dir;
  TieredStoreOptions o;
  o.cpu = host(3 << 20);
  o.ssd = ssd(dir.path());
  auto s = make_tiered_store(std::move(o));
  std::vector<std::vector<char>> blobs;
  std::vector<Location> locs;
  for (int i = 0; i < 5; ++i) {
    blobs.emplace_back(1 << 20, static_cast<char>('a' + i));
    locs.push_back(s->put(buffer(blobs.back()), kTierFirst));
  }
  StoreStats st = s->stats();
  EXPECT_EQ(st.tiers[kTierCpu].bytes_held, 3u << 20);
  EXPECT_EQ(st.tiers[kTierSsd].bytes_held, 2u << 20);
  EXPECT_EQ(st.tiers[kTierCpu].bytes_written + st.tiers[kTierSsd].bytes_written, 5u << 20);
  EXPECT_EQ(st.bytes_held, 5u << 20);
  // An explicit SSD hint skips the host tier even with room there.
  s->free(locs[0]);
  std::vector<char> extra(1 << 20, 'z');
  const Location l = s->put(buffer(extra), kTierSsd);
  EXPECT_EQ(s->stats().tiers[kTierSsd].bytes_held, 3u << 20);
  for (int i = 1; i < 5; ++i) {
    std::vector<char> back(1 << 20);
    s->get(locs[i], buffer(back));
    EXPECT_EQ(back, blobs[i]) << i;
  }
  std::vector<char> back(1 << 20);
  s->get(l, buffer(back));
  EXPECT_EQ(back, extra);
  st = s->stats();
  EXPECT_EQ(st.tiers[kTierCpu].bytes_read + st.tiers[kTierSsd].bytes_read, 5u << 20);
  EXPECT_GT(st.tiers[kTierSsd].write_seconds, 0);
}

TEST(TieredStore, HostOnlyFullFailsWithEnospc) {
  TieredStoreOptions o;
  o.cpu = host(1 << 20);
  auto s = make_tiered_store(std::move(o));
  std::vector<char> a(1 << 20, 'a'), b(1, 'b');
  s->put(buffer(a), kTierFirst);
  try {
    s->put(buffer(b), kTierFirst);
    FAIL() << "expected ENOSPC";
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), ENOSPC);
  }
  EXPECT_FALSE(s->stats().tiers[kTierSsd].present);
  EXPECT_THROW(s->set_write_limit(kTierSsd, 1e6), InvalidArgument);  // no SSD tier to cap
}

TEST(TieredStore, WriteCapSlowsSsdPutsAndShowsInTheMeter) {
  test::TempDir dir;
  TieredStoreOptions o;
  o.ssd = ssd(dir.path());
  o.ssd_max_write_bps = 20e6;
  auto s = make_tiered_store(std::move(o));
  std::vector<char> v(1 << 20, 'x');
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 10; ++i) s->free(s->put(buffer(v), kTierFirst));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(secs, 0.3);
  const StoreStats st = s->stats();
  EXPECT_GE(st.tiers[kTierSsd].write_seconds, 0.3);
  EXPECT_DOUBLE_EQ(st.tiers[kTierSsd].write_limit_bps, 20e6);
  s->set_write_limit(kTierSsd, 0);  // lifted
  EXPECT_DOUBLE_EQ(s->stats().tiers[kTierSsd].write_limit_bps, 0);
  EXPECT_THROW(s->set_write_limit(kTierSsd, -5), InvalidArgument);
  EXPECT_THROW(s->set_write_limit(kTierCpu, 5), InvalidArgument);
}

TEST(TieredStore, BadInput) {
  EXPECT_THROW(make_tiered_store(TieredStoreOptions{}), InvalidArgument);
  TieredStoreOptions o;
  o.cpu = host(0);
  auto s = make_tiered_store(std::move(o));
  std::vector<char> v(16, 'x');
  EXPECT_THROW(s->put(buffer(v), 7), InvalidArgument);
  EXPECT_THROW(host(0)->set_write_limit(kTierSsd, 1), Unsupported);
}

}  // namespace
}  // namespace ebbtide::cache
