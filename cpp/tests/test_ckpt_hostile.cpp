// Checkpoint shards crafted by an attacker, with valid checksums: the reader
// refuses each with InvalidArgument naming the file and the bad entry
// (Note [Hostile headers] in cpp/src/ckpt/format.cpp, Note [Regular files
// only] in cpp/src/io/direct_file.cpp).
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/reader.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::ckpt {
namespace {

using test::TempDir;

// A well-formed shard built in memory: blob b of sizes[b] bytes, cut into
// chunks of at most `chunk` bytes, stored raw. `edit` changes the tables
// (and may change the superblock) after the layout is fixed; the header and
// superblock checksums are then recomputed, so only the checks behind the
// checksums stand between the edit and the reader.
struct Shard {
  Header h;
  Superblock sb;
  std::vector<std::string> data;  // blob contents
  std::string bytes;              // the file
};

Shard craft(const std::vector<uint64_t>& sizes, uint32_t chunk,
            const std::function<void(Header&, Superblock&)>& edit = {}) {
  Shard s;
  uint64_t off = kDataStart;
  std::string body;
  for (uint32_t b = 0; b < sizes.size(); ++b) {
    auto raw = test::random_bytes(sizes[b], 100 + b);
    s.data.emplace_back(raw.begin(), raw.end());
    BlobEntry be{"blob" + std::to_string(b), sizes[b], static_cast<uint32_t>(s.h.chunks.size()), 0, Codec::kNone, 1};
    for (uint64_t o = 0; o < sizes[b]; o += chunk) {
      uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(chunk, sizes[b] - o));
      ChunkEntry c{off, o, n, n, crc32c(s.data[b].data() + o, n), b, Codec::kNone, 0};
      s.h.chunks.push_back(c);
      body.append(s.data[b], o, n);
      body.resize(align_up(body.size(), kBlockBytes), '\0');
      off += align_up(n, kBlockBytes);
      ++be.chunk_count;
    }
    s.h.blobs.push_back(be);
  }
  s.h.meta = "{}";
  s.sb.format_version = kFormatVersionUnstriped;
  s.sb.header_offset = off;
  if (edit) edit(s.h, s.sb);
  std::string header = encode_header(s.h);
  s.sb.header_bytes = header.size();
  s.sb.file_bytes = off + align_up(header.size(), kBlockBytes);
  s.sb.header_crc = crc32c(header.data(), header.size());
  if (edit) edit(s.h, s.sb);  // superblock edits win over the computed fields
  unsigned char super[kSuperBytes];
  encode_superblock(s.sb, super);
  s.bytes.assign(reinterpret_cast<const char*>(super), kSuperBytes);
  s.bytes.resize(kDataStart, '\0');
  s.bytes += body;
  s.bytes.resize(off, '\0');
  s.bytes += header;
  s.bytes.resize(off + align_up(header.size(), kBlockBytes), '\0');
  return s;
}

std::string write_file(const TempDir& dir, const std::string& bytes, const std::string& name = "rank0.ebt") {
  std::string p = dir.path() + "/" + name;
  std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return p;
}

// Opens `bytes` as a shard and reads every blob; the message of the error, or "" when it loaded.
std::string load_error(const std::string& bytes) {
  TempDir dir;
  std::string p = write_file(dir, bytes);
  try {
    ShardReader r(p, false);
    std::vector<std::vector<char>> bufs;
    std::vector<BlobTarget> targets;
    for (uint32_t b = 0; b < r.header().blobs.size(); ++b) {
      bufs.emplace_back(r.header().blobs[b].nbytes);
      targets.push_back({b, test::host_buffer(bufs.back())});
    }
    r.read(targets, 2);
    return "";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "the message names the file: " << e.what();
    return e.what();
  }
}

using test::contains;

TEST(CkptHostile, CraftedShardLoadsWhenWellFormed) {
  auto s = craft({10000, 0, 4096}, 4096);
  TempDir dir;
  ShardReader r(write_file(dir, s.bytes), false);
  ASSERT_EQ(r.header().blobs.size(), 3u);
  for (uint32_t b = 0; b < 3; ++b) {
    std::string out(s.data[b].size(), '\xAA');
    r.read({{b, test::host_buffer(out)}});
    EXPECT_EQ(out, s.data[b]) << "blob " << b;
  }
  // A destination of another size than the blob is refused before any read.
  std::string short_by_one(s.data[0].size() - 1, '\xAA');
  try {
    r.read({{0, test::host_buffer(short_by_one)}});
    ADD_FAILURE() << "a destination one byte short was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "has 10000 bytes, its destination 9999")) << e.what();
  }
  EXPECT_EQ(short_by_one, std::string(s.data[0].size() - 1, '\xAA'));
  EXPECT_TRUE(r.verify().empty());
}

TEST(CkptHostile, ChunkOfAnotherBlobIsRefused) {
  // Blob 0 (4 KiB) lists blob 1's 64 KiB chunk: the read would run 60 KiB past blob 0.
  auto s = craft({4096, 65536}, 65536, [](Header& h, Superblock&) {
    h.blobs[0].first_chunk = 1;
    h.blobs[1].first_chunk = 0;
  });
  EXPECT_TRUE(contains(load_error(s.bytes), "which belongs to blob"));
}

TEST(CkptHostile, RawOffsetNearTwoToThe64IsRefused) {
  for (uint64_t raw_offset : {UINT64_MAX - 4095, UINT64_MAX - 100, uint64_t{1} << 63}) {
    auto s = craft({8192}, 4096, [&](Header& h, Superblock&) { h.chunks[1].raw_offset = raw_offset; });
    EXPECT_TRUE(contains(load_error(s.bytes), "covers bytes at")) << raw_offset;
  }
}

TEST(CkptHostile, BlobBytesWithoutAChunkAreRefused) {
  auto none = craft({8192}, 4096, [](Header& h, Superblock&) {
    h.blobs[0].chunk_count = 0;
    h.chunks.clear();
  });
  EXPECT_TRUE(contains(load_error(none.bytes), "cover 0 of its 8192 bytes"));
  auto gap = craft({12288}, 4096, [](Header& h, Superblock&) {  // bytes [4096, 8192) never written
    h.chunks[1].raw_offset = 8192;
    h.chunks[2].raw_offset = 8192;
  });
  EXPECT_TRUE(contains(load_error(gap.bytes), "should start at 4096"));
  auto twice = craft({8192}, 4096, [](Header& h, Superblock&) { h.chunks[1].raw_offset = 0; });
  EXPECT_TRUE(contains(load_error(twice.bytes), "should start at 4096"));
  auto shortfall = craft({8192}, 4096, [](Header& h, Superblock&) { h.blobs[0].nbytes = 9000; });
  EXPECT_TRUE(contains(load_error(shortfall.bytes), "cover 8192 of its 9000 bytes"));
}

TEST(CkptHostile, UnlistedOrDoublyListedChunksAreRefused) {
  auto unlisted = craft({8192}, 4096, [](Header& h, Superblock&) { h.blobs[0].chunk_count = 1; });
  EXPECT_TRUE(contains(load_error(unlisted.bytes), "the blobs list 1 chunks, the chunk table has 2"));
  auto doubly = craft({4096, 4096}, 4096, [](Header& h, Superblock&) {
    h.blobs[1].first_chunk = 0;
    h.chunks[1].blob = 0;
  });
  EXPECT_TRUE(contains(load_error(doubly.bytes), "which belongs to blob"));
}

TEST(CkptHostile, ChunkSizesAreBounded) {
  auto zero = craft({4096}, 4096, [](Header& h, Superblock&) { h.chunks[0].raw_bytes = h.chunks[0].stored_bytes = 0; });
  EXPECT_FALSE(load_error(zero.bytes).empty());
  auto bigger = craft({4096}, 4096, [](Header& h, Superblock&) {
    h.chunks[0].codec = Codec::kZstd;
    h.chunks[0].raw_bytes = 2048;
  });
  EXPECT_TRUE(contains(load_error(bigger.bytes), "2048 raw and 4096 stored bytes"));
  auto huge = craft({4096}, 4096, [](Header& h, Superblock&) {
    h.blobs[0].nbytes = (1ull << 30) + 4096;
    h.chunks[0].raw_bytes = (1u << 30) + 4096;
    h.chunks[0].codec = Codec::kZstd;
  });
  EXPECT_TRUE(contains(load_error(huge.bytes), "raw and 4096 stored bytes"));
  auto raw_mismatch = craft({8192}, 8192, [](Header& h, Superblock&) { h.chunks[0].stored_bytes = 4096; });
  EXPECT_TRUE(contains(load_error(raw_mismatch.bytes), "8192 raw and 4096 stored bytes (codec none)"));
}

TEST(CkptHostile, FileOffsetsAreCheckedAgainstTheFile) {
  for (uint64_t off : {UINT64_MAX - 4095, uint64_t{1} << 40, uint64_t{0}, uint64_t{12288}}) {
    // 12288: the chunk would be read out of the header.
    auto s = craft({8192}, 4096, [&](Header& h, Superblock&) { h.chunks[1].file_offset = off; });
    std::string e = load_error(s.bytes);
    EXPECT_FALSE(e.empty()) << off;
    EXPECT_TRUE(contains(e, "inside the superblock block") || contains(e, "past the data area")) << e;
  }
}

TEST(CkptHostile, SuperblockHeaderRangeIsCheckedWithoutOverflow) {
  auto s = craft({4096}, 4096, [](Header&, Superblock& sb) {
    if (sb.header_bytes == 0) return;
    sb.header_offset = UINT64_MAX - 4095;  // aligned; + header_bytes wraps to a small number
    sb.header_bytes = 8192;
  });
  std::string e = load_error(s.bytes);
  EXPECT_TRUE(contains(e, "truncated checkpoint shard")) << e;
  auto t = craft({4096}, 4096, [](Header&, Superblock& sb) {
    if (sb.header_bytes != 0) sb.header_bytes = UINT64_MAX - 4095;
  });
  EXPECT_TRUE(contains(load_error(t.bytes), "truncated checkpoint shard"));
}

TEST(CkptHostile, TableCountsAndNamesAreChecked) {
  auto s = craft({4096}, 4096);
  // n_blobs at header offset 8: a count whose tables would not fit the header.
  std::string bytes = s.bytes;
  uint64_t h = s.sb.header_offset;
  uint32_t nb = 0x10000000;
  std::memcpy(bytes.data() + h + 8, &nb, 4);
  Superblock sb = s.sb;
  sb.header_crc = crc32c(bytes.data() + h, sb.header_bytes);
  unsigned char super[kSuperBytes];
  encode_superblock(sb, super);
  std::memcpy(bytes.data(), super, kSuperBytes);
  EXPECT_TRUE(contains(load_error(bytes), "table sizes do not match"));
  auto bad_name = craft({4096}, 4096, [](Header& hd, Superblock&) { hd.blobs[0].name = "w\xff\xfe"; });
  EXPECT_TRUE(contains(load_error(bad_name.bytes), "is not UTF-8"));
  auto codec = craft({4096}, 4096, [](Header& hd, Superblock&) { hd.chunks[0].codec = static_cast<Codec>(9); });
  EXPECT_TRUE(contains(load_error(codec.bytes), "unknown codec 9"));
}

TEST(CkptHostile, StripeNumberBeyondTheShardIsRefused) {
  auto s = craft({4096}, 4096, [](Header& h, Superblock&) { h.chunks[0].stripe = 3; });
  EXPECT_TRUE(contains(load_error(s.bytes), "in stripe 3, the shard has 1 files"));
}

TEST(CkptHostile, SpecialFilesAreRefusedWithoutBlocking) {
  TempDir dir;
  std::string fifo = dir.path() + "/rank0.ebt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto t0 = std::chrono::steady_clock::now();
  try {
    ShardReader r(fifo, false);
    FAIL() << "a FIFO was opened as a shard";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "not a regular file (it is a FIFO)")) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));  // returns, does not block
  std::string sub = dir.sub("d");
  EXPECT_THROW(ShardReader(sub, false), InvalidArgument);
  auto s = craft({4096}, 4096);
  std::string real = write_file(dir, s.bytes, "real.ebt");
  std::string link = dir.path() + "/link.ebt";
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  try {
    ShardReader r(link, false);
    FAIL() << "a symlink was followed";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "symbolic link")) << e.what();
  }
  EXPECT_NO_THROW(ShardReader(real, false));
}

