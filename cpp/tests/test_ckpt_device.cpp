// The checkpoint paths' device code on the simulated GPU (sim_driver.hpp):
// which contexts they make current, how often they make the host wait for
// a stream, and what memory their host-to-device copies read.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/ckpt/reader.hpp"
#include "ebbtide/ckpt/safetensors.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "sim_driver.hpp"
#include "test_utils.hpp"

namespace ebbtide::ckpt {
namespace {

using test::SimDriver;
using test::TempDir;
using mem::cuda::DevicePtr;
using mem::cuda::Event;
using mem::cuda::Stream;

// The simulator with the host waits (stream_synchronize) and events created
// counted: forwards every call to `sim`.
class CountingDriver final : public mem::cuda::Driver {
 public:
  explicit CountingDriver(SimDriver& sim) : sim_(sim) {}
  int stream_syncs() const { return syncs_.load(); }
  int events_created() const { return events_.load(); }

  void bind_context_of(DevicePtr p) override { sim_.bind_context_of(p); }
  void bind_device(int d) override { sim_.bind_device(d); }
  mem::cuda::Context current_context() override { return sim_.current_context(); }
  void set_current_context(mem::cuda::Context c) override { sim_.set_current_context(c); }
  bool is_device_pointer(const void* p) override { return sim_.is_device_pointer(p); }
  void memcpy_dtoh_async(void* dst, DevicePtr src, size_t n, Stream s) override {
    sim_.memcpy_dtoh_async(dst, src, n, s);
  }
  void memcpy_htod_async(DevicePtr dst, const void* src, size_t n, Stream s) override {
    sim_.memcpy_htod_async(dst, src, n, s);
  }
  Event event_create() override {
    ++events_;
    return sim_.event_create();
  }
  Event event_create_timed() override {
    ++events_;
    return sim_.event_create_timed();
  }
  void event_destroy(Event e) override { sim_.event_destroy(e); }
  void event_record(Event e, Stream s) override { sim_.event_record(e, s); }
  void event_synchronize(Event e) override { sim_.event_synchronize(e); }
  bool event_query(Event e) override { return sim_.event_query(e); }
  float event_elapsed_ms(Event a, Event b) override { return sim_.event_elapsed_ms(a, b); }
  void stream_wait_event(Stream s, Event e) override { sim_.stream_wait_event(s, e); }
  Stream stream_create() override { return sim_.stream_create(); }
  void stream_destroy(Stream s) override { sim_.stream_destroy(s); }
  void stream_synchronize(Stream s) override {
    ++syncs_;
    sim_.stream_synchronize(s);
  }
  bool stream_is_capturing(Stream s) override { return sim_.stream_is_capturing(s); }
  void relax_capture_mode() override { sim_.relax_capture_mode(); }
  bool host_register(void* p, size_t n) override { return sim_.host_register(p, n); }
  void host_unregister(void* p) override { sim_.host_unregister(p); }
  int device_count() override { return sim_.device_count(); }
  std::string device_name(int d) override { return sim_.device_name(d); }
  DevicePtr mem_alloc(size_t n) override { return sim_.mem_alloc(n); }
  void mem_free(DevicePtr p) override { sim_.mem_free(p); }

