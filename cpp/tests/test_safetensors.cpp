// safetensors files: well-formed headers parse and round trip; hostile ones
// are refused with InvalidArgument naming the file and the tensor (Note
// [Hostile safetensors] in cpp/src/ckpt/safetensors.cpp); reads in place and
// through staging return the bytes written.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/safetensors.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/util/error.hpp"
#include "sim_driver.hpp"
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

// The files this process has open, as (device, inode) pairs.
std::set<std::pair<dev_t, ino_t>> open_files() {
  std::set<std::pair<dev_t, ino_t>> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    struct stat st {};
    if (::stat(e.path().c_str(), &st) == 0) out.insert({st.st_dev, st.st_ino});
  }
  return out;
}

std::pair<dev_t, ino_t> file_id(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return {st.st_dev, st.st_ino};
}

// Note [Replaced files]: a save over a file keeps the old one open across
// the rename and closes it on the reaper's thread, so its extents are freed
// off the save's path; nothing stays open after. A symbolic link at the path
// is replaced, not followed, and nothing is held for it.
TEST(Safetensors, SaveOverAFileClosesTheOldOneAfterTheRename) {
  TempDir dir;
  const auto a = test::random_bytes(3u << 20, 1), b = test::random_bytes(3u << 20, 2);
  auto tensors = [](const std::vector<unsigned char>& bytes) {
    return std::vector<SaveTensor>{{"w", "U8", {bytes.size()}, test::host_buffer(bytes)}};
  };
  const std::string path = dir.path() + "/m.safetensors", want = dir.path() + "/want.safetensors";
  save(want, tensors(b), {});
  save(path, tensors(a), {});
  const auto old_file = file_id(path);
  struct Unpause {
    ~Unpause() { pause_replaced_files(false); }
  } unpause;
  pause_replaced_files(true);
  save(path, tensors(b), {});
  EXPECT_EQ(test::read_file(path), test::read_file(want));
  EXPECT_TRUE(open_files().count(old_file)) << "the replaced file is closed on the reaper's thread, not in save()";
  pause_replaced_files(false);
  finish_replaced_files();
  EXPECT_FALSE(open_files().count(old_file)) << "the replaced file is still open after finish_replaced_files()";

  const std::string target = dir.path() + "/target", link = dir.path() + "/link.safetensors";
  save(target, tensors(a), {});
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  const auto before = open_files();
  pause_replaced_files(true);
  save(link, tensors(b), {});
  EXPECT_EQ(open_files(), before) << "nothing is held for a symbolic link";
  pause_replaced_files(false);
  struct stat st {};
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(test::read_file(link), test::read_file(want));
  EXPECT_NE(test::read_file(target), test::read_file(want)) << "the link's target is left alone";
}

// A forked child (a DataLoader worker) inherits the parent's count of
// replaced files still being closed, not the threads closing them: its own
// saves over files must neither wait for those nor be held by the parent's
// pause (Note [Replaced files]).
TEST(Safetensors, ForkedChildSavesOverFilesWhileTheParentsClosesArePending) {
  TempDir dir;
  const auto a = test::random_bytes(1u << 20, 5);
  const std::vector<SaveTensor> tensors{{"w", "U8", {a.size()}, test::host_buffer(a)}};
  const std::string path = dir.path() + "/m.safetensors", other = dir.path() + "/c.safetensors";
  save(path, tensors, {});
  save(other, tensors, {});
  struct Unpause {
    ~Unpause() { pause_replaced_files(false); }
  } unpause;
  pause_replaced_files(true);
  save(path, tensors, {});  // one close pending, held by the pause
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(60);  // a hang ends the child by SIGALRM, which the parent sees
    int rc = 0;
    try {
      save(other, tensors, {});  // waits for the closes queued before it: none of the child's
      save(other, tensors, {});  // and for its own
      finish_replaced_files();
    } catch (...) {
      rc = 2;
    }
    ::_exit(rc);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the child's saves hung or failed (status " << status << ")";
  pause_replaced_files(false);
  finish_replaced_files();
}

