// Where a blob of a shard lies across the shard file and its stripe files.
#pragma once

#include <cstdint>
#include <vector>

#include "ebbtide/ckpt/format.hpp"

namespace ebbtide::ckpt {

struct BlobExtent {
  uint64_t stored_bytes = 0;     // its chunks' bytes in the files (after compression)
  uint64_t first_offset = 0;     // file offset of its first chunk (0: no chunks)
  uint16_t first_stripe = 0;     // file of its first chunk (0: the shard file)
  std::vector<uint16_t> stripes; // files holding its chunks, each once, in chunk order
};

// `blob` must be one of `header.blobs` with its chunks inside `header.chunks`
// (decode_header guarantees it).
BlobExtent blob_extent(const Header& header, const BlobEntry& blob);

}  // namespace ebbtide::ckpt
