// HostMapping and HostBufferPool: page-aligned mappings, reuse by size and
// size class, the spare bound, registration with the driver only when asked
// and only in the context of the device bound (against the simulated driver,
// which counts cuMemHostRegister / Unregister calls and the contexts made),
// and pinned memory across fork().
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/mem/buffer_pool.hpp"
#include "ebbtide/mem/host_mapping.hpp"
#include "ebbtide/util/error.hpp"
#include "sim_driver.hpp"
#include "test_utils.hpp"

namespace ebbtide::mem {
namespace {

bool page_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % HostMapping::page_size() == 0; }

HostBufferPoolOptions pinning_with(cuda::Driver& drv) {
  HostBufferPoolOptions o;
  o.driver = &drv;
  return o;
}

using test::contains;

using test::two_devices;

// The context of device `d` as the simulated driver names it (0: none).
cuda::Context context_of(int d) { return static_cast<cuda::Context>(d + 1); }

// The simulated driver, noting the context current at each unregistration.
class UnregisterLog final : public cuda::Driver {
 public:
  explicit UnregisterLog(test::SimDriver& sim) : sim_(sim) {}
  std::vector<cuda::Context> contexts() {
    std::lock_guard<std::mutex> lock(mu_);
    return contexts_;
  }
  void host_unregister(void* p) override {
    sim_.host_unregister(p);
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.push_back(sim_.current_context());
  }
  bool host_register(void* p, size_t n) override { return sim_.host_register(p, n); }
  void bind_context_of(cuda::DevicePtr p) override { sim_.bind_context_of(p); }
  void bind_device(int d) override { sim_.bind_device(d); }
  cuda::Context current_context() override { return sim_.current_context(); }
  void set_current_context(cuda::Context c) override { sim_.set_current_context(c); }
  bool is_device_pointer(const void* p) override { return sim_.is_device_pointer(p); }
  void memcpy_dtoh_async(void* d, cuda::DevicePtr s, size_t n, cuda::Stream st) override { sim_.memcpy_dtoh_async(d, s, n, st); }
  void memcpy_htod_async(cuda::DevicePtr d, const void* s, size_t n, cuda::Stream st) override { sim_.memcpy_htod_async(d, s, n, st); }
  cuda::Event event_create() override { return sim_.event_create(); }
  void event_destroy(cuda::Event e) override { sim_.event_destroy(e); }
  void event_record(cuda::Event e, cuda::Stream st) override { sim_.event_record(e, st); }
  void event_synchronize(cuda::Event e) override { sim_.event_synchronize(e); }
  bool event_query(cuda::Event e) override { return sim_.event_query(e); }
  void stream_wait_event(cuda::Stream st, cuda::Event e) override { sim_.stream_wait_event(st, e); }
  cuda::Stream stream_create() override { return sim_.stream_create(); }
  void stream_destroy(cuda::Stream st) override { sim_.stream_destroy(st); }
  void stream_synchronize(cuda::Stream st) override { sim_.stream_synchronize(st); }
  int device_count() override { return sim_.device_count(); }
  std::string device_name(int d) override { return sim_.device_name(d); }

