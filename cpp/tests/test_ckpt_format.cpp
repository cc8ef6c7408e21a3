// Checkpoint format, codecs, writer and reader (C++ level).
#include <sys/mman.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/reader.hpp"
#include "ebbtide/ckpt/transaction.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/util/error.hpp"
#include "sim_driver.hpp"
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

class CkptWriterTest : public ::testing::TestWithParam<io::BackendKind> {
 protected:
  // The parameter's backend, 2 threads, chunks of `chunk` bytes.
  WriterOptions options(uint64_t chunk) const {
    WriterOptions o;
    o.chunk_bytes = chunk;
    o.threads = 2;
    o.backend = GetParam();
    return o;
  }
};

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
  TempDir d;
  WriterOptions o;
  o.zstd_level = 19;
  o.threads = 1;
  CheckpointWriter w(o);
  std::vector<float> big(4 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i % 1000) * 0.001f;
  auto mk = [&](const std::string& name) {
    SaveRequest r;
    r.file = d.path() + "/" + name;
    r.blobs = {{"x", test::host_buffer(big), 4, Codec::kFloatZstd}};
    return r;
  };
  auto h = w.save(mk("a"));
  if (!h.done()) {
    EXPECT_THROW(w.save(mk("b")), StateError);
    EXPECT_FALSE(std::filesystem::exists(d.path() + "/b"));
  }
  auto h2 = w.save(mk("c"), /*block=*/true);
  h.wait();
  h2.wait();
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

// CheckpointWriter::copy: pieces over the writer's threads, streaming stores
// where the destination allows; ranges above a piece (8 MiB), odd lengths and
// an unaligned destination come out byte for byte.
TEST(CkptWriter, CopyMovesEveryRangeExactly) {
  CheckpointWriter w;
  auto a = test::random_bytes((17 << 20) + 3, 11), b = test::random_bytes(4097, 12), c = test::random_bytes(1, 13);
  std::vector<unsigned char> da(a.size()), db(b.size() + 1), dc(1);
  w.copy({{da.data(), a.data(), a.size()}, {db.data() + 1, b.data(), b.size()}, {dc.data(), c.data(), 1},
          {nullptr, nullptr, 0}});
  EXPECT_EQ(da, a);
  EXPECT_EQ(0, std::memcmp(db.data() + 1, b.data(), b.size()));
  EXPECT_EQ(dc, c);
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

// Note [Striping] in writer.cpp; pipelined (sync) saves write the same bytes.
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