 private:
  SimDriver& sim_;
  std::atomic<int> syncs_{0}, events_{0};
};

// A block of the simulator's allocator on `device` holding `bytes`.
DevicePtr device_copy_of(SimDriver& sim, const std::vector<unsigned char>& bytes, int device,
                         const std::string& label) {
  const DevicePtr p = sim.alloc(bytes.size(), 0, label, device);
  std::memcpy(sim.bytes(p), bytes.data(), bytes.size());
  return p;
}

mem::Buffer on_device(SimDriver& sim, DevicePtr p, size_t n, int device, Stream s) {
  return {sim.bytes(p), n, device, s};
}

WriterOptions small_chunks() {
  WriterOptions o;
  o.chunk_bytes = 64 << 10;
  o.threads = 2;
  return o;
}

// Note [Pinning context] in shard_io.hpp: the caller's thread has no CUDA
// context (a fresh thread, as a background snapshot's or a DataLoader's),
// and every tensor is on device 1 of two. Saves both ways (the pipelined
// ring, which is page-locked before any worker copies into it, and the
// snapshot), reads back into device 1 (compressed chunks too), and a
// safetensors save and load: device 0's context is never made current, the
// caller's thread is left without a context, and the driver raised nothing.
TEST(CkptDevice, DeviceOneTensorsTouchOnlyDeviceOne) {
  TempDir d;
  SimDriver sim(SimDriver::Options{.devices = 2});
  constexpr Stream kSide = 55;
  sim.declare_stream(kSide, 1);
  const auto a = test::random_bytes((1 << 20) + 5, 180), b = test::random_bytes(3000, 181);
  std::vector<uint16_t> z(100000);
  for (size_t i = 0; i < z.size(); ++i) z[i] = static_cast<uint16_t>(0x3c00 + i % 251);
  const std::vector<unsigned char> zb(reinterpret_cast<const unsigned char*>(z.data()),
                                      reinterpret_cast<const unsigned char*>(z.data()) + z.size() * 2);
  const DevicePtr da = device_copy_of(sim, a, 1, "a"), db = device_copy_of(sim, b, 1, "b"),
                  dz = device_copy_of(sim, zb, 1, "z");
  const Codec zc = have_zstd() ? Codec::kFloatZstd : Codec::kNone;
  auto no_trouble = [&](const char* after) {
    EXPECT_EQ(sim.contexts(), std::set<int>{1}) << after;
    EXPECT_EQ(sim.current_context(), 0u) << after << ": the caller's thread is left without a context";
    EXPECT_TRUE(sim.errors().empty()) << after << SimDriver::join_lines(sim.errors());
    EXPECT_TRUE(sim.races().empty()) << after << SimDriver::join_lines(sim.races());
  };
  // The writers live to the end: unregistering their page-locked memory
  // when they go is HostMapping's (Note [Registration context]).
  std::vector<std::unique_ptr<CheckpointWriter>> writers;
  for (bool pipelined : {true, false}) {
    const std::string file = d.path() + (pipelined ? "/p.ebt" : "/s.ebt");
    {
      WriterOptions o = small_chunks();
      o.cuda_driver = &sim;
      writers.push_back(std::make_unique<CheckpointWriter>(o));
      CheckpointWriter& w = *writers.back();
      SaveRequest r;
      r.file = file;
      r.blobs = {{"a", on_device(sim, da, a.size(), 1, kSide), 1, Codec::kNone},
                 {"b", on_device(sim, db, b.size(), 1, 0), 1, Codec::kNone},
                 {"z", on_device(sim, dz, zb.size(), 1, kSide), 2, pipelined ? Codec::kNone : zc}};
      r.meta = "{}";
      r.pipelined = pipelined;
      w.save(std::move(r)).wait();
      EXPECT_GE(sim.registers(), 1) << "device copies go into page-locked memory";
      no_trouble(pipelined ? "a pipelined save" : "a snapshot save");
    }
    const DevicePtr ra = sim.alloc(a.size(), kSide, "ra", 1), rb = sim.alloc(b.size(), 0, "rb", 1),
                    rz = sim.alloc(zb.size(), kSide, "rz", 1);
    ShardReader rd(file);
    rd.read({{0, on_device(sim, ra, a.size(), 1, kSide)},
             {1, on_device(sim, rb, b.size(), 1, 0)},
             {2, on_device(sim, rz, zb.size(), 1, kSide)}},
            2, &sim);
    sim.synchronize_all();
    EXPECT_EQ(std::memcmp(sim.bytes(ra), a.data(), a.size()), 0);
    EXPECT_EQ(std::memcmp(sim.bytes(rb), b.data(), b.size()), 0);
    EXPECT_EQ(std::memcmp(sim.bytes(rz), zb.data(), zb.size()), 0);
    no_trouble(pipelined ? "reading the pipelined save" : "reading the snapshot save");
  }
  safetensors::IoOptions so;
  so.cuda_driver = &sim;
  so.try_cufile = false;
  const std::string st = d.path() + "/m.safetensors";
  safetensors::save(st, {{"a", "U8", {a.size()}, on_device(sim, da, a.size(), 1, kSide)},
                         {"b", "U8", {b.size()}, on_device(sim, db, b.size(), 1, 0)}},
                    {}, so);
  no_trouble("a safetensors save");
  safetensors::Reader sr(st, so);
  const DevicePtr sa = sim.alloc(a.size(), 0, "sa", 1), sb = sim.alloc(b.size(), kSide, "sb", 1);
  const size_t ia = sr.header().tensors[0].name == "a" ? 0 : 1;
  sr.read({{ia, on_device(sim, sa, a.size(), 1, 0)}, {1 - ia, on_device(sim, sb, b.size(), 1, kSide)}});
  sim.synchronize_all();
  EXPECT_EQ(std::memcmp(sim.bytes(sa), a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(sim.bytes(sb), b.data(), b.size()), 0);
  no_trouble("a safetensors load");
  writers.clear();
  EXPECT_EQ(sim.contexts(), std::set<int>{1}) << "the writers' end";
}

// Note [Staging buffer] in writer_arena.cpp: a staging buffer reserved for
// state on device 1 (from a thread with no context, as the plugin's filler
// is) is page-locked there, in device 1's context only; stage() copies the
// device tensors into it on their streams and the host ones on the
// workers, and returns once every copy has landed; the caller's thread is
// left as it was. A device copy into memory outside the buffer (pageable:
// the driver would copy synchronously) is refused.
TEST(CkptDevice, StagingCopiesDeviceTensorsIntoThePageLockedBuffer) {
  SimDriver sim(SimDriver::Options{.devices = 2});
  constexpr Stream kSide = 55;
  sim.declare_stream(kSide, 1);
  const auto a = test::random_bytes((1 << 20) + 5, 190), b = test::random_bytes(3000, 191),
             h = test::random_bytes((3 << 20) + 1, 192);
  const DevicePtr da = device_copy_of(sim, a, 1, "a"), db = device_copy_of(sim, b, 1, "b");
  WriterOptions o = small_chunks();
  o.cuda_driver = &sim;
  CheckpointWriter w(o);
  StagingBuffer buf = w.reserve_staging(a.size() + b.size() + h.size() + 64, 1);
  EXPECT_TRUE(buf->pinned());
  EXPECT_EQ(sim.registers(), 1);
  EXPECT_EQ(sim.contexts(), std::set<int>{1});
  EXPECT_EQ(sim.current_context(), 0u) << "the filling thread is left without a context";
  auto* base = static_cast<unsigned char*>(buf->data());
  unsigned char* sa = base;
  unsigned char* sb = base + a.size() + 3;
  unsigned char* sh = sb + b.size() + 1;
  sim.launch(kSide, 1.0, {}, 1);  // work queued before the staging: the copy of `a` on kSide runs after it
  w.stage({{sa, on_device(sim, da, a.size(), 1, kSide)}, {sh, test::host_buffer(h)},
           {sb, on_device(sim, db, b.size(), 1, 0)}});
  EXPECT_EQ(std::memcmp(sa, a.data(), a.size()), 0) << "stage() returned before the device copy landed";
  EXPECT_EQ(std::memcmp(sb, b.data(), b.size()), 0);
  EXPECT_EQ(std::memcmp(sh, h.data(), h.size()), 0);
  size_t d2h = 0;
  for (const auto& c : sim.copies()) {
    EXPECT_TRUE(c.d2h);
    EXPECT_TRUE(c.host >= base && static_cast<const unsigned char*>(c.host) + c.n <= base + buf->size());
    ++d2h;
  }
  EXPECT_EQ(d2h, 2u) << "host sources are not copied by the driver";
  EXPECT_EQ(sim.registers(), 1) << "pinned once, by reserve_staging";
  EXPECT_EQ(sim.contexts(), std::set<int>{1});
  EXPECT_EQ(sim.current_context(), 0u) << "the caller's thread is left without a context";
  std::vector<unsigned char> pageable(a.size());
  EXPECT_THROW(w.stage({{pageable.data(), on_device(sim, da, a.size(), 1, kSide)}}), InvalidArgument);
  EXPECT_TRUE(sim.errors().empty()) << SimDriver::join_lines(sim.errors());
  EXPECT_TRUE(sim.races().empty()) << SimDriver::join_lines(sim.races());
}

// Many small device tensors (a model's biases and norms): the safetensors
// save copies them into one staging buffer and waits for their stream once
// per buffer, not once per tensor; the load likewise. No events either way.
TEST(CkptDevice, SmallSafetensorsTensorsWaitOncePerStagingBuffer) {
  TempDir d;
  SimDriver sim(SimDriver::Options{.devices = 1});
  CountingDriver drv(sim);
  constexpr Stream kStream = 7;
  sim.declare_stream(kStream, 0);
  constexpr int kTensors = 200;
  std::vector<std::vector<unsigned char>> bytes;
  std::vector<safetensors::SaveTensor> src;
  for (int i = 0; i < kTensors; ++i) {
    bytes.push_back(test::random_bytes(1000 + 37 * i, 200 + i));
    const DevicePtr p = device_copy_of(sim, bytes.back(), 0, "t" + std::to_string(i));
    src.push_back({"t" + std::to_string(i), "U8", {bytes.back().size()},
                   on_device(sim, p, bytes.back().size(), 0, kStream)});
  }
  uint64_t total = 0;
  for (const auto& v : bytes) total += v.size();
  ASSERT_LT(total, 4u << 20) << "one 4 MiB staging buffer holds them all";
  safetensors::IoOptions o;
  o.cuda_driver = &drv;
  o.try_cufile = false;
  const std::string path = d.path() + "/small.safetensors";
  safetensors::save(path, src, {}, o);
  EXPECT_LE(drv.stream_syncs(), 1) << "one wait per staging buffer of copies";
  safetensors::Reader r(path, o);
  std::vector<safetensors::ReadTarget> targets;
  std::vector<DevicePtr> dst(kTensors);
  for (size_t i = 0; i < r.header().tensors.size(); ++i) {
    const auto& t = r.header().tensors[i];
    const int k = std::stoi(t.name.substr(1));
    dst[k] = sim.alloc(bytes[k].size(), kStream, "r" + t.name, 0);
    targets.push_back({i, on_device(sim, dst[k], bytes[k].size(), 0, kStream)});
  }
  const int before = drv.stream_syncs();
  r.read(targets);
  EXPECT_LE(drv.stream_syncs() - before, 2) << "one wait per staging buffer (the data may straddle two)";
  EXPECT_EQ(drv.events_created(), 0);
  sim.synchronize_all();
  for (int k = 0; k < kTensors; ++k)
    EXPECT_EQ(std::memcmp(sim.bytes(dst[k]), bytes[k].data(), bytes[k].size()), 0) << "tensor " << k;
  EXPECT_TRUE(sim.errors().empty()) << SimDriver::join_lines(sim.errors());
  EXPECT_TRUE(sim.races().empty()) << SimDriver::join_lines(sim.races());
}

// Note [Decoded device chunks] in reader.cpp: a compressed chunk bound for
// device memory is decoded into a pinned staging buffer (page-aligned, as
// every staging buffer is), never into pageable heap memory, and copied
// from there on the target's stream.
TEST(CkptDevice, CompressedChunksReachTheDeviceFromStagingBuffers) {
  if (!have_zstd()) GTEST_SKIP() << "a build without libzstd";
  TempDir d;
  std::vector<uint16_t> z(300000);
  for (size_t i = 0; i < z.size(); ++i) z[i] = static_cast<uint16_t>(0x3c00 + i % 251);
  const std::string file = d.path() + "/z.ebt";
  {
    CheckpointWriter w(small_chunks());
    SaveRequest r;
    r.file = file;
    r.blobs = {{"z", test::host_buffer(z), 2, Codec::kFloatZstd}};
    r.meta = "{}";
    w.save(std::move(r)).wait();
  }
  SimDriver sim(SimDriver::Options{.devices = 1});
  const DevicePtr dz = sim.alloc(z.size() * 2, 0, "z", 0);
  ShardReader rd(file);
  ASSERT_GT(rd.header().blobs[0].chunk_count, 4u);
  rd.read({{0, on_device(sim, dz, z.size() * 2, 0, 0)}}, 2, &sim);
  sim.synchronize_all();
  EXPECT_EQ(std::memcmp(sim.bytes(dz), z.data(), z.size() * 2), 0);
  size_t copies = 0;
  for (const auto& c : sim.copies()) {
    EXPECT_FALSE(c.d2h);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(c.host) % 4096, 0u) << "a copy from pageable memory at " << c.host;
    ++copies;
  }
  EXPECT_EQ(copies, rd.header().blobs[0].chunk_count);
  EXPECT_TRUE(sim.errors().empty()) << SimDriver::join_lines(sim.errors());
}

}  // namespace
}  // namespace ebbtide::ckpt