// Every single-field edit of a well-formed header either loads the exact
// bytes or is refused: a deterministic sweep over fields and values.
TEST(CkptHostile, FieldEditsLoadExactBytesOrFail) {
  const uint64_t values[] = {0, 1, 4095, 4096, 4097, 8192, 65536, UINT32_MAX, UINT64_MAX, UINT64_MAX - 4095,
                             uint64_t{1} << 32, uint64_t{1} << 63};
  using Edit = std::function<void(Header&, uint64_t)>;
  const std::vector<std::pair<const char*, Edit>> edits = {
      {"nbytes", [](Header& h, uint64_t v) { h.blobs[0].nbytes = v; }},
      {"first_chunk", [](Header& h, uint64_t v) { h.blobs[1].first_chunk = static_cast<uint32_t>(v); }},
      {"chunk_count", [](Header& h, uint64_t v) { h.blobs[0].chunk_count = static_cast<uint32_t>(v); }},
      {"elem_bytes", [](Header& h, uint64_t v) { h.blobs[0].elem_bytes = static_cast<uint16_t>(v); }},
      {"file_offset", [](Header& h, uint64_t v) { h.chunks[1].file_offset = v; }},
      {"raw_offset", [](Header& h, uint64_t v) { h.chunks[1].raw_offset = v; }},
      {"raw_bytes", [](Header& h, uint64_t v) { h.chunks[2].raw_bytes = static_cast<uint32_t>(v); }},
      {"stored_bytes", [](Header& h, uint64_t v) { h.chunks[0].stored_bytes = static_cast<uint32_t>(v); }},
      {"blob", [](Header& h, uint64_t v) { h.chunks[2].blob = static_cast<uint32_t>(v); }},
  };
  for (const auto& [field, edit] : edits) {
    for (uint64_t v : values) {
      auto s = craft({10000, 4096}, 4096, [&, e = edit](Header& h, Superblock& sb) {
        if (sb.header_bytes == 0) e(h, v);
      });
      TempDir dir;
      std::string p = write_file(dir, s.bytes);
      try {
        ShardReader r(p, false);
        for (uint32_t b = 0; b < r.header().blobs.size(); ++b) {
          std::string out(r.header().blobs[b].nbytes, '\xAA');
          r.read({{b, test::host_buffer(out)}});
          EXPECT_EQ(out, s.data[b]) << field << " = " << v << ": blob " << b << " loaded different bytes";
        }
      } catch (const InvalidArgument&) {
      } catch (const IoError&) {  // ChecksumError, or a chunk past the end of the file
      }
    }
  }
}

}  // namespace
}  // namespace ebbtide::ckpt
