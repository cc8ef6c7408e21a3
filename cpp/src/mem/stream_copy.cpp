#include "ebbtide/mem/stream_copy.hpp"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ebbtide::mem {

// Note [Streaming copies]
// A plain store to a line not in the cache first reads it (read for
// ownership), so a copy of n bytes moves 3n over the memory bus; streaming
// stores move 2n. Where the bus is the limit, as in a checkpoint's staging
// copy or a load copying out of staging while the disk writes into staging
// by DMA, that is the difference: a 1 GB safetensors load into existing
// tensors, copies from staging alternating with and without, took 6-9% less
// (medians 0.414-0.464 s -> 0.387-0.432 s in 6 runs on the 2-core VM;
// docs/benchmarks-journal.md, session 13). Only for destinations read again later,
// if at all: a copy into scratch that is read at once belongs in the cache.
// The head up to a 16-byte boundary and the tail are memcpy'd; the sfence
// orders the streamed lines before whatever the caller does next (another
// thread reading them, a write of the buffer to disk).
void stream_copy(void* dst_v, const void* src_v, size_t n) {
  auto* dst = static_cast<char*>(dst_v);
  const auto* src = static_cast<const char*>(src_v);
#if defined(__x86_64__)
  if (n >= (256u << 10)) {
    const size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace ebbtide::mem
