// Checkpoint writer (C++ level): striped and pipelined saves (Notes
// [Striping] and [Save ring] in cpp/src/ckpt/writer_shard.cpp, [Fresh arena]
// in writer_arena.cpp), device blobs and reads, framed blobs.

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "ckpt_writer_test.hpp"
#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/reader.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/util/error.hpp"
#include "sim_driver.hpp"
#include "test_utils.hpp"

namespace ebbtide::ckpt {
namespace {

using test::TempDir;

// Note [Striping] in writer_shard.cpp; pipelined (sync) saves write the same bytes.
TEST_P(CkptWriterTest, StripedAndPipelinedRoundTrip) {
  TempDir d;
  auto a = test::random_bytes((5 << 20) + 77, 5);
  auto b = test::random_bytes(3000, 6);
  std::filesystem::create_directory(d.path() + "/s1");
  std::filesystem::create_directory(d.path() + "/s2");
  for (bool pipelined : {false, true}) {
    CheckpointWriter w(options(1 << 20));
    SaveRequest r;
    std::string tag = pipelined ? "p" : "a";
    r.file = d.path() + "/main-" + tag + ".ebt";
    r.stripe_files = {d.path() + "/s1/" + tag + ".ebt", d.path() + "/s2/" + tag + ".ebt"};
    r.blobs = {{"a", test::host_buffer(a), 1, Codec::kNone}, {"b", test::host_buffer(b), 1, Codec::kNone}};
    r.meta = "{}";
    r.pipelined = pipelined;
    auto res = w.save(std::move(r)).wait();
    EXPECT_EQ(res.raw_bytes, a.size() + b.size());
    ShardReader rd(d.path() + "/main-" + tag + ".ebt", true,
                   {d.path() + "/s1/" + tag + ".ebt", d.path() + "/s2/" + tag + ".ebt"});
    EXPECT_EQ(rd.superblock().format_version, 2u);
    EXPECT_EQ(rd.stripe_count(), 3u);
    std::vector<int> per_stripe(3, 0);
    for (const auto& c : rd.header().chunks) per_stripe[c.stripe]++;
    EXPECT_GT(per_stripe[1], 0);
    EXPECT_GT(per_stripe[2], 0);
    std::vector<unsigned char> a2(a.size()), b2(b.size());
    rd.read({{0, test::host_buffer(a2)}, {1, test::host_buffer(b2)}});
    EXPECT_EQ(a, a2);
    EXPECT_EQ(b, b2);
    EXPECT_TRUE(rd.verify().empty());
    // A page-aligned destination: full chunks are read in place (Note [Read pipeline]).
    std::unique_ptr<unsigned char, decltype(&std::free)> al(
        static_cast<unsigned char*>(std::aligned_alloc(4096, align_up(a.size(), 4096))), &std::free);
    rd.read({{0, {al.get(), a.size()}}});
    EXPECT_EQ(0, std::memcmp(al.get(), a.data(), a.size()));
    EXPECT_THROW(ShardReader(d.path() + "/main-" + tag + ".ebt"), InvalidArgument);  // stripes not given
  }
  // A missing stripe file: read() names it and a tensor; verify() reports problems.
  std::filesystem::remove(d.path() + "/s2/a.ebt");
  ShardReader rd(d.path() + "/main-a.ebt", true, {d.path() + "/s1/a.ebt", d.path() + "/s2/a.ebt"});
  std::vector<unsigned char> a2(a.size()), b2(b.size());
  try {
    rd.read({{0, test::host_buffer(a2)}, {1, test::host_buffer(b2)}});
    ADD_FAILURE() << "read with a missing stripe file succeeded";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("s2/a.ebt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tensor 'a'"), std::string::npos) << e.what();
    EXPECT_EQ(e.err(), ENOENT);
    const std::string msg = e.what(), errno_text = std::strerror(ENOENT);
    EXPECT_EQ(msg.find(errno_text), msg.rfind(errno_text)) << "the errno's text once: " << msg;
    EXPECT_EQ(msg.find("[file "), msg.rfind("[file ")) << "the file once: " << msg;
  }
  const auto problems = rd.verify();
  ASSERT_FALSE(problems.empty());
  EXPECT_NE(problems[0].message.find(std::strerror(ENOENT)), std::string::npos) << problems[0].message;
  // check_extents() finds it without reading data, with read()'s error.
  auto error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string by_read = error_of([&] { rd.read({{0, test::host_buffer(a2)}, {1, test::host_buffer(b2)}}); });
  EXPECT_FALSE(by_read.empty());
  EXPECT_EQ(error_of([&] { rd.check_extents(); }), by_read);
  // A stripe file cut short: the same, an InvalidArgument naming it.
  std::filesystem::resize_file(d.path() + "/s1/p.ebt", 8192);
  ShardReader cut(d.path() + "/main-p.ebt", true, {d.path() + "/s1/p.ebt", d.path() + "/s2/p.ebt"});
  EXPECT_THROW(cut.check_extents(), InvalidArgument);
  const std::string cut_read = error_of([&] { cut.read({{0, test::host_buffer(a2)}, {1, test::host_buffer(b2)}}); });
  EXPECT_NE(cut_read.find("s1/p.ebt"), std::string::npos) << cut_read;
  EXPECT_EQ(error_of([&] { cut.check_extents(); }), cut_read);
  ShardReader whole(d.path() + "/main-a.ebt", true, {d.path() + "/s1/a.ebt", d.path() + "/s1/a.ebt"});
  EXPECT_THROW(whole.check_extents(), InvalidArgument) << "stripe 1's file given as stripe 2";
}

// Superblocks of more files than one staging buffer holds (4 KiB chunks: two
// blocks a buffer) go out in turns.
TEST_P(CkptWriterTest, SmallChunksWithManyStripeFiles) {
  TempDir d;
  auto a = test::random_bytes((1 << 20) + 5, 12);
  SaveRequest r;
  r.file = d.path() + "/main.ebt";
  for (int i = 0; i < 5; ++i) {
    std::filesystem::create_directory(d.path() + "/s" + std::to_string(i));
    r.stripe_files.push_back(d.path() + "/s" + std::to_string(i) + "/main.ebt");
  }
  const auto stripes = r.stripe_files;
  r.blobs = {{"a", test::host_buffer(a), 1, Codec::kNone}};
  r.meta = "{}";
  CheckpointWriter w(options(4096));
  w.save(std::move(r)).wait();
  ShardReader rd(d.path() + "/main.ebt", true, stripes);
  EXPECT_EQ(rd.stripe_count(), 6u);
  std::vector<unsigned char> a2(a.size());
  rd.read({{0, test::host_buffer(a2)}});
  EXPECT_EQ(a, a2);
  EXPECT_TRUE(rd.verify().empty());
}

// Note [Fresh arena]: one writer's saves switch between an unregistered fresh
// arena (the first pipelined save from it, again after it grows) and the
// registered one, and the staging buffers' registered indices move with it.
TEST_P(CkptWriterTest, FreshAndRegisteredArenaSavesRoundTrip) {
  TempDir d;
  CheckpointWriter w(options(1 << 20));
  struct Step {
    bool pipelined;
    uint64_t bytes;
  };
  const Step steps[] = {{true, (3 << 20) + 11}, {true, (3 << 20) + 11}, {false, 5000},
                        {true, (70ull << 20) + 5}, {false, (70ull << 20) + 5}, {true, 4096}};
  int k = 0;
  for (const auto& s : steps) {
    auto a = test::random_bytes(s.bytes, 20 + k);
    auto small = test::random_bytes(777, 40 + k);
    SaveRequest r;
    r.file = d.path() + "/f" + std::to_string(k++) + ".ebt";
    r.blobs = {{"a", test::host_buffer(a), 1, Codec::kNone}, {"small", test::host_buffer(small), 1, Codec::kNone}};
    r.meta = "{}";
    r.pipelined = s.pipelined;
    auto res = w.save(std::move(r)).wait();
    EXPECT_EQ(res.raw_bytes, a.size() + small.size());
    ShardReader rd(d.path() + "/f" + std::to_string(k - 1) + ".ebt");
    std::vector<unsigned char> a2(a.size()), small2(small.size());
    rd.read({{0, test::host_buffer(a2)}, {1, test::host_buffer(small2)}});
    EXPECT_EQ(a, a2) << "step " << k - 1;
    EXPECT_EQ(small, small2) << "step " << k - 1;
    EXPECT_TRUE(rd.verify().empty());
  }
}

// Note [Save ring]: a pipelined save goes round a ring much smaller than the
// state (chunks that do not fit before its end start again at 0, small blobs
// share positions with their neighbours) and writes the same file, byte for
// byte, as a save that snapshots the whole state first, which needs an arena
// of the state's size.
TEST_P(CkptWriterTest, PipelinedSaveGoesRoundASmallRing) {
  TempDir d;
  std::vector<std::vector<unsigned char>> data;
  data.push_back(test::random_bytes((3 << 20) + 77, 60));
  for (int i = 0; i < 40; ++i) data.push_back(test::random_bytes(1 + (i * 7919) % 150000, 61 + i));
  data.push_back(test::random_bytes((1 << 20) + 4096, 120));
  auto head = test::random_bytes(5000, 121), tail = test::random_bytes(70001, 122);
  std::vector<std::string> files;
  for (bool pipelined : {true, false}) {
    WriterOptions o = options(64 << 10);
    o.ring_bytes = 200 << 10;  // rounded up to 4 KiB, and >= two chunks: 4 chunks and a bit
    CheckpointWriter w(o);
    SaveRequest r;
    r.file = d.path() + (pipelined ? "/p.ebt" : "/s.ebt");
    for (size_t i = 0; i < data.size(); ++i)
      r.blobs.push_back({"t" + std::to_string(i), test::host_buffer(data[i]), 1, Codec::kNone});
    r.blobs[3].head.assign(head.begin(), head.end());
    r.blobs[3].tail.assign(tail.begin(), tail.end());
    r.meta = "{}";
    r.pipelined = pipelined;
    auto res = w.save(std::move(r)).wait();
    EXPECT_EQ(res.backend.find("pipelined") != std::string::npos, pipelined) << res.backend;
    uint64_t total = 0;
    for (const auto& v : data) total += v.size();
    EXPECT_EQ(res.raw_bytes, total + head.size() + tail.size());
    // The arena is mapped in 64 MiB segments: one for the ring, one for the 7.9 MB state.
    EXPECT_EQ(w.snapshot_capacity(), 64ull << 20);
    ShardReader rd(d.path() + (pipelined ? "/p.ebt" : "/s.ebt"));
    EXPECT_TRUE(rd.verify().empty());
    for (size_t i = 0; i < data.size(); ++i) {
      std::vector<unsigned char> want = data[i];
      if (i == 3) {
        want.insert(want.begin(), head.begin(), head.end());
        want.insert(want.end(), tail.begin(), tail.end());
      }
      std::vector<unsigned char> got(want.size());
      rd.read({{static_cast<uint32_t>(i), test::host_buffer(got)}});
      EXPECT_EQ(got, want) << "blob " << i << (pipelined ? ", pipelined" : ", snapshot");
    }
    files.push_back(test::read_file(d.path() + (pipelined ? "/p.ebt" : "/s.ebt")));
  }
  EXPECT_EQ(files[0], files[1]);
}

// A write failing after the ring has gone round several times (copies of
// later chunks waiting for room, writes in flight): the save reports the
// error naming the file, the previous checkpoint stays, nothing else is left,
// and the same writer saves again afterwards.
TEST_P(CkptWriterTest, PipelinedSaveFailingMidRingLeavesThePreviousOne) {
  TempDir d;
  auto a = test::random_bytes(100000, 70), b = test::random_bytes((3 << 20) + 5, 71);
  WriterOptions o = options(64 << 10);
  o.ring_bytes = 200 << 10;
  CheckpointWriter w(o);
  auto save = [&](const std::vector<unsigned char>& data) {
    SaveRequest r;
    std::string tmp = make_temp_dir(d.path() + "/ck");
    r.file = tmp + "/rank0.ebt";
    r.blobs = {{"x", test::host_buffer(data), 1, Codec::kNone}};
    r.meta = "{}";
    r.commit_dir = tmp;
    r.commit_path = d.path() + "/ck";
    r.pipelined = true;
    return w.save(std::move(r)).wait();
  };
  auto read_back = [&] {
    ShardReader rd(d.path() + "/ck/rank0.ebt");
    EXPECT_TRUE(rd.verify().empty());
    std::vector<unsigned char> got(rd.header().blobs[0].nbytes);
    rd.read({{0, test::host_buffer(got)}});
    return got;
  };
  save(a);
  inject_write_fault(1 << 20, ENOSPC);  // 16 chunks in: the 200 KiB ring went round 5 times
  try {
    save(b);
    inject_write_fault(0, 0);
    FAIL() << "the fault was not reported";
  } catch (const IoError& e) {
    inject_write_fault(0, 0);
    EXPECT_EQ(e.err(), ENOSPC);
    EXPECT_NE(std::string(e.what()).find("rank0.ebt"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_back(), a);
  EXPECT_EQ(d.entries(), 1u) << "the failed save's temporary directory is left";
  auto res = save(b);
  EXPECT_NE(res.backend.find("pipelined"), std::string::npos) << res.backend;
  EXPECT_EQ(read_back(), b);
}

// Device blobs (a simulated GPU): a synchronous save copies them chunk by
// chunk into the page-locked ring on each blob's stream, waiting for the
// stream before the chunk is checksummed; a save that snapshots first copies
// each whole blob. Both write the same file.
TEST_P(CkptWriterTest, DeviceBlobsThroughTheRingAndTheSnapshot) {
  TempDir d;
  test::SimDriver sim(1e9, 1e9);
  auto dev_a = test::random_bytes((1 << 20) + 3, 130), host = test::random_bytes(70000, 131),
       dev_b = test::random_bytes(5, 132);
  auto head = test::random_bytes(300, 133), tail = test::random_bytes(90001, 134);
  auto device = [](const std::vector<unsigned char>& v, mem::cuda::Stream s) {
    mem::Buffer b = test::host_buffer(v);
    b.device = 0;
    b.stream = s;
    return b;
  };
  std::vector<std::string> files;
  for (bool pipelined : {true, false}) {
    const size_t copies_before = sim.copies().size();
    const double produced = sim.launch(7, 0.5) + 0.5;  // the blob's producer: its copies must come after it
    WriterOptions o = options(64 << 10);
    o.ring_bytes = 256 << 10;
    o.cuda_driver = &sim;
    CheckpointWriter w(o);
    SaveRequest r;
    const std::string file = d.path() + (pipelined ? "/p.ebt" : "/s.ebt");
    r.file = file;
    r.blobs = {{"a", device(dev_a, 7), 1, Codec::kNone},
               {"h", test::host_buffer(host), 1, Codec::kNone},
               {"b", device(dev_b, 9), 1, Codec::kNone}};
    r.blobs[0].head.assign(head.begin(), head.end());
    r.blobs[0].tail.assign(tail.begin(), tail.end());
    r.meta = "{}";
    r.pipelined = pipelined;
    auto res = w.save(std::move(r)).wait();
    EXPECT_EQ(res.backend.find("pipelined") != std::string::npos, pipelined) << res.backend;
    EXPECT_GE(sim.registers(), 1) << "device copies go into page-locked memory";
    const auto copies = sim.copies();
    uint64_t on7 = 0, on9 = 0;
    for (size_t i = copies_before; i < copies.size(); ++i) {
      const auto& c = copies[i];
      EXPECT_TRUE(c.d2h);
      if (c.stream == 7) EXPECT_GE(c.start, produced) << "a copy ran before the stream's earlier work";
      if (pipelined) EXPECT_LE(c.n, 64u << 10) << "one chunk at a time";
      (c.stream == 7 ? on7 : on9) += c.n;
      EXPECT_TRUE(c.stream == 7 || c.stream == 9) << c.stream;
    }
    EXPECT_EQ(on7, dev_a.size());
    EXPECT_EQ(on9, dev_b.size());
    EXPECT_GE(sim.host_time(), sim.tail(7)) << "the save waited for its copies";
    ShardReader rd(file);
    EXPECT_TRUE(rd.verify().empty());
    std::vector<unsigned char> want(head);
    want.insert(want.end(), dev_a.begin(), dev_a.end());
    want.insert(want.end(), tail.begin(), tail.end());
    std::vector<unsigned char> got(want.size()), got_h(host.size()), got_b(dev_b.size());
    rd.read({{0, test::host_buffer(got)}, {1, test::host_buffer(got_h)}, {2, test::host_buffer(got_b)}});
    EXPECT_EQ(got, want);
    EXPECT_EQ(got_h, host);
    EXPECT_EQ(got_b, dev_b);
    files.push_back(test::read_file(file));
  }
  EXPECT_EQ(files[0], files[1]);
}

// Reads into device memory (a simulated GPU): each chunk is copied on the
// destination's stream, raw chunks straight from their staging buffer,
// compressed ones after decoding, parts of a blob too; the stream is waited
// for before the buffer is reused, and a caller's driver page-locks nothing.
TEST_P(CkptWriterTest, ReadsIntoDeviceMemory) {
  TempDir d;
  auto a = test::random_bytes((1 << 20) + 4096 * 3 + 5, 140), b = test::random_bytes(9000, 141);
  std::vector<uint16_t> z(200000);
  for (size_t i = 0; i < z.size(); ++i) z[i] = static_cast<uint16_t>(0x3c00 + i % 251);
  const Codec zc = have_zstd() ? Codec::kFloatZstd : Codec::kNone;
  const std::string file = d.path() + "/r.ebt";
  {
    CheckpointWriter w(options(64 << 10));
    SaveRequest r;
    r.file = file;
    r.blobs = {{"a", test::host_buffer(a), 1, Codec::kNone}, {"b", test::host_buffer(b), 1, Codec::kNone},
               {"z", test::host_buffer(z), 2, zc}};
    r.meta = "{}";
    w.save(std::move(r)).wait();
  }
  test::SimDriver sim(1e9, 1e9);
  const double produced = sim.launch(11, 0.25) + 0.25;  // the destination's earlier work on its stream
  std::vector<unsigned char> ga(a.size()), gb_part(5000);
  std::vector<uint16_t> gz(z.size());
  auto device = [](void* p, uint64_t n) { return mem::Buffer{p, n, 0, 11}; };
  ShardReader rd(file);
  BlobTarget part{1, device(gb_part.data(), gb_part.size()), 3000, true};
  rd.read({{0, device(ga.data(), ga.size())}, part, {2, device(gz.data(), gz.size() * 2)}}, 2, &sim);
  EXPECT_EQ(ga, a);
  EXPECT_EQ(0, std::memcmp(gb_part.data(), b.data() + 3000, gb_part.size()));
  EXPECT_EQ(gz, z);
  uint64_t copied = 0;
  for (const auto& c : sim.copies()) {
    EXPECT_FALSE(c.d2h);
    EXPECT_EQ(c.stream, 11u);
    EXPECT_GE(c.start, produced);
    EXPECT_LE(c.n, 64u << 10) << "one chunk at a time";
    copied += c.n;
  }
  EXPECT_EQ(copied, a.size() + gb_part.size() + z.size() * 2);
  EXPECT_GE(sim.host_time(), sim.tail(11)) << "the reads waited for their copies";
  EXPECT_EQ(sim.registers(), 0) << "staging is not page-locked with a caller's driver";
}

// Device memory without a usable CUDA driver (CI): saves and reads refuse it,
// naming the blob or tensor and why, before anything is written.
TEST_P(CkptWriterTest, DeviceMemoryWithoutADriverIsRefusedByName) {
  if (mem::cuda::driver() != nullptr) GTEST_SKIP() << "a CUDA driver is usable here";
  TempDir d;
  auto a = test::random_bytes(5000, 150);
  mem::Buffer dev = test::host_buffer(a);
  dev.device = 0;
  for (bool pipelined : {true, false}) {
    CheckpointWriter w(options(64 << 10));
    SaveRequest r;
    r.file = d.path() + "/x.ebt";
    r.blobs = {{"g", dev, 1, Codec::kNone}};
    r.meta = "{}";
    r.pipelined = pipelined;
    try {
      w.save(std::move(r)).wait();
      ADD_FAILURE() << "a save from device memory without a driver succeeded";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("blob 'g' is in CUDA device memory but no CUDA driver is usable: "),
                std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(std::filesystem::exists(d.path() + "/x.ebt"));
  }
  {
    CheckpointWriter w(options(64 << 10));
    SaveRequest r;
    r.file = d.path() + "/h.ebt";
    r.blobs = {{"g", test::host_buffer(a), 1, Codec::kNone}};
    r.meta = "{}";
    w.save(std::move(r)).wait();
  }
  ShardReader rd(d.path() + "/h.ebt");
  std::vector<unsigned char> got(a.size());
  mem::Buffer dst = test::host_buffer(got);
  dst.device = 0;
  try {
    rd.read({{0, dst}});
    ADD_FAILURE() << "a read into device memory without a driver succeeded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'g' is to be loaded into CUDA memory but no CUDA driver is usable: "),
              std::string::npos)
        << e.what();
  }
}

// A pipelined save's ring is bounded by EBBTIDE_CKPT_RING whatever the
// state's size; a save that snapshots first grows the arena to the state,
// and later pipelined saves go round all of it.
TEST_P(CkptWriterTest, PipelinedSavesHoldOneRingNotTheState) {
  TempDir d;
  auto a = test::random_bytes((70ull << 20) + 3, 70);
  WriterOptions o = options(1 << 20);
  o.ring_bytes = 8 << 20;
  CheckpointWriter w(o);
  int k = 0;
  for (bool pipelined : {true, false, true}) {
    SaveRequest r;
    r.file = d.path() + "/f" + std::to_string(k++) + ".ebt";
    r.blobs = {{"a", test::host_buffer(a), 1, Codec::kNone}};
    r.meta = "{}";
    r.pipelined = pipelined;
    w.save(std::move(r)).wait();
    EXPECT_EQ(w.snapshot_capacity(), (pipelined && k == 1 ? 1 : 2) * (64ull << 20)) << "save " << k;
    ShardReader rd(d.path() + "/f" + std::to_string(k - 1) + ".ebt");
    std::vector<unsigned char> got(a.size());
    rd.read({{0, test::host_buffer(got)}});
    EXPECT_EQ(got, a) << "save " << k;
  }
}

// Note [Framed blobs]: a framed blob is stored as head + data + tail whether
// it is snapshotted first or pipelined; chunk boundaries here fall inside the
// head, the data and the tail, and one blob is all frame and no data.
TEST_P(CkptWriterTest, FramedBlobsPipelinedMatchSnapshot) {
  TempDir d;
  auto data = test::random_bytes(300007, 7);
  auto head = test::random_bytes(100000, 8), tail = test::random_bytes(70001, 9);
  auto plain = test::random_bytes(5000, 10);
  auto framed = [](std::string name, mem::Buffer data, const std::vector<unsigned char>& h,
                   const std::vector<unsigned char>& t) {
    BlobSource b{std::move(name), data, 1, Codec::kNone};
    b.head.assign(h.begin(), h.end());
    b.tail.assign(t.begin(), t.end());
    return b;
  };
  std::vector<unsigned char> want(head);
  want.insert(want.end(), data.begin(), data.end());
  want.insert(want.end(), tail.begin(), tail.end());
  std::vector<unsigned char> want_empty(head.begin(), head.begin() + 123);
  want_empty.insert(want_empty.end(), tail.begin(), tail.begin() + 45);
  for (bool pipelined : {false, true}) {
    CheckpointWriter w(options(64 << 10));
    SaveRequest r;
    r.file = d.path() + (pipelined ? "/p.ebt" : "/s.ebt");
    r.blobs = {framed("t", test::host_buffer(data), head, tail),
               {"plain", test::host_buffer(plain), 1, Codec::kNone},
               framed("empty", {nullptr, 0}, {head.begin(), head.begin() + 123}, {tail.begin(), tail.begin() + 45})};
    r.meta = "{}";
    r.pipelined = pipelined;
    auto res = w.save(std::move(r)).wait();
    EXPECT_EQ(res.backend.find("pipelined") != std::string::npos, pipelined) << res.backend;
    ShardReader rd(d.path() + (pipelined ? "/p.ebt" : "/s.ebt"));
    ASSERT_EQ(rd.header().blobs.size(), 3u);
    ASSERT_EQ(rd.header().blobs[0].nbytes, want.size());
    std::vector<unsigned char> got(want.size()), got_plain(plain.size()), got_empty(want_empty.size());
    rd.read({{0, test::host_buffer(got)}, {1, test::host_buffer(got_plain)}, {2, test::host_buffer(got_empty)}});
    EXPECT_EQ(got, want);
    EXPECT_EQ(got_plain, plain);
    EXPECT_EQ(got_empty, want_empty);
    EXPECT_TRUE(rd.verify().empty());
  }
}

}  // namespace
}  // namespace ebbtide::ckpt
