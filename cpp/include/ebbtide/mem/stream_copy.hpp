// A memcpy for large copies whose destination the copying thread will not
// read again soon: a checkpoint's staging buffers, tensors being loaded.
#pragma once

#include <cstddef>

namespace ebbtide::mem {

// Same result as memcpy(dst, src, n) (the ranges must not overlap). From
// 256 KiB on x86-64 it writes with streaming (non-temporal) stores, which
// skip the read-for-ownership of each destination line and leave the
// caller's cache alone (Note [Streaming copies] in stream_copy.cpp).
void stream_copy(void* dst, const void* src, size_t n);

}  // namespace ebbtide::mem
