// Lossless chunk codecs of the checkpoint format. Stateless and thread safe;
// callers run one chunk per thread (each thread keeps its own zstd context).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ebbtide/ckpt/format.hpp"

namespace ebbtide::ckpt {

// True when this build can compress and decompress (libzstd was found).
bool have_zstd();
// Upper bound of stored bytes for a raw chunk of `raw_bytes`.
size_t compress_bound(size_t raw_bytes);

// Compresses `n` raw bytes of elements of `elem_bytes` into dst (capacity
// `cap` >= compress_bound(n)); `scratch` holds >= n bytes. Returns the stored
// size, or 0 when compression would not save space (store the chunk raw).
// Unsupported when the codec needs zstd and the build has none.
size_t compress_chunk(Codec codec, uint16_t elem_bytes, int level, const void* src, size_t n,
                      void* dst, size_t cap, void* scratch);

// Inverse of compress_chunk: writes exactly `raw_bytes` into dst; `scratch`
// holds >= raw_bytes. Throws InvalidArgument (naming `what`) on corrupt input.
void decompress_chunk(Codec codec, uint16_t elem_bytes, const void* src, size_t stored, void* dst,
                      size_t raw_bytes, void* scratch, const char* what);

// Byte grouping transforms (exposed for tests): planes[j*count + i] = byte j
// of element i; with `rotate_sign` each element is first rotated left by one
// bit so the IEEE sign lands in the lowest bit and the exponent in the top byte.
void group_bytes(const void* src, void* dst, size_t n, uint16_t elem_bytes, bool rotate_sign);
void ungroup_bytes(const void* src, void* dst, size_t n, uint16_t elem_bytes, bool rotate_sign);

}  // namespace ebbtide::ckpt
