#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "ebbtide/util/config.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/detail/crc32c_testing.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
#include "test_utils.hpp"

namespace ebbtide {
namespace {

TEST(Config, ParseBytesUnits) {
  EXPECT_EQ(config::parse_bytes("4096", "x"), 4096u);
  EXPECT_EQ(config::parse_bytes("1MiB", "x"), 1u << 20);
  EXPECT_EQ(config::parse_bytes("4GiB", "x"), 4ull << 30);
  EXPECT_EQ(config::parse_bytes("512k", "x"), 512u << 10);
  EXPECT_EQ(config::parse_bytes(" 2 MB ", "x"), 2u << 20);
  EXPECT_EQ(config::parse_bytes("1.5K", "x"), 1536u);
}

TEST(Config, ParseBytesRejectsGarbageNamingTheSetting) {
  try {
    config::parse_bytes("12 parsecs", "--size");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--size"), std::string::npos);
  }
  EXPECT_THROW(config::parse_bytes("", "x"), InvalidArgument);
  EXPECT_THROW(config::parse_bytes("-5", "x"), InvalidArgument);
  EXPECT_THROW(config::parse_bytes("0.3", "x"), InvalidArgument);
}

TEST(Config, EnvValuesAreValidatedNamingTheVariable) {
  test::ScopedEnv env("EBBTIDE_CACHE_WORKERS", "abc");
  try {
    config::env_int("EBBTIDE_CACHE_WORKERS");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("EBBTIDE_CACHE_WORKERS='abc'"), std::string::npos) << e.what();
  }
  test::ScopedEnv env2("EBBTIDE_CACHE_WORKERS", "7");
  EXPECT_EQ(config::env_int("EBBTIDE_CACHE_WORKERS").value(), 7);
  test::ScopedEnv env3("EBBTIDE_CACHE_WORKERS", "65");  // the table's range is 1-64
  EXPECT_THROW(config::env_int("EBBTIDE_CACHE_WORKERS"), InvalidArgument);
  test::ScopedEnv env4("EBBTIDE_CACHE_WORKERS", "");
  EXPECT_FALSE(config::env_int("EBBTIDE_CACHE_WORKERS").has_value());
  test::ScopedEnv env5("EBBTIDE_MAX_WRITE_MBPS", "-1");
  EXPECT_THROW(config::env_float("EBBTIDE_MAX_WRITE_MBPS"), InvalidArgument);
  test::ScopedEnv env6("EBBTIDE_IO_BACKEND", " IO_URING ");
  EXPECT_EQ(config::env_choice("EBBTIDE_IO_BACKEND").value(), "io_uring");
  test::ScopedEnv env7("EBBTIDE_IO_DIRECT", "maybe");
  EXPECT_THROW(config::env_bool("EBBTIDE_IO_DIRECT"), InvalidArgument);
}

TEST(Config, OnlyTableRowsCanBeRead) {
  // A name outside the table, or read as another kind, is a programming error.
  EXPECT_THROW(config::env_string("EBBTIDE_NOT_A_SETTING"), std::logic_error);
  EXPECT_THROW(config::env_bytes("EBBTIDE_CACHE_WORKERS"), std::logic_error);
  std::set<std::string_view> names;
  for (const auto& s : config::settings()) {
    EXPECT_TRUE(s.name.starts_with("EBBTIDE_")) << s.name;
    EXPECT_TRUE(names.insert(s.name).second) << "twice: " << s.name;
    EXPECT_FALSE(s.meaning.empty()) << s.name;
    EXPECT_FALSE(s.default_text.empty()) << s.name;
    if (s.kind == config::Kind::kChoice) EXPECT_FALSE(s.choices.empty()) << s.name;
    if (s.kind == config::Kind::kInt || s.kind == config::Kind::kFloat) EXPECT_LT(s.min, s.max) << s.name;
  }
}

TEST(Config, ArgumentsAreCheckedAgainstTheSameRow) {
  using V = config::Value;
  const char* what = "ebbtide.TensorCache: workers";
  EXPECT_EQ(std::get<int64_t>(config::check_argument("EBBTIDE_CACHE_WORKERS", V(int64_t{4}), what)), 4);
  try {
    config::check_argument("EBBTIDE_CACHE_WORKERS", V(int64_t{0}), what);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("ebbtide.TensorCache: workers=0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(config::check_argument("EBBTIDE_CACHE_WORKERS", V(true), what), InvalidArgument);
  EXPECT_THROW(config::check_argument("EBBTIDE_MIN_BYTES", V(int64_t{-1}), "min_bytes"), InvalidArgument);
  EXPECT_EQ(std::get<int64_t>(config::check_argument("EBBTIDE_MIN_BYTES", V(std::string("1KiB")), "m")), 1024);
  EXPECT_EQ(std::get<double>(config::check_argument("EBBTIDE_MAX_WRITE_MBPS", V(int64_t{300}), "m")), 300.0);
  EXPECT_THROW(config::check_argument("EBBTIDE_MAX_WRITE_MBPS", V(-1.0), "m"), InvalidArgument);
  EXPECT_THROW(config::check_argument("EBBTIDE_IO_BACKEND", V(std::string("spdk")), "backend"), InvalidArgument);
}

TEST(Log, LevelsAreTheChoicesOfTheSettingsRow) {
  using ebbtide::log::Level;
  using ebbtide::log::parse_level;
  EXPECT_EQ(parse_level("error", "t"), Level::kError);
  EXPECT_EQ(parse_level("warn", "t"), Level::kWarn);
  EXPECT_EQ(parse_level("warning", "t"), Level::kWarn);
  EXPECT_EQ(parse_level("info", "t"), Level::kInfo);
  EXPECT_EQ(parse_level("debug", "t"), Level::kDebug);
  try {
    parse_level("loud", "ebbtide.set_log_level");
    FAIL() << "an unknown level was accepted";
  } catch (const ebbtide::InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ebbtide.set_log_level"), std::string::npos) << what;
    EXPECT_NE(what.find("loud"), std::string::npos) << what;
    EXPECT_NE(what.find("debug"), std::string::npos) << what;  // the valid choices are listed
  }
}

TEST(Crc32c, KnownVectors) {
  // RFC 3720 test vectors.
  std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  std::string ones(32, '\xff');
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
}

TEST(Crc32c, IncrementalEqualsWhole) {
  std::string s;
  for (int i = 0; i < 1000; ++i) s.push_back(static_cast<char>(i * 7));
  uint32_t whole = crc32c(s.data(), s.size());
  uint32_t part = crc32c(s.data() + 333, s.size() - 333, crc32c(s.data(), 333));
  EXPECT_EQ(whole, part);
}

std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// Lengths where the interleaved path changes tier (Note [Interleaved crc32c]):
// 3 x 256 B blocks, 3 x 8 KiB blocks, and mixes of both with a tail.
const std::vector<size_t> kBlockEdgeLengths = {
    767,          768,   769,   1535,  1536,  1543,  8191,  8192,  8193,  24575,
    24576,        24577, 24583, 25343, 25344, 25345, 49151, 49152, 49153, 3 * 8192 * 5 + 17,
    (1 << 20) + 3};

TEST(Crc32c, SoftwarePathKnownVectors) {
  // The reference the hardware path is checked against must itself be right.
  std::string zeros(32, '\0');
  EXPECT_EQ(detail::crc32c_software(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(detail::crc32c_software("123456789", 9), 0xE3069283u);
}

TEST(Crc32c, HardwareMatchesSoftwareAtEveryShortLength) {
  if (!crc32c_hardware()) GTEST_SKIP() << "no SSE4.2";
  std::string s = random_bytes(1100, 1);
  for (size_t n = 0; n <= s.size(); ++n)
    ASSERT_EQ(detail::crc32c_hw(s.data(), n), detail::crc32c_software(s.data(), n)) << "n=" << n;
}

TEST(Crc32c, HardwareMatchesSoftwareAroundBlockSizesUnalignedWithSeed) {
  if (!crc32c_hardware()) GTEST_SKIP() << "no SSE4.2";
  std::string s = random_bytes((1 << 20) + 3 + 15, 2);
  for (size_t n : kBlockEdgeLengths)
    for (size_t offset = 0; offset < 16; ++offset)
      for (uint32_t seed : {0u, 0xE3069283u}) {
        const char* p = s.data() + offset;
        ASSERT_EQ(detail::crc32c_hw(p, n, seed), detail::crc32c_software(p, n, seed))
            << "n=" << n << " offset=" << offset << " seed=" << seed;
      }
}

TEST(Crc32c, ChainedCallsEqualOneCallAcrossBlocks) {
  std::string s = random_bytes(3 * 8192 * 5 + 17, 3);
  const uint32_t whole = crc32c(s.data(), s.size());
  EXPECT_EQ(whole, detail::crc32c_software(s.data(), s.size()));
  for (size_t split : {size_t{1}, size_t{767}, size_t{768}, size_t{8193}, size_t{24576},
                       size_t{24577}, s.size() - 769, s.size() - 1}) {
    const uint32_t a = crc32c(s.data(), split);
    EXPECT_EQ(crc32c(s.data() + split, s.size() - split, a), whole) << "split=" << split;
  }
}

TEST(Errors, IoErrorNamesPathOffsetAndErrno) {
  IoError e(28, "/nvme/slab", 4096, "pwrite failed");
  std::string w = e.what();
  EXPECT_NE(w.find("/nvme/slab"), std::string::npos);
  EXPECT_NE(w.find("4096"), std::string::npos);
  EXPECT_NE(w.find("No space left on device"), std::string::npos);
  EXPECT_EQ(e.err(), 28);
}

}  // namespace
}  // namespace ebbtide