 private:
  test::SimDriver& sim_;
  std::mutex mu_;
  std::vector<cuda::Context> contexts_;
};

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
  drv.bind_device(0);  // pinning needs the device the memory serves bound (Note [Registration context])
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
  drv.bind_device(0);  // Note [Registration context]
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
  drv.bind_device(0);  // Note [Registration context]
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
  drv.bind_device(0);  // Note [Registration context]
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

// Note [Registration context]: no context current, no registration, and no
// context made up for it; the mapping can be pinned once a device is bound.
TEST(HostMapping, PinningWithoutAContextFailsNamingTheCallAndMakesNone) {
  test::SimDriver drv(two_devices());
  HostMapping m(4096, "test");
  std::thread([&] {
    try {
      m.pin(&drv);
      ADD_FAILURE() << "pinned on a thread without a context";
    } catch (const IoError& e) {
      EXPECT_TRUE(contains(e.what(), "cuMemHostRegister")) << e.what();
      EXPECT_TRUE(contains(e.what(), "CUDA_ERROR_INVALID_CONTEXT")) << e.what();
    }
    EXPECT_EQ(drv.current_context(), 0u);
  }).join();
  EXPECT_FALSE(m.pinned());
  EXPECT_FALSE(m.pin_tried()) << "an error is not a refusal: pin() may be called again";
  EXPECT_TRUE(drv.contexts().empty());
  drv.bind_device(1);
  EXPECT_TRUE(m.pin(&drv));
  EXPECT_EQ(drv.contexts(), std::set<int>{1});
}

TEST(HostBufferPool, APinnedTakeWithoutAContextFailsAndTakesNothing) {
  test::SimDriver drv(two_devices());
  HostBufferPool pool(pinning_with(drv));
  std::thread([&] {
    EXPECT_THROW(pool.take(5000, /*pin=*/true), IoError);
    pool.give(pool.take(5000).data);  // plain memory needs no context
  }).join();
  EXPECT_EQ(pool.out_bytes(), 0u);
  EXPECT_EQ(drv.registers(), 0);
  EXPECT_TRUE(drv.contexts().empty());
}

// Note [Registration context]: buffers pinned for device 1 are unregistered
// in device 1's context by whichever thread frees them, and that thread's
// context is left as it was: none here (the test's thread never bound one),
// so device 0's context is never made.
TEST(HostBufferPool, PinnedOnDeviceOneAndFreedOnAThreadWithoutAContext) {
  test::SimDriver sim(two_devices());
  UnregisterLog drv(sim);
  std::optional<HostBufferPool> pool(std::in_place, pinning_with(drv));
  void* kept = nullptr;
  std::thread([&] {
    drv.bind_device(1);
    HostBufferPool::Buffer spare = pool->take(5000, /*pin=*/true);
    HostBufferPool::Buffer out = pool->take(3 << 20, /*pin=*/true);
    EXPECT_TRUE(spare.pinned && out.pinned);
    pool->give(spare.data);
    kept = out.data;
  }).join();
  pool->give(kept);
  pool.reset();  // unregisters the spare and the buffer given back
  EXPECT_EQ(drv.current_context(), 0u) << "the freeing thread was left a context";
  EXPECT_EQ(sim.unregisters(), 2);
  EXPECT_EQ(drv.contexts(), (std::vector<cuda::Context>{context_of(1), context_of(1)}));
  EXPECT_EQ(sim.contexts(), std::set<int>{1}) << "a context was made on device 0";
  EXPECT_TRUE(sim.errors().empty()) << test::SimDriver::join_lines(sim.errors());
}

// ... and a thread with another device current gets it back.
TEST(HostMapping, UnregistersInThePinningContextAndRestoresTheCallers) {
  test::SimDriver sim(two_devices());
  UnregisterLog drv(sim);
  HostMapping m(4096, "test");
  std::thread([&] {
    drv.bind_device(1);
    EXPECT_TRUE(m.pin(&drv));
  }).join();
  drv.bind_device(0);
  m = HostMapping();
  EXPECT_EQ(drv.contexts(), std::vector<cuda::Context>{context_of(1)});
  EXPECT_EQ(drv.current_context(), context_of(0));
  EXPECT_TRUE(sim.errors().empty()) << test::SimDriver::join_lines(sim.errors());
}

// Note [Buffer reuse]: whole pages up to 8, then at most 1/8 of slack.
TEST(HostBufferPool, PinnedSizeClassesLeaveAtMostAnEighthUnused) {
  const size_t page = HostMapping::page_size();
  EXPECT_EQ(HostBufferPool::pinned_size_class(1), page);
  EXPECT_EQ(HostBufferPool::pinned_size_class(8 * page), 8 * page);
  EXPECT_EQ(HostBufferPool::pinned_size_class(8 * page + 1), 9 * page);
  EXPECT_EQ(HostBufferPool::pinned_size_class(size_t{100} << 20), size_t{104} << 20);
  std::mt19937_64 rng(3);
  size_t last = 0;
  for (size_t n = 1; n < (size_t{1} << 34); n += 1 + rng() % (n / 3 + 1)) {
    const size_t c = HostBufferPool::pinned_size_class(n);
    const size_t pages = (n + page - 1) / page * page;
    ASSERT_GE(c, pages) << n;
    ASSERT_LE(c - pages, pages / 8) << n;
    ASSERT_EQ(c % page, 0u) << n;
    ASSERT_EQ(HostBufferPool::pinned_size_class(c), c) << n;
    ASSERT_GE(c, last) << n;
    last = c;
  }
}

// A take() is served by the smallest spare of at least its class, up to twice it.
TEST(HostBufferPool, APinnedTakeGetsTheSmallestFittingSpare) {
  const size_t page = HostMapping::page_size();
  test::SimDriver drv(1e9, 1e9);
  drv.bind_device(0);
  HostBufferPool pool(pinning_with(drv));
  std::vector<HostBufferPool::Buffer> first;
  for (size_t pages : {16, 12, 10}) first.push_back(pool.take(pages * page, /*pin=*/true));
  for (const auto& b : first) pool.give(b.data);
  HostBufferPool::Buffer nine = pool.take(9 * page - 100, /*pin=*/true);
  EXPECT_EQ(nine.data, first[2].data);
  EXPECT_EQ(nine.bytes, 10 * page);
  EXPECT_TRUE(nine.pinned);
  HostBufferPool::Buffer five = pool.take(5 * page, /*pin=*/true);  // 12 and 16 pages: more than twice
  EXPECT_EQ(five.bytes, 5 * page);
  EXPECT_EQ(drv.registers(), 4);
  HostBufferPool::Buffer eleven = pool.take(11 * page, /*pin=*/true);
  EXPECT_EQ(eleven.data, first[1].data);
  EXPECT_EQ(pool.reused(), 2u);
  for (void* p : {nine.data, five.data, eleven.data}) pool.give(p);
  EXPECT_EQ(pool.registrations(), 4u);
}

// Note [Buffer reuse], dynamic shapes: a step's activations all scale with
// its sequence length. Once the longest has been seen, steps of any length
// down to half of it register nothing new, and spares stay within the most
// bytes ever out at once.
TEST(HostBufferPool, VariableSizesWithinASeenRangeRegisterNothingAfterTheFirstStep) {
  test::SimDriver drv(1e9, 1e9);
  drv.bind_device(0);
  HostBufferPool pool(pinning_with(drv));
  size_t most_out = 0;
  auto step = [&](size_t seq) {
    std::vector<void*> out;
    for (int layer = 0; layer < 4; ++layer) {
      for (size_t per_token : {16, 2048, 2048, 8192, 8192}) {  // a norm's statistics, inputs, a wide MLP's
        const size_t n = seq * per_token;
        HostBufferPool::Buffer b = pool.take(n, /*pin=*/true);
        EXPECT_TRUE(b.pinned);
        EXPECT_GE(b.bytes, n);
        static_cast<unsigned char*>(b.data)[0] = 1;
        static_cast<unsigned char*>(b.data)[n - 1] = 1;
        out.push_back(b.data);
      }
    }
    most_out = std::max(most_out, pool.out_bytes());
    for (void* p : out) pool.give(p);
  };
  step(1024);
  const int first = drv.registers();
  EXPECT_EQ(first, 20);
  std::mt19937 rng(7);
  for (int i = 0; i < 30; ++i) {
    const size_t seq = i == 0 ? 512 : i == 1 ? 1024 : 512 + rng() % 513;
    step(seq);
    EXPECT_EQ(drv.registers(), first) << "step " << i << ", sequence length " << seq;
    EXPECT_LE(pool.spare_bytes(), most_out);
    EXPECT_EQ(pool.out_bytes(), 0u);
  }
  EXPECT_EQ(pool.registrations(), static_cast<uint64_t>(first));
}

// Note [Host staging]: blobs the driver would not pin are copied through the
// store's staging pool, registered with the store's driver in the context
// bound for the copy.
TEST(HostBufferPool, TheHostStoreStagesWithItsDriverInTheBoundContext) {
  test::SimDriver drv(two_devices());
  drv.bind_device(1);
  drv.allow_register = false;
  auto store = cache::make_host_store(cache::HostStoreOptions{0, 1 << 16, &drv});
  std::vector<unsigned char> device(100000, 0x5C), back(100000);
  const cache::Location loc = store->put(mem::Buffer{device.data(), device.size(), 1, 0}, cache::kTierFirst);
  store->get(loc, mem::Buffer{back.data(), back.size(), 1, 0});
  EXPECT_EQ(back, device);
  store->free(loc);
  EXPECT_EQ(drv.registers(), 2) << "the blob, then the staging pool, with the store's driver";
  store.reset();
  EXPECT_EQ(drv.contexts(), std::set<int>{1});
  EXPECT_TRUE(drv.errors().empty()) << test::SimDriver::join_lines(drv.errors());
}

// The host store counts the registrations of its blobs (StoreStats), and
// reuses a larger pinned blob for a smaller one.
TEST(HostBufferPool, TheHostStoreCountsItsRegistrations) {
  test::SimDriver drv(1e9, 1e9);
  drv.bind_device(0);
  auto store = cache::make_host_store(cache::HostStoreOptions{0, 1 << 16, &drv});
  for (uint64_t n : {uint64_t{3} << 20, uint64_t{2} << 20, uint64_t{3} << 20}) {
    cache::HostSpace space = store->reserve_host(n);
    EXPECT_TRUE(space.pinned);
    store->free(space.loc);
  }
  EXPECT_EQ(store->stats().host_registrations, 1u);
  drv.allow_register = false;
  store->free(store->reserve_host(100000).loc);  // a new blob, refused: still a call
  EXPECT_EQ(store->stats().host_registrations, 2u);
  EXPECT_EQ(drv.registers(), 2);
}

// Whether the mapping holding `p` has `flag` among its VmFlags in
// /proc/self/smaps ("dc": not copied on fork); nullopt when not found.
std::optional<bool> vm_flag(const void* p, const std::string& flag) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = lo <= addr && addr < hi;
      continue;
    }
    if (inside && line.rfind("VmFlags:", 0) == 0) {
      std::istringstream flags(line.substr(8));
      for (std::string f; flags >> f;)
        if (f == flag) return true;
      return false;
    }
  }
  return std::nullopt;
}

