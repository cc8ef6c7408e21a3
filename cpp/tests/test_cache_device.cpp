// The device path of the tensor cache against a fake CUDA driver: "device"
// memory is host memory and copies are synchronous, but every event, stream
// and wait the cache issues is recorded, so the ordering contract of Note
// [Store workers] can be checked without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <future>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/cache/tensor_cache.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::cache {
namespace {

// Contexts are modelled too: a thread has a current device (none at first);
// events belong to the device current at creation, and creating, recording or
// waiting on one needs that device current, as with the real driver.
class FakeDriver final : public mem::cuda::Driver {
 public:
  void bind_context_of(mem::cuda::DevicePtr) override { current_ = 0; }
  void bind_device(int d) override {
    EBB_CHECK(d >= 0 && d < device_count(), "fake: no device ", d);
    current_ = d;
  }
  mem::cuda::Context current_context() override { return static_cast<mem::cuda::Context>(current_ + 1); }
  void set_current_context(mem::cuda::Context c) override { current_ = static_cast<int>(c) - 1; }
  static int current() { return current_; }
  bool is_device_pointer(const void*) override { return true; }
  void memcpy_dtoh_async(void* dst, mem::cuda::DevicePtr src, size_t n, mem::cuda::Stream s) override {
    need_context("cuMemcpyDtoHAsync");
    log("dtoh", s);
    dtoh_gate_.pass();  // hold_dtoh: the copy "runs" until released (a long store on a real GPU)
    std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  }
  void memcpy_htod_async(mem::cuda::DevicePtr dst, const void* src, size_t n, mem::cuda::Stream s) override {
    need_context("cuMemcpyHtoDAsync");
    log("htod", s);
    std::memcpy(reinterpret_cast<void*>(dst), src, n);
  }
  mem::cuda::Event event_create() override {
    need_context("cuEventCreate");
    std::lock_guard<std::mutex> lock(mu_);
    ++next_event_;
    event_device_[next_event_] = current_;
    return next_event_;
  }
  void event_destroy(mem::cuda::Event) override {}
  void event_record(mem::cuda::Event e, mem::cuda::Stream s) override {
    need_device_of(e, "cuEventRecord");
    log("record", s, e);
  }
  void event_synchronize(mem::cuda::Event e) override { log("event_sync", 0, e); }
  bool event_query(mem::cuda::Event) override { return true; }
  void stream_wait_event(mem::cuda::Stream s, mem::cuda::Event e) override {
    need_device_of(e, "cuStreamWaitEvent");
    log("wait", s, e);
  }
  mem::cuda::Stream stream_create() override {
    need_context("cuStreamCreate");
    std::lock_guard<std::mutex> lock(mu_);
    return 1000 + ++next_stream_;
  }
  void stream_destroy(mem::cuda::Stream) override {}
  void stream_synchronize(mem::cuda::Stream s) override { log("stream_sync", s); }
  bool host_register(void*, size_t) override {
    log("register", 0);
    return allow_register;
  }
  void host_unregister(void*) override { log("unregister", 0); }
  bool allow_register = false;  // as a container with a small RLIMIT_MEMLOCK
  void hold_dtoh(bool on) { dtoh_gate_.set_open(!on); }
  void wait_dtoh_started(int n) { dtoh_gate_.wait_started(n); }
  int device_count() override { return 2; }
  std::string device_name(int) override { return "fake"; }

  struct Call {
    std::string what;
    mem::cuda::Stream stream;
    mem::cuda::Event event;
  };
  std::vector<Call> calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.clear();
  }

 private:
  void log(const char* what, mem::cuda::Stream s, mem::cuda::Event e = 0) {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back({what, s, e});
  }
  static void need_context(const char* call) {
    EBB_CHECK(current_ >= 0, "fake ", call, ": CUDA_ERROR_INVALID_CONTEXT (no context current on this thread)");
  }
  void need_device_of(mem::cuda::Event e, const char* call) {
    need_context(call);
    std::lock_guard<std::mutex> lock(mu_);
    EBB_CHECK(event_device_[e] == current_, "fake ", call, ": event of device ", event_device_[e],
              " used while device ", current_, " is current");
  }
  static thread_local int current_;
  test::Gate dtoh_gate_;
  std::map<mem::cuda::Event, int> event_device_;
  std::mutex mu_;
  std::vector<Call> calls_;
  mem::cuda::Event next_event_ = 0;
  mem::cuda::Stream next_stream_ = 0;
};

thread_local int FakeDriver::current_ = -1;

size_t index_of(const std::vector<FakeDriver::Call>& calls, const std::string& what, size_t from = 0) {
  for (size_t i = from; i < calls.size(); ++i)
    if (calls[i].what == what) return i;
  return calls.size();
}

