// The glue's side and the fixtures of the tensor cache's tests against the
// simulated GPU (test_cache_races.cpp, test_cache_captures.cpp): saved
// tensors and reload buffers are blocks of the simulator's caching
// allocator, owned by glue objects whose deleters free them (on the thread
// that drops them, as torch's would).
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/cache/tensor_cache.hpp"
#include "gated_ssd.hpp"
#include "sim_driver.hpp"
#include "test_utils.hpp"

namespace ebbtide::cache::race {

using test::GatedSsd;
using test::SimDriver;
using DevicePtr = mem::cuda::DevicePtr;
using test::kCompute;
constexpr mem::cuda::Stream kSide = 9;
constexpr uint64_t kBytes = 1 << 20;

// The glue's side: allocations of the simulator's allocator held by glue
// objects, kernels that write and check them.
struct Glue {
  SimDriver& drv;
  int device = 0;
  std::atomic<int> freed{0};

  // A block of `n` bytes on `stream` owned by the returned object; dropping
  // the object frees it on the dropping thread.
  GlueObj block(DevicePtr& out, uint64_t n, mem::cuda::Stream stream, const std::string& label) {
    out = drv.alloc(n, stream, label, device);
    const DevicePtr p = out;
    return GlueObj(new int(0), [this, p](void* q) {
      delete static_cast<int*>(q);
      drv.free(p);
      freed += 1;
    });
  }
  // A kernel on `stream` writing `data` into `p`.
  void write(mem::cuda::Stream stream, DevicePtr p, const std::vector<unsigned char>& data, double seconds = 1e-4) {
    auto src = std::make_shared<std::vector<unsigned char>>(data);
    drv.launch(stream, seconds, [p, src] { std::memcpy(reinterpret_cast<void*>(p), src->data(), src->size()); },
               device);
  }
  // A kernel on `stream` that reads `p` and records whether it held `want`.
  void check(mem::cuda::Stream stream, DevicePtr p, const std::vector<unsigned char>& want, bool& ok) {
    const unsigned char* w = want.data();
    const size_t n = want.size();
    ok = false;
    drv.launch(stream, 1e-5, [p, w, n, &ok] { ok = std::memcmp(reinterpret_cast<const void*>(p), w, n) == 0; }, device);
  }
};

inline SaveRequest device_request(DevicePtr p, uint64_t key, mem::cuda::Stream stream, GlueObj live, int device = 0,
                           int tier = kTierFirst) {
  SaveRequest r;
  r.key = key;
  r.src = {reinterpret_cast<void*>(p), kBytes, device, stream};
  r.live = std::move(live);
  r.tier = tier;
  return r;
}

inline std::unique_ptr<TensorCache> host_cache(SimDriver& drv, unsigned workers = 1) {
  HostStoreOptions ho;
  ho.driver = &drv;
  CacheOptions co;
  co.driver = &drv;
  co.workers = workers;
  co.device_inflight_bytes = 0;
  co.prefetch_window_bytes = 64 * kBytes;
  return std::make_unique<TensorCache>(make_host_store(ho), co);
}

inline std::unique_ptr<TensorCache> ssd_cache(SimDriver& drv, test::Gate& gate, unsigned workers = 1) {
  CacheOptions co;
  co.driver = &drv;
  co.workers = workers;
  co.device_inflight_bytes = 0;
  co.prefetch_window_bytes = 64 * kBytes;
  return std::make_unique<TensorCache>(std::make_unique<GatedSsd>(gate), co);
}

// A link slow enough that every copy outlasts the kernels around it.
inline SimDriver::Options slow_link(int devices = 1) {
  SimDriver::Options o;
  o.devices = devices;
  o.d2h_bps = 1e8;  // 1 MiB: ~10 ms
  o.h2d_bps = 1e8;
  return o;
}

// No race, and no driver error but the ones a test injected.
inline void expect_clean(SimDriver& drv) {
  drv.synchronize_all();
  EXPECT_TRUE(drv.races().empty()) << SimDriver::join_lines(drv.races());
  std::vector<std::string> errors;
  for (auto& e : drv.errors())
    if (e.find("(injected)") == std::string::npos) errors.push_back(e);
  EXPECT_TRUE(errors.empty()) << SimDriver::join_lines(errors);
}

// Runs `fn` on another thread and fails (instead of hanging) when it does not
// return: a deadlock watchdog, never a timing assertion on the passing path.
template <class F>
void returns_without_waiting_for_the_gate(test::Gate& gate, F fn) {
  auto f = std::async(std::launch::async, fn);
  const bool returned = f.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  if (!returned) gate.set_open(true);  // let it finish, then fail
  f.get();
  EXPECT_TRUE(returned) << "the call waited for a worker's I/O (the gate is closed)";
}

// Saves one device tensor written by a kernel on `stream`, releases its copy
// and drops the tensor (the glue's ack). Returns the entry.
// Saves one device tensor allocated on `stream` and written there by a kernel
// (its block's address in `*at` when given); the glue holds it until released.
inline SaveResult save_one(Glue& g, TensorCache& c, const std::vector<unsigned char>& data, mem::cuda::Stream stream,
                    uint64_t key, int tier = kTierFirst, DevicePtr* at = nullptr) {
  DevicePtr act = 0;
  GlueObj live = g.block(act, kBytes, stream, "activation " + std::to_string(key));
  g.write(stream, act, data);
  if (at != nullptr) *at = act;
  return c.save(device_request(act, key, stream, std::move(live), g.device, tier));
}

inline EntryId offload_one(Glue& g, TensorCache& c, const std::vector<unsigned char>& data, mem::cuda::Stream stream,
                    uint64_t key, int tier = kTierFirst) {
  SaveResult res = save_one(g, c, data, stream, key, tier);
  EXPECT_TRUE(res.offloaded);
  c.release_copies(0, INT64_MAX, stream);
  for (auto& done : c.poll()) done.live.reset();  // the glue drops the tensor
  return res.id;
}

// Two simulated devices on a slow link; kOther is device 1's compute stream.
constexpr mem::cuda::Stream kOther = 11;
struct TwoDevices {
  TwoDevices() : drv(slow_link(/*devices=*/2)) { drv.declare_stream(kOther, 1); }
  SimDriver drv;
  Glue g0{drv, 0};
  Glue g1{drv, 1};
};

}  // namespace ebbtide::cache::race

namespace ebbtide::cache {
namespace {
// The fixtures, in the tests' own anonymous namespace by declarations, not a
// using directive: in a unity build, where the tests' anonymous namespaces
// are one, other tests' helpers of the same names stay overloads of these
// instead of hiding them.
using race::device_request;
using race::expect_clean;
using race::Glue;
using race::host_cache;
using race::kBytes;
using race::kOther;
using race::kSide;
using race::offload_one;
using race::returns_without_waiting_for_the_gate;
using race::save_one;
using race::slow_link;
using race::ssd_cache;
using race::TwoDevices;
using test::kCompute;
using test::SimDriver;
using DevicePtr = mem::cuda::DevicePtr;
}  // namespace
}  // namespace ebbtide::cache
