// safetensors files: well-formed headers parse and round trip; hostile ones
// are refused with InvalidArgument naming the file and the tensor (Note
// [Hostile safetensors] in cpp/src/ckpt/safetensors.cpp); reads in place and
// through staging return the bytes written.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/safetensors.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::ckpt::safetensors {
namespace {

using test::TempDir;

const std::string kPath = "/ckpt/model.safetensors";

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The message parse_header throws for `json` with `data_bytes` bytes of data
// after it, or "" when it parses.
std::string parse_error(const std::string& json, uint64_t data_bytes) {
  try {
    parse_header(json, 8 + json.size() + data_bytes, kPath);
    return "";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), kPath)) << "the message names the file: " << e.what();
    return e.what();
  }
}

std::string file_bytes_of(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + data;
}

std::string write_file(const TempDir& dir, const std::string& bytes, const std::string& name = "t.safetensors") {
  std::string p = dir.path() + "/" + name;
  std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return p;
}

IoOptions buffered() {
  IoOptions o;
  o.direct = false;
  return o;
}

TEST(Safetensors, DtypeBits) {
  EXPECT_EQ(dtype_bits("F32"), 32u);
  EXPECT_EQ(dtype_bits("BF16"), 16u);
  EXPECT_EQ(dtype_bits("F8_E4M3"), 8u);
  EXPECT_EQ(dtype_bits("BOOL"), 8u);
  EXPECT_EQ(dtype_bits("F4"), 4u);
  EXPECT_EQ(dtype_bits("C64"), 64u);
  EXPECT_EQ(dtype_bits("f32"), 0u);
  EXPECT_EQ(dtype_bits(""), 0u);
}

TEST(Safetensors, EncodedHeaderParsesBack) {
  std::vector<TensorInfo> ts = {{"w", "F32", {2, 3}, 0, 24},
                                {"scalar", "F64", {}, 24, 32},
                                {"empty", "I8", {0, 5}, 32, 32},
                                {"odd \"name\"\n\\ \xC3\xA9", "U8", {3}, 32, 35}};
  Metadata meta = {{"format", "pt"}, {"note", "quote \" and \x01"}};
  std::string json = encode_header(ts, meta);
  EXPECT_EQ((8 + json.size()) % 8, 0u) << "the data section starts 8-aligned";
  Header h = parse_header(json, 8 + json.size() + 35, kPath);
  ASSERT_EQ(h.tensors.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_EQ(h.tensors[i].name, ts[i].name);
    EXPECT_EQ(h.tensors[i].dtype, ts[i].dtype);
    EXPECT_EQ(h.tensors[i].shape, ts[i].shape);
    EXPECT_EQ(h.tensors[i].begin, ts[i].begin);
    EXPECT_EQ(h.tensors[i].end, ts[i].end);
  }
  EXPECT_EQ(h.metadata, meta);
  EXPECT_EQ(h.data_offset, 8 + json.size());
  EXPECT_EQ(h.data_bytes, 35u);
}

TEST(Safetensors, AcceptsWhatTheFormatAllows) {
  // Any tensor order, whitespace, escapes, unknown members, null metadata, no tensors.
  std::string json =
      "{\"b\":{\"shape\":[2],\"dtype\":\"F16\",\"data_offsets\":[4,8],\"extra\":[1,{\"x\":null},-2.5e3,true]},"
      "\"\\u00e9\\ud83d\\ude00\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]},\"__metadata__\":null}  ";
  Header g = parse_header(json, 8 + json.size() + 8, kPath);
  ASSERT_EQ(g.tensors.size(), 2u);
  EXPECT_EQ(g.tensors[1].name, "\xC3\xA9\xF0\x9F\x98\x80");
  EXPECT_TRUE(g.metadata.empty());
  EXPECT_TRUE(parse_error("{}", 0).empty());
  EXPECT_TRUE(parse_error("{\"__metadata__\":{}}", 0).empty());
  // Sub-byte dtypes: 4 F4 values are 2 bytes.
  EXPECT_TRUE(parse_error("{\"x\":{\"dtype\":\"F4\",\"shape\":[4],\"data_offsets\":[0,2]}}", 2).empty());
}