// A write failing part-way through a save over an existing file (disk
// full): IoError naming the file, the old file intact and not held open, no
// temporary left beside it.
TEST(Safetensors, FailedSaveLeavesTheOldFile) {
  TempDir dir;
  const auto a = test::random_bytes(1u << 20, 3), b = test::random_bytes(9u << 20, 4);
  const std::string path = dir.path() + "/m.safetensors";
  save(path, {{"w", "U8", {a.size()}, test::host_buffer(a)}}, {});
  const std::string before = test::read_file(path);
  const auto before_open = open_files();
  inject_write_fault(5u << 20, ENOSPC);  // past the first pieces of the ring
  try {
    save(path, {{"w", "U8", {b.size()}, test::host_buffer(b)}}, {});
    inject_write_fault(0, 0);
    ADD_FAILURE() << "the fault was not reported";
  } catch (const IoError& e) {
    inject_write_fault(0, 0);
    EXPECT_EQ(e.err(), ENOSPC);
    EXPECT_TRUE(contains(e.what(), "m.safetensors")) << e.what();
  }
  finish_replaced_files();
  EXPECT_EQ(test::read_file(path), before);
  EXPECT_EQ(open_files(), before_open);
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
  const std::string good = test::read_file(path);
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

// Device targets (Note [Reads into device memory]) on the simulated GPU,
// whose "device memory" is host memory: a file of tensors at unaligned
// offsets, each read into a device target or, every third one, a host one.
struct DeviceReadCase {
  TempDir dir;
  std::string path;
  std::vector<std::vector<unsigned char>> want;  // by header index
  std::vector<std::vector<char>> mem;            // the targets' memory
  std::vector<bool> on_device;

  DeviceReadCase() {
    std::vector<std::vector<unsigned char>> bytes;
    std::vector<SaveTensor> src;
    const std::vector<uint64_t> sizes = {(9u << 20) + 6, 4098, 3, (4u << 20) + 2, 70000, 2};
    for (size_t i = 0; i < sizes.size(); ++i) bytes.push_back(test::random_bytes(sizes[i], 40 + i));
    for (size_t i = 0; i < sizes.size(); ++i)
      src.push_back({"t" + std::to_string(i), "U8", {sizes[i]}, test::host_buffer(bytes[i])});
    path = dir.path() + "/d.safetensors";
    save(path, src, {});
    Reader r(path, buffered());
    for (const auto& t : r.header().tensors) {
      want.push_back(bytes[std::stoul(t.name.substr(1))]);
      mem.emplace_back(want.back().size());
      on_device.push_back(want.size() % 3 != 0);
    }
  }
  std::vector<ReadTarget> targets(mem::cuda::Stream stream) {
    std::vector<ReadTarget> out;
    for (size_t i = 0; i < mem.size(); ++i) {
      std::fill(mem[i].begin(), mem[i].end(), 0);
      out.push_back({i, {mem[i].data(), mem[i].size(), on_device[i] ? 0 : mem::kHost, on_device[i] ? stream : 0}});
    }
    return out;
  }
  void expect_read(const std::string& how) {
    for (size_t i = 0; i < mem.size(); ++i)
      EXPECT_EQ(std::memcmp(mem[i].data(), want[i].data(), want[i].size()), 0) << "tensor " << i << " " << how;
  }
  uint64_t device_bytes() const {
    uint64_t n = 0;
    for (size_t i = 0; i < want.size(); ++i) n += on_device[i] ? want[i].size() : 0;
    return n;
  }
};

// A cuFile stand-in: reads with pread on its own (buffered) descriptor of the
// registered file into the "device memory" of the simulated GPU.
class FakeCufile final : public mem::cufile::Driver {
 public:
  explicit FakeCufile(test::SimDriver& sim) : sim_(sim) {}
  mem::cufile::Handle handle_register(int fd) override {
    int own = ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY);
    EBB_CHECK(own >= 0, "fake cuFile: cannot reopen fd ", fd);
    std::lock_guard lock(mu_);
    ++registered_;
    return static_cast<mem::cufile::Handle>(own) + 1;
  }
  void handle_deregister(mem::cufile::Handle h) override {
    ::close(static_cast<int>(h - 1));
    std::lock_guard lock(mu_);
    ++deregistered_;
  }
  void buf_register(const void*, size_t) override {}
  void buf_deregister(const void*) override {}
  size_t read(mem::cufile::Handle h, void* dev, size_t n, int64_t offset, int64_t dev_offset) override {
    {
      std::lock_guard lock(mu_);
      ++attempts_;
      if (fail_after_reads >= 0 && reads_ >= fail_after_reads) throw IoError(EIO, "fake cuFile", offset, "refused");
      ++reads_;
      bytes_ += n;
      earliest_ = std::min(earliest_, sim_.host_time());
    }
    ssize_t got = ::pread(static_cast<int>(h - 1), static_cast<char*>(dev) + dev_offset, n, offset);
    EBB_CHECK(got == static_cast<ssize_t>(n), "fake cuFile: short read");
    return n;
  }
  size_t write(mem::cufile::Handle, const void*, size_t, int64_t, int64_t) override {
    throw IoError(EIO, "fake cuFile", 0, "no writes here");
  }
  int fail_after_reads = -1;  // throw from this read on
  uint64_t bytes() {
    std::lock_guard lock(mu_);
    return bytes_;
  }
  int registered() {
    std::lock_guard lock(mu_);
    return registered_ - deregistered_;
  }
  int attempts() {
    std::lock_guard lock(mu_);
    return attempts_;
  }
  double earliest_read() {  // the simulated host clock at the first read
    std::lock_guard lock(mu_);
    return earliest_;
  }

 private:
  test::SimDriver& sim_;
  std::mutex mu_;
  int reads_ = 0, attempts_ = 0, registered_ = 0, deregistered_ = 0;
  uint64_t bytes_ = 0;
  double earliest_ = 1e300;
};