// Note [Pinned memory across fork]: pinned ranges are not copied into a
// forked child; the child's copies of the objects see fresh, writable,
// unpinned memory at the same addresses, reuse and free it without calling
// the driver, and the parent's pinned memory is untouched and still pinned.
// Unpinned memory is inherited as usual.
TEST(HostMapping, AForkedChildGetsFreshUnpinnedMemoryAndNeverCallsTheDriver) {
  const size_t page = HostMapping::page_size();
  test::SimDriver drv(1e9, 1e9);
  drv.bind_device(0);
  HostMapping pinned(3 * page, "test");
  ASSERT_TRUE(pinned.pin(&drv));
  std::memset(pinned.data(), 0x11, pinned.size());
  HostMapping plain(2 * page, "test");
  std::memset(plain.data(), 0x33, plain.size());
  std::optional<HostBufferPool> pool(std::in_place, pinning_with(drv));
  HostBufferPool::Buffer buf = pool->take(5 * page, /*pin=*/true);
  ASSERT_TRUE(buf.pinned);
  std::memset(buf.data, 0x22, buf.bytes);
  EXPECT_EQ(vm_flag(pinned.data(), "dc"), std::optional<bool>(true));
  EXPECT_EQ(vm_flag(buf.data, "dc"), std::optional<bool>(true));
  EXPECT_EQ(vm_flag(plain.data(), "dc"), std::optional<bool>(false));
  const int registers = drv.registers();
  const int unregisters = drv.unregisters();
  const size_t errors = drv.errors().size();

  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // the child: no gtest assertions, a bit of the exit status per failed check
    int failed = 0;
    auto check = [&](bool ok, int bit) {
      if (!ok) failed |= 1 << bit;
    };
    auto all = [](const void* p, size_t n, unsigned char v) {
      const auto* b = static_cast<const unsigned char*>(p);
      for (size_t i = 0; i < n; ++i)
        if (b[i] != v) return false;
      return true;
    };
    check(!pinned.pinned(), 0);
    check(all(pinned.data(), pinned.size(), 0), 1);  // fresh: pinned contents are not inherited
    std::memset(pinned.data(), 0x55, pinned.size());
    check(all(plain.data(), plain.size(), 0x33), 2);
    pool->give(buf.data);
    HostBufferPool::Buffer again = pool->take(5 * page, /*pin=*/true);
    check(again.data == buf.data && !again.pinned, 3);
    std::memset(again.data, 0x66, again.bytes);
    pool->give(again.data);
    pool.reset();
    pinned = HostMapping();
    check(drv.registers() == registers && drv.unregisters() == unregisters && drv.errors().size() == errors, 4);
    ::_exit(failed);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died: status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "failed checks in the child (bits: 0 pinned, 1 contents inherited, "
                                       "2 unpinned memory lost, 3 pool buffer, 4 driver called)";
  const auto* p = static_cast<const unsigned char*>(pinned.data());
  EXPECT_EQ(std::count(p, p + pinned.size(), 0x11), static_cast<std::ptrdiff_t>(pinned.size()));
  const auto* q = static_cast<const unsigned char*>(buf.data);
  EXPECT_EQ(std::count(q, q + buf.bytes, 0x22), static_cast<std::ptrdiff_t>(buf.bytes));
  EXPECT_TRUE(pinned.pinned());
  pool->give(buf.data);
  pool.reset();
  pinned = HostMapping();
  EXPECT_EQ(drv.unregisters(), unregisters + 2);
  EXPECT_TRUE(drv.errors().empty()) << test::SimDriver::join_lines(drv.errors());
}

}  // namespace
}  // namespace ebbtide::mem