TEST(Safetensors, MalformedJsonIsRefused) {
  const std::pair<std::string, std::string> cases[] = {
      {"", "expected '{'"},
      {"[]", "expected '{'"},
      {"{", "expected a string"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}", "expected '}'"},
      {"{} x", "text after the header object"},
      {"{}{}", "text after the header object"},
      {"{\"a\" {}}", "expected ':'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},}", "expected a string"},
      {"{\"a", "unterminated string"},
      {"{\"a\x01\":{}}", "control character"},
      {"{\"\xff\":{}}", "not valid UTF-8"},
      {"{\"\xC0\xAF\":{}}", "not valid UTF-8"},
      {"{\"\\ud800\":{}}", "unpaired surrogate"},
      {"{\"\\udc00\":{}}", "unpaired surrogate"},
      {"{\"\\ud800\\u0041\":{}}", "unpaired surrogate"},
      {"{\"\\x\":{}}", "invalid escape"},
      {"{\"\\u12g4\":{}}", "invalid \\u escape"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"z\":" + std::string(100, '[') +
           std::string(100, ']') + "}}",
       "nested more than 64 deep"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"z\":tru}}", "unexpected character"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"z\":01}}", "expected '}'"},
  };
  for (const auto& [json, want] : cases) {
    std::string e = parse_error(json, 4);
    EXPECT_TRUE(contains(e, want)) << json.substr(0, 80) << " -> " << e;
  }
}

TEST(Safetensors, BadTensorEntriesAreRefusedNamingTheTensor) {
  auto entry = [](const std::string& body) { return "{\"w.0\":{" + body + "}}"; };
  const std::pair<std::string, std::string> cases[] = {
      {entry("\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]"), "unknown dtype 'F33'"},
      {entry("\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]"), "expected a string for the dtype"},
      {entry("\"shape\":[1],\"data_offsets\":[0,4]"), "has no 'dtype'"},
      {entry("\"dtype\":\"F32\",\"data_offsets\":[0,4]"), "has no 'shape'"},
      {entry("\"dtype\":\"F32\",\"shape\":[1]"), "has no 'data_offsets'"},
      {entry("\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]"), "has 'dtype' twice"},
      {entry("\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]"), "not a non-negative integer"},
      {entry("\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]"), "not an integer"},
      {entry("\"dtype\":\"F32\",\"shape\":[1e0],\"data_offsets\":[0,4]"), "not an integer"},
      {entry("\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]"), "leading zero"},
      {entry("\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]"), "not a non-negative integer"},
      {entry("\"dtype\":\"F32\",\"shape\":[18446744073709551616],\"data_offsets\":[0,4]"), "does not fit in 64 bits"},
      {entry("\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]"), "expected '['"},
      {entry("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]"), "two offsets"},
      {entry("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]"), "after the two data_offsets"},
      {entry("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]"), "end before they begin"},
      {entry("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]"), "does not take the 4 bytes"},
      {entry("\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,4]"), "does not take the 4 bytes"},
      {entry("\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,4]"), "does not take"},
      {entry("\"dtype\":\"F32\",\"shape\":[18446744073709551615,18446744073709551615,18446744073709551615],"
             "\"data_offsets\":[0,4]"),
       "does not take"},
      {entry("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,18446744073709551615]"), "run past the data section"},
      {"{\"w.0\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"w.0\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
       "tensor 'w.0' appears twice"},
      {"{\"w.0\":[]}", "expected '{' to open the entry of tensor 'w.0'"},
  };
  for (const auto& [json, want] : cases) {
    std::string e = parse_error(json, 4);
    EXPECT_TRUE(contains(e, want)) << json.substr(0, 120) << " -> " << e;
    EXPECT_TRUE(contains(e, "'w.0'")) << "names the tensor: " << e;
  }
  std::string dims = "[";
  for (size_t i = 0; i <= kMaxDims; ++i) dims += (i ? ",1" : "1");
  dims += "]";
  std::string e = parse_error(entry("\"dtype\":\"U8\",\"shape\":" + dims + ",\"data_offsets\":[0,1]"), 1);
  EXPECT_TRUE(contains(e, "more than 64 dimensions")) << e;
}