size_t htod_copies(test::SimDriver& sim) {
  size_t n = 0;
  for (const auto& c : sim.copies()) n += c.d2h ? 0 : 1;
  return n;
}

TEST(Safetensors, SaveFromDeviceMemory) {
  TempDir dir;
  test::SimDriver sim(1e9, 1e9);
  const std::vector<uint64_t> sizes = {(5u << 20) + 3, 5, 4097};
  std::vector<std::vector<unsigned char>> bytes;
  std::vector<SaveTensor> src;
  for (size_t i = 0; i < sizes.size(); ++i) bytes.push_back(test::random_bytes(sizes[i], 90 + i));
  for (size_t i = 0; i < sizes.size(); ++i) {
    mem::Buffer b = test::host_buffer(bytes[i]);
    if (i != 1) {  // the second stays on the host
      b.device = 0;
      b.stream = 5;
    }
    src.push_back({"s" + std::to_string(i), "U8", {sizes[i]}, b});
  }
  IoOptions o;
  o.cuda_driver = &sim;
  const std::string path = dir.path() + "/s.safetensors";
  save(path, src, {}, o);
  uint64_t copied = 0;
  for (const auto& x : sim.copies()) {
    EXPECT_TRUE(x.d2h);
    EXPECT_EQ(x.stream, 5u) << "copies go on the tensor's stream";
    copied += x.n;
  }
  EXPECT_EQ(copied, sizes[0] + sizes[2]);
  EXPECT_EQ(sim.registers(), 0) << "staging is not page-locked with a driver given by the caller";
  Reader r(path, buffered());
  for (size_t i = 0; i < r.header().tensors.size(); ++i) {
    const auto& t = r.header().tensors[i];
    std::vector<char> got(t.end - t.begin);
    r.read({{i, {got.data(), got.size()}}});
    const auto& want = bytes[std::stoul(t.name.substr(1))];
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0) << t.name;
  }
}

TEST(Safetensors, DeviceTargetsThroughPinnedStaging) {
  DeviceReadCase c;
  test::SimDriver sim(1e9, 1e9);
  for (bool direct : {true, false}) {
    IoOptions o;
    o.direct = direct;
    o.cuda_driver = &sim;
    o.try_cufile = false;
    Reader r(c.path, o);
    std::string how = r.read(c.targets(7));
    c.expect_read(how);
    EXPECT_EQ(how.find("cuFile"), std::string::npos) << how;
  }
  uint64_t copied = 0;
  for (const auto& x : sim.copies()) {
    EXPECT_FALSE(x.d2h);
    EXPECT_EQ(x.stream, 7u) << "copies go on the target's stream";
    copied += x.n;
  }
  EXPECT_EQ(copied, 2 * c.device_bytes());
  EXPECT_EQ(sim.registers(), 0) << "staging is not page-locked with a driver given by the caller";
}