// A cache over a host store, both on the fake driver.
std::unique_ptr<TensorCache> host_cache(FakeDriver& drv, unsigned workers) {
  HostStoreOptions ho;
  ho.driver = &drv;
  CacheOptions co;
  co.driver = &drv;
  co.workers = workers;
  auto c = std::make_unique<TensorCache>(make_host_store(ho), co);
  c->begin_step();
  return c;
}

// A save of `data` as device memory of `device`, produced on `stream`.
SaveRequest device_save(const std::vector<unsigned char>& data, uint64_t key, int device,
                        mem::cuda::Stream stream) {
  SaveRequest r;
  r.key = key;
  r.src = test::host_buffer(data);
  r.src.device = device;
  r.src.stream = stream;
  return r;
}

TEST(CacheDevice, CopiesRunOnASideStreamOrderedByEvents) {
  FakeDriver drv;
  HostStoreOptions ho;
  ho.driver = &drv;
  ho.staging_bytes = 4096;  // several chunks per tensor
  CacheOptions co;
  co.driver = &drv;
  co.workers = 1;
  TensorCache c(make_host_store(ho), co);
  c.begin_step();
  const mem::cuda::Stream compute = 77;
  auto data = test::random_bytes(10000, 5);
  EntryId id = c.save(device_save(data, 1, 0, compute)).id;
  c.drain();
  auto calls = drv.calls();
  // The pack records an event on the compute stream; the worker's side stream
  // waits for it before the first device-to-host copy.
  size_t rec = index_of(calls, "record");
  ASSERT_LT(rec, calls.size());
  EXPECT_EQ(calls[rec].stream, compute);
  size_t wait = index_of(calls, "wait", rec);
  ASSERT_LT(wait, calls.size());
  EXPECT_EQ(calls[wait].event, calls[rec].event);
  mem::cuda::Stream side = calls[wait].stream;
  EXPECT_NE(side, compute);
  size_t copy = index_of(calls, "dtoh", wait);
  ASSERT_LT(copy, calls.size());
  EXPECT_EQ(calls[copy].stream, side);
  EXPECT_EQ(std::count_if(calls.begin(), calls.end(), [](auto& x) { return x.what == "dtoh"; }), 3);
  // The compute stream itself is never synchronised from the host.
  for (auto& x : calls) EXPECT_FALSE(x.what == "stream_sync" && x.stream == compute);
  c.poll();

  drv.clear();
  std::vector<unsigned char> out(data.size());
  ASSERT_EQ(c.request(id), Reload::kNeedBuffer);
  c.start_load(id, out.data(), compute);
  c.wait(id, compute);
  EXPECT_EQ(out, data);
  calls = drv.calls();
  // Buffer-ready event on the compute stream -> side stream waits -> copies on
  // the side stream -> done event -> the compute stream waits for it.
  rec = index_of(calls, "record");
  ASSERT_LT(rec, calls.size());
  EXPECT_EQ(calls[rec].stream, compute);
  wait = index_of(calls, "wait", rec);
  ASSERT_LT(wait, calls.size());
  EXPECT_EQ(calls[wait].event, calls[rec].event);
  size_t htod = index_of(calls, "htod", wait);
  ASSERT_LT(htod, calls.size());
  EXPECT_EQ(calls[htod].stream, calls[wait].stream);
  size_t done = index_of(calls, "record", htod);
  ASSERT_LT(done, calls.size());
  EXPECT_EQ(calls[done].stream, calls[wait].stream);
  size_t consumer = index_of(calls, "wait", done);
  ASSERT_LT(consumer, calls.size());
  EXPECT_EQ(calls[consumer].stream, compute);
  EXPECT_EQ(calls[consumer].event, calls[done].event);
  for (auto& x : calls) EXPECT_FALSE(x.what == "stream_sync" && x.stream == compute);
  EXPECT_TRUE(c.consume(id));
  EXPECT_TRUE(c.release(id));
}