TEST(Safetensors, MetadataMustBeAStringMap) {
  EXPECT_TRUE(contains(parse_error("{\"__metadata__\":{\"a\":1}}", 0), "value of 'a' is not a string"));
  EXPECT_TRUE(contains(parse_error("{\"__metadata__\":[]}", 0), "to open __metadata__"));
  EXPECT_TRUE(contains(parse_error("{\"__metadata__\":{\"a\":\"x\",\"a\":\"y\"}}", 0), "key 'a' twice"));
  EXPECT_TRUE(contains(parse_error("{\"__metadata__\":{},\"__metadata__\":{}}", 0), "__metadata__ appears twice"));
}

TEST(Safetensors, TensorsMustTileTheDataSection) {
  auto t = [](const std::string& name, uint64_t b, uint64_t e) {
    return "\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[" + std::to_string(e - b) + "],\"data_offsets\":[" +
           std::to_string(b) + "," + std::to_string(e) + "]}";
  };
  EXPECT_TRUE(parse_error("{" + t("a", 4, 10) + "," + t("b", 0, 4) + "," + t("z", 4, 4) + "}", 10).empty());
  std::string e = parse_error("{" + t("a", 0, 6) + "," + t("b", 4, 10) + "}", 10);
  EXPECT_TRUE(contains(e, "tensor 'b' at data bytes [4, 10) overlaps tensor 'a' at [0, 6)")) << e;
  e = parse_error("{" + t("a", 0, 4) + "," + t("b", 6, 10) + "}", 10);
  EXPECT_TRUE(contains(e, "data bytes [4, 6) belong to no tensor (before tensor 'b')")) << e;
  e = parse_error("{" + t("a", 2, 10) + "}", 10);
  EXPECT_TRUE(contains(e, "data bytes [0, 2) belong to no tensor")) << e;
  e = parse_error("{" + t("a", 0, 4) + "}", 10);
  EXPECT_TRUE(contains(e, "data bytes [4, 10) at the end of the file belong to no tensor")) << e;
  e = parse_error("{" + t("a", 0, 4) + "," + t("same", 0, 4) + "}", 4);
  EXPECT_TRUE(contains(e, "overlaps")) << e;
  e = parse_error("{" + t("a", 0, 10) + "," + t("inside", 5, 5) + "}", 10);
  EXPECT_TRUE(contains(e, "tensor 'inside'") && contains(e, "overlaps")) << e;
}

TEST(Safetensors, LongNamesAreCutInMessages) {
  std::string name(5000, 'n');
  std::string e = parse_error("{\"" + name + "\":{\"dtype\":\"X\",\"shape\":[],\"data_offsets\":[0,0]}}", 0);
  EXPECT_TRUE(contains(e, "(5000 bytes)")) << e.substr(0, 300);
  EXPECT_LT(e.size(), 600u);
}

TEST(Safetensors, ReaderChecksTheLengthPrefix) {
  TempDir dir;
  auto open_error = [&](const std::string& bytes) {
    std::string p = write_file(dir, bytes);
    try {
      Reader r(p, buffered());
      return std::string();
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(contains(e.what(), p)) << e.what();
      return std::string(e.what());
    }
  };
  EXPECT_TRUE(contains(open_error(""), "fewer than the 8-byte header length"));
  EXPECT_TRUE(contains(open_error("\x02\0\0"), "fewer than the 8-byte header length"));
  std::string huge(8, '\xff');
  EXPECT_TRUE(contains(open_error(huge + "{}"), "above the 100000000-byte limit"));
  std::string past = file_bytes_of("{}", "");
  past[0] = 3;
  EXPECT_TRUE(contains(open_error(past), "runs past the end of the file"));
  EXPECT_TRUE(contains(open_error(std::string("PK\x03\x04\x14\0\0\0", 8) + std::string(100, 'z')), "zip file"));
  EXPECT_TRUE(open_error(file_bytes_of("{}", "")).empty());
}

