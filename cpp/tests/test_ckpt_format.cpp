// Checkpoint format, codecs, writer and reader (C++ level); the striped,
// pipelined, device and framed saves are in test_ckpt_pipeline.cpp.
#include <sys/mman.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "ckpt_writer_test.hpp"
#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/reader.hpp"
#include "ebbtide/ckpt/transaction.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/io/faults.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::ckpt {
namespace {

using test::TempDir;

TEST(CkptFormat, SuperblockRoundTripAndErrors) {
  Superblock sb;
  sb.header_offset = 8192;
  sb.header_bytes = 123;
  sb.file_bytes = 12288;
  sb.header_crc = 0xdeadbeef;
  unsigned char buf[kSuperBytes];
  encode_superblock(sb, buf);
  auto back = decode_superblock(buf, "f");
  EXPECT_EQ(back.header_offset, 8192u);
  EXPECT_EQ(back.header_crc, 0xdeadbeefu);
  buf[30] ^= 1;
  EXPECT_THROW(decode_superblock(buf, "f"), ChecksumError);
  encode_superblock(sb, buf);
  buf[16] = 7;  // format version 7 > kFormatVersion (crc check comes after)
  try {
    decode_superblock(buf, "f");
    FAIL();
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("version 7"), std::string::npos);
  }
  std::memset(buf, 0, sizeof buf);
  EXPECT_THROW(decode_superblock(buf, "f"), InvalidArgument);
}

TEST(CkptFormat, HeaderRoundTripAndCorruption) {
  Header h;
  h.blobs.push_back({"a.weight", 10000, 0, 2, Codec::kFloatZstd, 2});
  h.blobs.push_back({"b", 0, 2, 0, Codec::kNone, 1});
  h.chunks.push_back({4096, 0, 8192, 5000, 7, 0, Codec::kFloatZstd, 0});
  h.chunks.push_back({12288, 8192, 1808, 1808, 9, 0, Codec::kNone, 0});
  h.meta = "{\"x\": 1}";
  auto bytes = encode_header(h);
  auto back = decode_header(bytes, "f");
  ASSERT_EQ(back.blobs.size(), 2u);
  EXPECT_EQ(back.blobs[0].name, "a.weight");
  EXPECT_EQ(back.chunks[1].raw_offset, 8192u);
  EXPECT_EQ(back.chunks[0].codec, Codec::kFloatZstd);
  EXPECT_EQ(back.meta, h.meta);
  EXPECT_THROW(decode_header(bytes.substr(0, bytes.size() - 1), "f"), InvalidArgument);
  auto bad = bytes;
  bad[32 + 8] = 100;  // first_chunk of blob 0 out of range
  EXPECT_THROW(decode_header(bad, "f"), InvalidArgument);
}

TEST(CkptCodec, GroupBytesInverts) {
  for (uint16_t e : {1, 2, 3, 4, 8, 16}) {
    for (bool rot : {false, true}) {
      auto src = test::random_bytes(4099, e);
      std::vector<unsigned char> mid(src.size()), back(src.size());
      group_bytes(src.data(), mid.data(), src.size(), e, rot);
      ungroup_bytes(mid.data(), back.data(), src.size(), e, rot);
      EXPECT_EQ(src, back) << "elem " << e << " rot " << rot;
    }
  }
}

TEST(CkptCodec, CompressRoundTripEveryCodec) {
  if (!have_zstd()) GTEST_SKIP() << "no zstd in this build";
  std::vector<uint16_t> bf(1 << 16);
  for (size_t i = 0; i < bf.size(); ++i) bf[i] = static_cast<uint16_t>(0x3c00 + (i * 2654435761u >> 20) % 512);
  for (Codec c : {Codec::kZstd, Codec::kShuffleZstd, Codec::kFloatZstd}) {
    size_t n = bf.size() * 2;
    std::vector<char> out(compress_bound(n)), scratch(n), back(n);
    size_t stored = compress_chunk(c, 2, 1, bf.data(), n, out.data(), out.size(), scratch.data());
    ASSERT_GT(stored, 0u);
    EXPECT_LT(stored, n);
    decompress_chunk(c, 2, out.data(), stored, back.data(), n, scratch.data(), "t");
    EXPECT_EQ(std::memcmp(back.data(), bf.data(), n), 0);
    out[stored / 2] ^= 0x55;
    try {
      decompress_chunk(c, 2, out.data(), stored, back.data(), n, scratch.data(), "t");
      // zstd may decode garbage without noticing; the crc32c catches it.
    } catch (const InvalidArgument&) {
    }
  }
  auto rnd = test::random_bytes(1 << 16, 3);
  std::vector<char> out(compress_bound(rnd.size())), scratch(rnd.size());
  EXPECT_EQ(compress_chunk(Codec::kZstd, 1, 1, rnd.data(), rnd.size(), out.data(), out.size(), scratch.data()), 0u)
      << "incompressible data is stored raw";
}