// Note [Caller's context]: the training thread may have no context current,
// or another device's; save/start_load/wait bind the entry's device for the
// call and leave the thread's context as they found it.
TEST(CacheDevice, CallsOnTheTrainingThreadBindTheEntrysDeviceAndRestoreTheContext) {
  FakeDriver drv;
  auto cache = host_cache(drv, 2);
  TensorCache& c = *cache;
  auto data = test::random_bytes(5000, 6);
  for (int before : {-1, 0}) {  // no context, then device 0's, on this thread
    drv.set_current_context(static_cast<mem::cuda::Context>(before + 1));
    EntryId id = c.save(device_save(data, static_cast<uint64_t>(10 + before), 1, 55)).id;
    EXPECT_EQ(FakeDriver::current(), before);
    c.drain();
    c.poll();
    std::vector<unsigned char> out(data.size());
    ASSERT_EQ(c.request(id), Reload::kNeedBuffer);
    c.start_load(id, out.data(), 55);
    EXPECT_EQ(FakeDriver::current(), before);
    c.wait(id, 55);
    EXPECT_EQ(FakeDriver::current(), before);
    EXPECT_EQ(out, data);
    EXPECT_TRUE(c.consume(id));
    EXPECT_TRUE(c.release(id));
  }
  c.close();
  EXPECT_EQ(FakeDriver::current(), 0);
}

size_t count(const std::vector<FakeDriver::Call>& calls, const std::string& what) {
  return static_cast<size_t>(std::count_if(calls.begin(), calls.end(), [&](auto& x) { return x.what == what; }));
}

// Note [Host staging]: device puts land in registered blobs with one copy
// each way; blobs are reused registered; a refused registration falls back to
// chunked copies through the staging pool.
TEST(CacheDevice, HostStoreCopiesDeviceTensorsIntoRegisteredBlobs) {
  for (bool allow : {true, false}) {
    FakeDriver drv;
    drv.allow_register = allow;
    drv.bind_device(0);
    HostStoreOptions ho;
    ho.driver = &drv;
    ho.staging_bytes = 4096;
    auto data = test::random_bytes(3 * 4096 + 100, 9);
    {
      auto store = make_host_store(ho);
      for (int step = 0; step < 3; ++step) {
        Location loc = store->put(mem::Buffer{data.data(), data.size(), 0, 7}, kTierFirst);
        std::vector<unsigned char> out(data.size());
        store->get(loc, mem::Buffer{out.data(), out.size(), 0, 7});
        EXPECT_EQ(out, data);
        store->free(loc);
      }
      auto calls = drv.calls();
      // A blob, registered or refused, is reused for the next put; a refused
      // one goes through the staging pool, page-locked (here: refused) once
      // with the store's driver in the caller's context.
      EXPECT_EQ(count(calls, "register"), allow ? 1u : 2u) << "allow " << allow;
      EXPECT_EQ(count(calls, "dtoh"), allow ? 3u : 12u);  // one per put, or 4 staged chunks
      EXPECT_EQ(count(calls, "htod"), allow ? 3u : 12u);
      for (auto& c : calls)
        if (c.what == "dtoh" || c.what == "htod") EXPECT_EQ(c.stream, 7u);
    }
    EXPECT_EQ(count(drv.calls(), "unregister"), allow ? 1u : 0u) << "registered blobs are unregistered at the end";
    drv.set_current_context(0);
  }
}

// Note [Abandoned work]: releasing a device entry that was forwarded while
// its store runs does not wait for the copy; the worker frees the space after.
// (Worker path: host blobs that cannot be page-locked.)
TEST(CacheDevice, ReleasingAForwardedDeviceEntryDoesNotWaitForItsStore) {
  FakeDriver drv;
  drv.allow_register = false;
  auto cache = host_cache(drv, 1);
  TensorCache& c = *cache;
  auto data = test::random_bytes(10000, 3);
  drv.hold_dtoh(true);
  EntryId id = c.save(device_save(data, 1, 0, 77)).id;
  drv.wait_dtoh_started(1);  // the store is copying
  ASSERT_EQ(c.request(id), Reload::kForward);
  auto released = std::async(std::launch::async, [&] { return c.release(id); });
  const bool prompt = released.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  drv.hold_dtoh(false);
  EXPECT_TRUE(prompt) << "release waited for the abandoned store";
  EXPECT_TRUE(released.get());
  EXPECT_FALSE(c.contains(id));
  EXPECT_EQ(c.stats().resident_bytes, 0u);
  c.drain();
  auto s = c.stats();
  EXPECT_EQ(s.store.bytes_held, 0u) << "the worker frees the abandoned store's space";
  EXPECT_EQ(s.step.bytes_offloaded, 0u);
  EXPECT_EQ(s.step.bytes_discarded, data.size()) << "written, never read";
  EXPECT_EQ(s.step.tensors_forwarded, 1u);
  c.close();
}

TEST(CacheDevice, DeviceSaveWithoutDriverIsRejected) {
  TensorCache c(make_host_store(HostStoreOptions{}), CacheOptions{});
  c.begin_step();
  auto data = test::random_bytes(100, 5);
  EXPECT_THROW(c.save(device_save(data, 1, 0, 0)), InvalidArgument);
}

}  // namespace
}  // namespace ebbtide::cache
