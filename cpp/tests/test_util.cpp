#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "ebbtide/util/config.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"
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
  test::ScopedEnv env("EBBTIDE_TEST_INT", "abc");
  try {
    config::env_int("EBBTIDE_TEST_INT", 0, 10);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("EBBTIDE_TEST_INT"), std::string::npos);
  }
  test::ScopedEnv env2("EBBTIDE_TEST_INT", "7");
  EXPECT_EQ(config::env_int("EBBTIDE_TEST_INT", 0, 10).value(), 7);
  test::ScopedEnv env3("EBBTIDE_TEST_INT", "11");
  EXPECT_THROW(config::env_int("EBBTIDE_TEST_INT", 0, 10), InvalidArgument);
  EXPECT_FALSE(config::env_int("EBBTIDE_TEST_UNSET_VARIABLE", 0, 10).has_value());
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