TEST(Safetensors, SpecialFilesAreRefusedWithoutBlocking) {
  TempDir dir;
  std::string target = write_file(dir, file_bytes_of("{}", ""));
  std::string link = dir.path() + "/link.safetensors";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  EXPECT_THROW(Reader(link, buffered()), InvalidArgument);
  std::string fifo = dir.path() + "/fifo.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    Reader r(fifo, buffered());
    ADD_FAILURE() << "a FIFO was opened";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "FIFO")) << e.what();
  }
  EXPECT_THROW(Reader(dir.path(), buffered()), InvalidArgument);
  EXPECT_THROW(Reader(dir.path() + "/missing.safetensors", buffered()), IoError);
}

// Saves tensors of awkward sizes (crossing 4 MiB pieces and 4 KiB blocks),
// then reads them back in place and staged, with and without O_DIRECT.
TEST(Safetensors, SaveAndReadBack) {
  TempDir dir;
  struct T {
    std::string name, dtype;
    std::vector<uint64_t> shape;
    std::vector<unsigned char> bytes;
  };
  std::vector<T> ts = {{"big", "F32", {(5u << 20) / 4 + 3}, {}},
                       {"half", "BF16", {3, 4099}, {}},
                       {"byte", "U8", {7}, {}},
                       {"scalar", "F64", {}, {}},
                       {"empty", "I64", {0}, {}},
                       {"mid", "I16", {1 << 20}, {}}};
  std::vector<SaveTensor> src;
  for (size_t i = 0; i < ts.size(); ++i) {
    uint64_t n = dtype_bits(ts[i].dtype) / 8;
    for (auto d : ts[i].shape) n *= d;
    ts[i].bytes = test::random_bytes(n, 7 + i);
    src.push_back({ts[i].name, ts[i].dtype, ts[i].shape, test::host_buffer(ts[i].bytes)});
  }
  const std::string path = dir.path() + "/m.safetensors";
  for (bool direct_save : {true, false}) {
    IoOptions so;
    so.direct = direct_save;
    SaveResult sr = save(path, src, {{"k", "v"}}, so);
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), sr.file_bytes);
    for (bool direct_read : {true, false}) {
      for (bool in_place : {true, false}) {
        IoOptions ro;
        ro.direct = direct_read;
        Reader r(path, ro);
        const auto& h = r.header();
        EXPECT_EQ(h.metadata, (Metadata{{"k", "v"}}));
        ASSERT_EQ(h.tensors.size(), ts.size());
        std::vector<std::string> names;
        for (const auto& t : h.tensors) names.push_back(t.name);
        EXPECT_EQ(names, (std::vector<std::string>{"empty", "scalar", "big", "half", "mid", "byte"}))
            << "largest elements first, then by name";
        std::vector<ReadTarget> targets;
        std::vector<std::vector<char>> bufs;
        std::vector<char*> ptrs;
        for (size_t i = 0; i < h.tensors.size(); ++i) {
          uint64_t n = h.tensors[i].end - h.tensors[i].begin, a = h.data_offset + h.tensors[i].begin;
          // Owned blocks around a destination congruent to the file offset (Note [Reading in place]).
          bufs.emplace_back(n + 3 * 4096);
          char* base = reinterpret_cast<char*>(align_up(reinterpret_cast<uintptr_t>(bufs.back().data()), 4096));
          char* p = base + (in_place ? a % 4096 : (a + 1) % 4096);
          ptrs.push_back(p);
          targets.push_back({i, {p, n}, in_place});
        }
        if (direct_save && direct_read && in_place) {  // a destination of another size is refused
          std::vector<ReadTarget> wrong = targets;
          wrong[2].dst.nbytes += 1;
          try {
            r.read(wrong);
            ADD_FAILURE() << "a destination one byte too long was accepted";
          } catch (const InvalidArgument& e) {
            EXPECT_NE(std::string(e.what()).find("tensor 'big' has"), std::string::npos) << e.what();
          }
        }
        r.read(targets);
        for (size_t i = 0; i < h.tensors.size(); ++i) {
          const T* want = nullptr;
          for (const auto& t : ts)
            if (t.name == h.tensors[i].name) want = &t;
          ASSERT_NE(want, nullptr);
          EXPECT_EQ(h.tensors[i].shape, want->shape);
          EXPECT_TRUE(want->bytes.empty() || std::memcmp(ptrs[i], want->bytes.data(), want->bytes.size()) == 0)
              << want->name << " direct_save=" << direct_save << " direct_read=" << direct_read
              << " in_place=" << in_place;
        }
      }
    }
  }
  // Nothing but the file is left in the directory (the temporary was renamed).
  int entries = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1);
}

