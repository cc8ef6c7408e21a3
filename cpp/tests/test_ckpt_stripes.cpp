// blob_extent: stored bytes, first chunk and the set of stripes of a blob.
#include <gtest/gtest.h>

#include <vector>

#include "ebbtide/ckpt/stripes.hpp"

namespace ebbtide::ckpt {
namespace {

ChunkEntry chunk(uint64_t offset, uint32_t stored, uint16_t stripe) {
  ChunkEntry c;
  c.file_offset = offset;
  c.stored_bytes = stored;
  c.stripe = stripe;
  return c;
}

void expect_extent(const BlobExtent& e, uint64_t stored, uint64_t offset, uint16_t stripe,
                   const std::vector<uint16_t>& stripes) {
  EXPECT_EQ(e.stored_bytes, stored);
  EXPECT_EQ(e.first_offset, offset);
  EXPECT_EQ(e.first_stripe, stripe);
  EXPECT_EQ(e.stripes, stripes);
}

TEST(BlobExtent, StripesOnceEachInChunkOrder) {
  Header h;
  h.chunks = {chunk(4096, 10, 0), chunk(8192, 100, 2), chunk(4096, 200, 1), chunk(12288, 300, 2),
              chunk(16384, 400, 0)};
  BlobEntry b;
  b.first_chunk = 1;
  b.chunk_count = 4;
  h.blobs = {b};
  expect_extent(blob_extent(h, b), 1000, 8192, 2, {2, 1, 0});
}

TEST(BlobExtent, EmptyBlobHasNoStripes) {
  Header h;
  h.chunks = {chunk(4096, 10, 1)};
  BlobEntry b;
  b.first_chunk = 1;
  h.blobs = {b};
  expect_extent(blob_extent(h, b), 0, 0, 0, {});
}

}  // namespace
}  // namespace ebbtide::ckpt
