#include "ebbtide/ckpt/stripes.hpp"

#include <algorithm>

namespace ebbtide::ckpt {

BlobExtent blob_extent(const Header& header, const BlobEntry& blob) {
  BlobExtent e;
  for (uint32_t k = 0; k < blob.chunk_count; ++k) {
    const ChunkEntry& c = header.chunks[blob.first_chunk + k];
    if (k == 0) {
      e.first_offset = c.file_offset;
      e.first_stripe = c.stripe;
    }
    e.stored_bytes += c.stored_bytes;
    if (std::find(e.stripes.begin(), e.stripes.end(), c.stripe) == e.stripes.end()) e.stripes.push_back(c.stripe);
  }
  return e;
}

}  // namespace ebbtide::ckpt