TEST(Safetensors, SaveRefusesBadTensors) {
  TempDir dir;
  const std::string path = dir.path() + "/bad.safetensors";
  float x4[4] = {};
  const mem::Buffer x{x4, sizeof x4};
  auto err = [&](std::vector<SaveTensor> ts, Metadata m = {}) {
    try {
      save(path, ts, m);
      return std::string();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
  };
  EXPECT_TRUE(contains(err({{"a", "F31", {4}, x}}), "unknown safetensors dtype 'F31'"));
  EXPECT_TRUE(contains(err({{"a", "F32", {4}, x}, {"a", "F32", {4}, x}}), "tensor 'a': the name appears twice"));
  EXPECT_TRUE(contains(err({{"__metadata__", "F32", {4}, x}}), "reserved"));
  EXPECT_TRUE(contains(err({{"a", "F32", {4}, {nullptr, 16}}}), "null data pointer"));
  EXPECT_TRUE(contains(err({{"a", "F32", {5}, x}}), "tensor 'a': its F32 shape has 20 bytes, its data 16"));
  EXPECT_TRUE(contains(err({{"\xff", "F32", {4}, x}}), "not valid UTF-8"));
  EXPECT_TRUE(contains(err({{"a", "F32", {UINT64_MAX, 2}, x}}), "not a whole number of bytes"));
  EXPECT_TRUE(contains(err({{"a", "F32", {4}, x}}, {{"k", "1"}, {"k", "2"}}), "appears twice"));
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_THROW(save(dir.path() + "/no/such/dir/x.safetensors", {{"a", "F32", {4}, x}}, {}), IoError);
}

// Random byte mutations of a valid file: each opens and reads cleanly or
// throws InvalidArgument; never a crash, a hang or a read outside the file.
TEST(Safetensors, RandomMutationsNeverCrash) {
  TempDir dir;
  std::vector<unsigned char> a = test::random_bytes(4096 + 100, 1), b = test::random_bytes(6, 2);
  const std::string path = dir.path() + "/v.safetensors";
  save(path, {{"layer.weight", "F32", {1049}, {a.data(), 4196}}, {"bias", "I16", {3}, {b.data(), 6}}}, {{"format", "pt"}});
  std::string good;
  {
    std::ifstream f(path, std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(f), {});
  }
  std::mt19937_64 rng(1234);
  int accepted = 0, refused = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    std::string m = good;
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      // Mostly the length prefix and the header, where the structure is.
      size_t limit = rng() % 4 ? std::min<size_t>(m.size(), 8 + 200) : m.size();
      size_t at = rng() % limit;
      switch (rng() % 4) {
        case 0: m[at] = static_cast<char>(rng()); break;
        case 1: m[at] = "{}[],:\"0123456789-.e\\ u"[rng() % 23]; break;
        case 2: m.erase(at, 1 + rng() % 3); break;
        default: m.resize(rng() % (m.size() + 1)); break;
      }
    }
    std::string p = write_file(dir, m, "m" + std::to_string(iter % 4) + ".safetensors");
    try {
      Reader r(p, (iter % 2) ? buffered() : IoOptions{});
      std::vector<ReadTarget> targets;
      std::vector<std::vector<char>> bufs;
      for (size_t i = 0; i < r.header().tensors.size(); ++i) {
        const auto& t = r.header().tensors[i];
        bufs.emplace_back(t.end - t.begin + 1);
        targets.push_back({i, {bufs.back().data(), t.end - t.begin}});
      }
      r.read(targets);
      ++accepted;
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(contains(e.what(), p)) << e.what();
      ++refused;
    }
  }
  EXPECT_GT(refused, 1000);
  EXPECT_GT(accepted, 0) << "mutations of tensor bytes keep the file valid";
}

}  // namespace
}  // namespace ebbtide::ckpt::safetensors
