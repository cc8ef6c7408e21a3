// mem::stream_copy gives memcpy's result for every size around its threshold
// and every alignment of source and destination.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "ebbtide/mem/stream_copy.hpp"
#include "test_utils.hpp"

namespace ebbtide::mem {
namespace {

TEST(StreamCopy, SameBytesAsMemcpy) {
  const size_t kMax = (1u << 20) + 200;
  const auto src = test::random_bytes(kMax + 64, 11);
  std::vector<unsigned char> got(kMax + 128), want(kMax + 128);
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{(256u << 10) - 1}, size_t{256u << 10},
                   size_t{(256u << 10) + 1}, size_t{(256u << 10) + 77}, size_t{1u << 20}, kMax}) {
    for (size_t da : {0, 1, 8, 15}) {
      for (size_t sa : {0, 3}) {
        std::memset(got.data(), 0xA5, got.size());
        std::memset(want.data(), 0xA5, want.size());
        stream_copy(got.data() + 16 + da, src.data() + sa, n);
        std::memcpy(want.data() + 16 + da, src.data() + sa, n);
        ASSERT_EQ(got, want) << "n=" << n << " dst+" << da << " src+" << sa << ": bytes outside the range stay too";
      }
    }
  }
}

}  // namespace
}  // namespace ebbtide::mem