SaveResult save_blobs(const std::string& dir, std::vector<BlobSource> blobs, WriterOptions o = {}) {
  CheckpointWriter w(o);
  SaveRequest r;
  std::string tmp = make_temp_dir(dir + "/ck");
  r.file = tmp + "/rank0.ebt";
  r.blobs = std::move(blobs);
  r.meta = "{}";
  r.commit_dir = tmp;
  r.commit_path = dir + "/ck";
  r.extra_files = {{"index.json", "{}"}};
  return w.save(std::move(r)).wait();
}

TEST_P(CkptWriterTest, WriteReadRoundTripWithCompression) {
  TempDir d;
  auto a = test::random_bytes((9 << 20) + 123, 1);  // several chunks, odd tail
  std::vector<uint16_t> b(100000);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(0x3f00 + i % 97);
  WriterOptions o = options(1 << 20);
  auto res = save_blobs(d.path(), {{"a", test::host_buffer(a), 1, Codec::kNone},
                                   {"b", test::host_buffer(b), 2, Codec::kFloatZstd},
                                   {"empty", {nullptr, 0}, 4, Codec::kZstd}},
                        o);
  EXPECT_EQ(res.raw_bytes, a.size() + b.size() * 2);
  EXPECT_LT(res.stored_bytes, res.raw_bytes);
  ASSERT_TRUE(std::filesystem::exists(d.path() + "/ck/rank0.ebt"));
  EXPECT_EQ(d.entries(), 1u);  // committed, no temporaries
  ShardReader rd(d.path() + "/ck/rank0.ebt");
  ASSERT_EQ(rd.header().blobs.size(), 3u);
  std::vector<unsigned char> a2(a.size());
  std::vector<uint16_t> b2(b.size());
  rd.read({{0, test::host_buffer(a2)}, {1, test::host_buffer(b2)}});
  EXPECT_EQ(a, a2);
  EXPECT_EQ(b, b2);
  EXPECT_TRUE(rd.verify().empty());
}