TEST(Safetensors, DeviceTargetsThroughCufile) {
  DeviceReadCase c;
  test::SimDriver sim(1e9, 1e9);
  FakeCufile cf(sim);
  IoOptions o;
  o.cuda_driver = &sim;
  o.cufile_driver = &cf;
  Reader r(c.path, o);
  ASSERT_TRUE(r.direct()) << "the test directory takes O_DIRECT";
  const double busy_until = sim.launch(7, 5.0) + 5.0;  // a kernel still using the stream's memory
  std::string how = r.read(c.targets(7));
  c.expect_read(how);
  EXPECT_NE(how.find("cuFile"), std::string::npos) << how;
  EXPECT_EQ(cf.bytes(), c.device_bytes()) << "every device byte came by cuFile";
  EXPECT_EQ(htod_copies(sim), 0u) << "no staging copies for device targets";
  EXPECT_GE(cf.earliest_read(), busy_until) << "cuFile is not stream-ordered: the stream is synchronized first";
  EXPECT_EQ(cf.registered(), 0) << "the file handle is deregistered";

  // A buffered reader cannot use cuFile: device targets are staged.
  IoOptions b = o;
  b.direct = false;
  Reader rb(c.path, b);
  how = rb.read(c.targets(7));
  c.expect_read(how);
  EXPECT_EQ(cf.bytes(), c.device_bytes());
  EXPECT_GT(htod_copies(sim), 0u);
}

// Note [Reads into device memory]: torch's default stream is handle 0 on
// every device, a different stream on each. Targets on two GPUs, both on
// stream 0, and a kernel still running on device 1's default stream: cuFile
// may write into device 1's memory only after it, so each device's default
// stream is waited for, in its own context (device 0's target comes first,
// so waits keyed by the handle alone would skip device 1's).
TEST(Safetensors, CufileWaitsForTheDefaultStreamOfEveryDevice) {
  TempDir dir;
  const auto a = test::random_bytes((5u << 20) + 3, 170), b = test::random_bytes(70001, 171);
  const std::string path = dir.path() + "/two.safetensors";
  save(path, {{"a", "U8", {a.size()}, test::host_buffer(a)}, {"b", "U8", {b.size()}, test::host_buffer(b)}}, {});
  test::SimDriver sim(test::SimDriver::Options{.devices = 2});
  FakeCufile cf(sim);
  IoOptions o;
  o.cuda_driver = &sim;
  o.cufile_driver = &cf;
  Reader r(path, o);
  ASSERT_TRUE(r.direct()) << "the test directory takes O_DIRECT";
  const size_t ia = r.header().tensors[0].name == "a" ? 0 : 1;
  const auto on0 = sim.alloc(a.size(), 0, "a on device 0", 0), on1 = sim.alloc(b.size(), 0, "b on device 1", 1);
  sim.launch(0, 0.5, {}, 0);
  const double busy_until = sim.launch(0, 5.0, {}, 1) + 5.0;  // still using device 1's memory
  std::string how = r.read({{ia, {sim.bytes(on0), a.size(), 0, 0}}, {1 - ia, {sim.bytes(on1), b.size(), 1, 0}}});
  EXPECT_NE(how.find("cuFile"), std::string::npos) << how;
  EXPECT_GE(cf.earliest_read(), busy_until)
      << "cuFile wrote into device 1's memory before its default stream's kernel ended";
  sim.synchronize_all();
  EXPECT_EQ(std::memcmp(sim.bytes(on0), a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(sim.bytes(on1), b.data(), b.size()), 0);
  EXPECT_EQ(sim.current_context(), 0u) << "the caller's (no) context is restored";
  EXPECT_TRUE(sim.errors().empty()) << test::SimDriver::join_lines(sim.errors());
}

TEST(Safetensors, CufileFailureFallsBackToStaging) {
  DeviceReadCase c;
  test::SimDriver sim(1e9, 1e9);
  FakeCufile cf(sim);
  cf.fail_after_reads = 1;  // the first piece lands, the second fails
  IoOptions o;
  o.cuda_driver = &sim;
  o.cufile_driver = &cf;
  Reader r(c.path, o);
  int attempts = 0;
  for (int call = 0; call < 2; ++call) {
    std::string how = r.read(c.targets(3));
    c.expect_read(how + " call " + std::to_string(call));
    EXPECT_EQ(how.find("cuFile"), std::string::npos) << how;
    if (call == 0) attempts = cf.attempts();
  }
  EXPECT_GE(attempts, 2);
  EXPECT_EQ(cf.attempts(), attempts) << "cuFile is not tried again by this reader";
  EXPECT_EQ(cf.registered(), 0);
  EXPECT_GT(htod_copies(sim), 0u);
}

}  // namespace
}  // namespace ebbtide::ckpt::safetensors