// BlobTarget::part: a destination takes a byte range of a blob (a DCP item's
// tensor inside its frame), across chunk boundaries, within one chunk, a
// whole aligned chunk in place, from raw and compressed chunks; a range
// outside the blob is refused before any read.
TEST_P(CkptWriterTest, PartTargetsReadByteRangesOfABlob) {
  TempDir d;
  auto a = test::random_bytes((3 << 20) + 77, 11);
  std::vector<uint16_t> b(600000);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(0x3f00 + i % 89);
  const Codec bc = have_zstd() ? Codec::kFloatZstd : Codec::kNone;
  save_blobs(d.path(), {{"a", test::host_buffer(a), 1, Codec::kNone}, {"b", test::host_buffer(b), 2, bc}},
             options(1 << 20));
  ShardReader rd(d.path() + "/ck/rank0.ebt");
  const auto* braw = reinterpret_cast<const unsigned char*>(b.data());
  struct Range {
    uint32_t blob;
    uint64_t off, len;
  };
  const uint64_t M = 1 << 20;
  const Range ranges[] = {{0, 0, 10},       {0, M - 5, 10},     {0, 2 * M, M}, {0, 5, 3 * M},
                          {0, a.size() - 77, 77}, {0, 123, 0}, {1, M - 3, 100000}, {1, 17, 1000}};
  std::vector<std::unique_ptr<unsigned char, decltype(&std::free)>> bufs;
  std::vector<BlobTarget> targets;
  for (const auto& r : ranges) {
    bufs.emplace_back(static_cast<unsigned char*>(std::aligned_alloc(4096, align_up(r.len + 1, 4096))), &std::free);
    std::memset(bufs.back().get(), 0xEE, r.len + 1);
    targets.push_back({r.blob, {bufs.back().get(), r.len}, r.off, true});
  }
  rd.read(targets);
  for (size_t i = 0; i < std::size(ranges); ++i) {
    const auto& r = ranges[i];
    const unsigned char* want = (r.blob == 0 ? a.data() : braw) + r.off;
    EXPECT_EQ(0, std::memcmp(bufs[i].get(), want, r.len)) << "range " << i;
    EXPECT_EQ(bufs[i].get()[r.len], 0xEE) << "range " << i << " wrote past its destination";
  }
  unsigned char one[64];
  for (uint64_t off : {a.size() - 63, uint64_t{a.size()}, ~uint64_t{0} - 10}) {
    try {
      rd.read({{0, {one, 64}, off, true}});
      ADD_FAILURE() << "a part at " << off << " of a " << a.size() << "-byte blob was read";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("asks for 64 at byte"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(rd.read({{0, {one, 64}, 1, false}}), InvalidArgument) << "an offset without `part`";
}

TEST_P(CkptWriterTest, CorruptChunkNamesBlobAndOffset) {
  TempDir d;
  auto a = test::random_bytes(3 << 20, 2);
  WriterOptions o;
  o.chunk_bytes = 1 << 20;
  o.backend = GetParam();
  save_blobs(d.path(), {{"layer.w", test::host_buffer(a), 1, Codec::kNone}}, o);
  std::string f = d.path() + "/ck/rank0.ebt";
  uint64_t off;
  {
    ShardReader rd(f);
    off = rd.header().chunks[1].file_offset;
  }
  {
    std::fstream fs(f, std::ios::in | std::ios::out | std::ios::binary);
    fs.seekp(static_cast<std::streamoff>(off + 10));
    fs.put('\x42');
  }
  ShardReader rd(f);
  std::vector<unsigned char> a2(a.size());
  try {
    rd.read({{0, test::host_buffer(a2)}});
    FAIL() << "corruption not detected";
  } catch (const ChecksumError& e) {
    EXPECT_EQ(e.offset(), static_cast<int64_t>(off));
    EXPECT_NE(std::string(e.what()).find("layer.w"), std::string::npos) << e.what();
  }
  auto problems = rd.verify();
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].blob, "layer.w");
  EXPECT_EQ(problems[0].file_offset, off);
  // A part of the blob outside the bad chunk fails too (Note [Parts are checked whole]): a load of a DCP
  // item fails wherever verify() finds a bad chunk of its blob.
  unsigned char head[10];
  try {
    rd.read({{0, {head, sizeof(head)}, 0, true}});
    FAIL() << "a bad chunk outside the part read was not detected";
  } catch (const ChecksumError& e) {
    EXPECT_EQ(e.offset(), static_cast<int64_t>(off));
    EXPECT_EQ(std::string(e.what()), problems[0].message);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, CkptWriterTest,
                         ::testing::Values(io::BackendKind::kAuto, io::BackendKind::kPosix),
                         [](const auto& info) { return std::string(io::to_string(info.param)); });

TEST(CkptWriter, InjectedFaultLeavesPreviousCheckpoint) {
  TempDir d;
  auto a = test::random_bytes(1 << 20, 4);
  save_blobs(d.path(), {{"x", test::host_buffer(a), 1, Codec::kNone}});
  inject_write_fault(0, ENOSPC);
  auto b = test::random_bytes(2 << 20, 5);
  try {
    save_blobs(d.path(), {{"x", test::host_buffer(b), 1, Codec::kNone}});
    inject_write_fault(0, 0);
    FAIL() << "fault not reported";
  } catch (const IoError& e) {
    inject_write_fault(0, 0);
    EXPECT_EQ(e.err(), ENOSPC);
  }
  ShardReader rd(d.path() + "/ck/rank0.ebt");
  EXPECT_EQ(rd.header().blobs[0].nbytes, a.size());
}

TEST(CkptWriter, SecondSaveWhileInFlightIsRejectedOrBlocks) {
  // Writes into the shard are held (io::hold_file_writes), so the first save
  // is in flight whatever the disk's speed: the second is refused, a blocking
  // one waits for the first.
  TempDir d;
  WriterOptions o;
  o.threads = 1;
  CheckpointWriter w(o);
  struct Release {
    ~Release() { io::hold_file_writes(false); }
  } release;  // destroyed before w, whose destructor waits for the save
  std::vector<float> big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i % 1000) * 0.001f;
  auto mk = [&](const std::string& name) {
    SaveRequest r;
    r.file = d.path() + "/" + name;
    r.blobs = {{"x", test::host_buffer(big), 4, Codec::kFloatZstd}};
    return r;
  };
  io::hold_file_writes(true);
  auto h = w.save(mk("a"));
  // The writer reaches the hold (bounded only so that a fault fails, not hangs).
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (io::held_file_writes() == 0 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  ASSERT_EQ(io::held_file_writes(), 1);
  EXPECT_FALSE(h.done());
  EXPECT_THROW(w.save(mk("b")), StateError);
  EXPECT_FALSE(std::filesystem::exists(d.path() + "/b"));
  auto blocked = std::async(std::launch::async, [&] { return w.save(mk("c"), /*block=*/true); });
  EXPECT_FALSE(h.done());
  io::hold_file_writes(false);
  h.wait();
  auto h2 = blocked.get();
  h2.wait();
  EXPECT_EQ(io::held_file_writes(), 0);
  EXPECT_TRUE(std::filesystem::exists(d.path() + "/a"));
  EXPECT_TRUE(std::filesystem::exists(d.path() + "/c"));
}

SaveRequest commit_request(const std::string& dir, const std::vector<unsigned char>& data, bool gated) {
  SaveRequest r;
  std::string tmp = make_temp_dir(dir + "/ck");
  r.file = tmp + "/rank0.ebt";
  r.blobs = {{"x", test::host_buffer(data), 1, Codec::kNone}};
  r.meta = "{}";
  r.commit_dir = tmp;
  r.commit_path = dir + "/ck";
  r.extra_files = {{"index.json", "{}"}};
  r.gated = gated;
  return r;
}

uint64_t committed_bytes(const std::string& dir) {
  ShardReader rd(dir + "/ck/rank0.ebt");
  return rd.header().blobs[0].nbytes;
}

// Note [Gated commit]: the data is written, the commit waits for the caller.
TEST(CkptWriter, GatedSaveCommitsOnlyWhenApproved) {
  TempDir d;
  auto a = test::random_bytes(1 << 20, 7), b = test::random_bytes(2 << 20, 8), c = test::random_bytes(3 << 20, 9);
  CheckpointWriter w;
  w.save(commit_request(d.path(), a, false)).wait();

  auto h = w.save(commit_request(d.path(), b, true));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // ample time to write 2 MiB
  EXPECT_FALSE(h.done()) << "a gated save must wait for approve()";
  EXPECT_EQ(committed_bytes(d.path()), a.size()) << "nothing committed before approval";
  h.approve();
  EXPECT_EQ(h.wait().raw_bytes, b.size());
  EXPECT_EQ(committed_bytes(d.path()), b.size());

  auto h2 = w.save(commit_request(d.path(), c, true));
  h2.reject("tensor 'x' changed while it was copied");
  try {
    h2.wait();
    FAIL() << "a rejected save must fail";
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'x' changed"), std::string::npos) << e.what();
  }
  w.join();
  EXPECT_EQ(committed_bytes(d.path()), b.size()) << "the previous checkpoint stays";
  EXPECT_EQ(d.entries(), 1u) << "the rejected save's temporary directory is gone";
  h2.approve();  // decided already: no effect
}

// Note [Uncopied async saves] (checkpoint.py): wait_written() returns once the
// data is durable, while a gated save still waits for its decision.
TEST(CkptWriter, WaitWrittenReturnsBeforeTheGatedCommit) {
  TempDir d;
  auto a = test::random_bytes(1 << 20, 11), b = test::random_bytes(2 << 20, 12);
  CheckpointWriter w;
  w.save(commit_request(d.path(), a, false)).wait();
  auto req = commit_request(d.path(), b, true);
  req.pipelined = true;
  const std::string file = req.file;
  auto h = w.save(std::move(req));
  h.wait_written();
  EXPECT_FALSE(h.done()) << "written, but the commit waits for approve()";
  EXPECT_EQ(committed_bytes(d.path()), a.size());
  EXPECT_EQ(std::filesystem::file_size(file) >= b.size(), true) << "the shard is written before the gate";
  h.approve();
  EXPECT_EQ(h.wait().raw_bytes, b.size());
  EXPECT_EQ(committed_bytes(d.path()), b.size());
}

// wait_copied(): a pipelined save stops reading its sources once its last
// chunk is in the ring, before the writes complete. The writing thread is
// held right after that point; wait_copied() returns, the save is not done.
TEST(CkptWriter, WaitCopiedReturnsBeforeThePipelinedWritesComplete) {
  TempDir d;
  auto a = test::random_bytes(1 << 20, 15), b = test::random_bytes(3 << 20, 14);
  CheckpointWriter w;
  w.save(commit_request(d.path(), a, false)).wait();
  std::promise<void> release;
  std::shared_future<void> go = release.get_future().share();
  std::promise<void> at_hook;
  std::future<void> reached = at_hook.get_future();
  detail::after_copy_hook = [&] {
    at_hook.set_value();
    go.wait();
  };
  auto req = commit_request(d.path(), b, false);
  req.pipelined = true;
  auto h = w.save(std::move(req));
  auto copied = std::async(std::launch::async, [&] { h.wait_copied(); });
  // Read everything while the writing thread is held, then let it go before any assertion.
  const bool held = reached.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  const bool returned = copied.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  const bool done_while_held = h.done();
  const uint64_t committed_while_held = committed_bytes(d.path());
  release.set_value();
  EXPECT_TRUE(held) << "the save never reached the point after its copies";
  EXPECT_TRUE(returned) << "wait_copied() waited for the writes";
  EXPECT_FALSE(done_while_held);
  EXPECT_EQ(committed_while_held, a.size());
  EXPECT_EQ(h.wait().raw_bytes, b.size());
  detail::after_copy_hook = nullptr;
  EXPECT_EQ(committed_bytes(d.path()), b.size());
  w.save(commit_request(d.path(), a, false)).wait_copied();  // not pipelined: returns once written (or done)
}

// Note [First async save]: reserve_arena grows the arena after the save.
TEST(CkptWriter, ReserveArenaGrowsTheArenaAfterTheSave) {
  TempDir d;
  auto a = test::random_bytes(1 << 20, 13);
  CheckpointWriter w;
  auto req = commit_request(d.path(), a, false);
  req.pipelined = true;
  req.reserve_arena = 200ull << 20;
  w.save(std::move(req)).wait();
  w.join();  // the growth runs on the writer's thread after done()
  EXPECT_GE(w.snapshot_capacity(), 200ull << 20);
  EXPECT_EQ(committed_bytes(d.path()), a.size());
}

TEST(CkptWriter, DestroyedWriterRejectsAWaitingGatedSave) {
  TempDir d;
  auto a = test::random_bytes(1 << 20, 10);
  SaveHandle h;
  {
    CheckpointWriter w;
    h = w.save(commit_request(d.path(), a, true));
  }
  EXPECT_TRUE(h.done());
  EXPECT_THROW(h.wait(), StateError);
  EXPECT_EQ(d.entries(), 0u);
}

// Note [Deferred removal]: replaced checkpoints go on the writer's reaper
// thread; join() waits for it; every generation but the last is removed.
TEST(CkptWriter, ReplacedCheckpointsAreRemovedInTheBackground) {
  TempDir d;
  auto a = test::random_bytes(4 << 20, 11);
  CheckpointWriter w;
  for (int gen = 0; gen < 5; ++gen) w.save(commit_request(d.path(), a, false)).wait();
  w.join();
  EXPECT_EQ(d.entries(), 1u) << "only the committed checkpoint remains";
  EXPECT_EQ(committed_bytes(d.path()), a.size());
  remove_stale_temps(d.path() + "/ck");  // nothing stale, nothing committed removed
  EXPECT_EQ(committed_bytes(d.path()), a.size());
}

// Note [Read pipeline] / [Populate ahead]: page-aligned host destinations are
// read in place, in fresh (never touched) mappings too.
TEST(CkptReader, InPlaceReadIntoFreshMapping) {
  TempDir d;
  auto a = test::random_bytes((6 << 20) + 4096, 12);
  save_blobs(d.path(), {{"x", test::host_buffer(a), 1, Codec::kNone}});
  void* p = ::mmap(nullptr, a.size(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  ShardReader rd(d.path() + "/ck/rank0.ebt");
  rd.read({{0, {p, a.size()}}});
  EXPECT_EQ(std::memcmp(p, a.data(), a.size()), 0);
  ::munmap(p, a.size());
}

TEST(CkptWriter, BadRequestsThrowBeforeWriting) {
  TempDir d;
  CheckpointWriter w;
  SaveRequest r;
  r.file = d.path() + "/x";
  r.blobs = {{"null", {nullptr, 10}, 1, Codec::kNone}};
  EXPECT_THROW(w.save(r), InvalidArgument);
  EXPECT_EQ(d.entries(), 0u);
  EXPECT_THROW(make_temp_dir("/nonexistent-dir-ebbtide/ck"), IoError);
}

TEST(CkptReader, TruncatedAndGarbageFiles) {
  TempDir d;
  auto a = test::random_bytes(1 << 20, 6);
  save_blobs(d.path(), {{"x", test::host_buffer(a), 1, Codec::kNone}});
  std::string f = d.path() + "/ck/rank0.ebt";
  auto size = std::filesystem::file_size(f);
  std::filesystem::resize_file(f, size - 4096);
  EXPECT_THROW(ShardReader{f}, InvalidArgument);
  std::filesystem::resize_file(f, 100);
  EXPECT_THROW(ShardReader{f}, InvalidArgument);
  EXPECT_THROW(ShardReader{d.path() + "/missing"}, IoError);
}

// CheckpointWriter::stage of host memory: pieces over the writer's threads,
// streaming stores where the destination allows; ranges above a piece (8
// MiB), odd lengths and an unaligned destination come out byte for byte.
TEST(CkptWriter, StageMovesEveryHostRangeExactly) {
  CheckpointWriter w;
  auto a = test::random_bytes((17 << 20) + 3, 11), b = test::random_bytes(4097, 12), c = test::random_bytes(1, 13);
  std::vector<unsigned char> da(a.size()), db(b.size() + 1), dc(1);
  w.stage({{da.data(), test::host_buffer(a)}, {db.data() + 1, test::host_buffer(b)}, {dc.data(), test::host_buffer(c)},
           {nullptr, {nullptr, 0}}});
  EXPECT_EQ(da, a);
  EXPECT_EQ(0, std::memcmp(db.data() + 1, b.data(), b.size()));
  EXPECT_EQ(dc, c);
}

// Note [Staging buffer]: reserve_staging maps the buffer with its pages
// present and makes it the writer's; a larger one replaces it, and views
// of the old one (a staged copy being written) keep it mapped.
TEST(CkptWriter, StagingBufferIsReplacedButOutlivesItsViews) {
  CheckpointWriter w;
  EXPECT_EQ(w.staging_buffer(), nullptr);
  EXPECT_THROW(w.reserve_staging(0), InvalidArgument);
  StagingBuffer first = w.reserve_staging(100000);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(w.staging_buffer(), first);
  EXPECT_GE(first->size(), 100000u);
  EXPECT_FALSE(first->pinned()) << "host state: never page-locked";
  auto a = test::random_bytes(100000, 14);
  w.stage({{first->data(), test::host_buffer(a)}});
  StagingBuffer second = w.reserve_staging(300000);
  EXPECT_EQ(w.staging_buffer(), second);
  EXPECT_NE(second->data(), first->data());
  EXPECT_EQ(0, std::memcmp(first->data(), a.data(), a.size())) << "the replaced buffer is still mapped";
  first.reset();
  EXPECT_EQ(first.use_count(), 0);
}

TEST(CkptCommit, ReplacesExistingDirectoryAtomically) {
  TempDir d;
  std::string path = d.path() + "/ck";
  CheckpointWriter w;
  for (int gen = 0; gen < 3; ++gen) {
    SaveTransaction txn = SaveTransaction::reserve(path, {}, "");
    write_file_durably(txn.tmp_dir() + "/gen", std::to_string(gen));
    w.commit(txn, {{"extra", "x" + std::to_string(gen)}});
    std::ifstream in(path + "/gen"), extra(path + "/extra");
    std::string s, x;
    in >> s;
    extra >> x;
    EXPECT_EQ(s, std::to_string(gen));
    EXPECT_EQ(x, "x" + std::to_string(gen));
    w.join();  // the replaced checkpoint goes on the writer's thread (Note [Deferred removal])
    EXPECT_EQ(d.entries(), 1u);
  }
  std::filesystem::create_directory(path + ".tmp-abcdef");
  remove_stale_temps(path);
  EXPECT_EQ(d.entries(), 1u);
}

TEST(CkptFormat, UnstripedSuperblockStaysVersion1) {
  Superblock sb;
  sb.format_version = kFormatVersionUnstriped;
  sb.header_offset = 4096;
  unsigned char buf[kSuperBytes];
  encode_superblock(sb, buf);
  for (int i = 52; i < 56; ++i) EXPECT_EQ(buf[i], 0);  // v1 layout: reserved bytes stay zero
  auto back = decode_superblock(buf, "x");
  EXPECT_EQ(back.format_version, 1u);
  EXPECT_EQ(back.stripe_count, 1u);
  sb.format_version = kFormatVersion;
  sb.stripe_count = 3;
  sb.stripe_index = 2;
  encode_superblock(sb, buf);
  back = decode_superblock(buf, "x");
  EXPECT_EQ(back.stripe_count, 3u);
  EXPECT_EQ(back.stripe_index, 2u);
}

}  // namespace
}  // namespace ebbtide::ckpt
