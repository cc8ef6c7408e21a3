// Note [Byte grouping]
// Floating-point weights look random byte by byte, but their exponents are
// not: trained weights occupy a few binades, so the exponent bits have 2-4
// bits of entropy while the mantissa bits are close to 8 per byte. zstd sees
// this only when equal-significance bytes sit together, so a chunk of
// elements is split into planes (all byte-0s, then all byte-1s, ...). For
// IEEE floats we first rotate each element left by one bit: the sign moves to
// the lowest bit and the whole exponent of bf16/fp32 fills the top byte (fp16
// keeps 3 mantissa bits there), so the exponent plane compresses well and the
// mantissa planes are stored by zstd as raw blocks. Bytes of a trailing
// partial element are stored after the planes unchanged.
#include "ebbtide/ckpt/codec.hpp"

#include <cstring>

#include "ebbtide/util/error.hpp"

#ifdef EBBTIDE_HAVE_ZSTD
#include <zstd.h>
#endif

namespace ebbtide::ckpt {
namespace {

template <typename U>
U rotl1(U v) { return static_cast<U>((v << 1) | (v >> (sizeof(U) * 8 - 1))); }
template <typename U>
U rotr1(U v) { return static_cast<U>((v >> 1) | (v << (sizeof(U) * 8 - 1))); }

template <typename U>
void group_typed(const unsigned char* s, unsigned char* d, size_t count, bool rot) {
  constexpr size_t E = sizeof(U);
  for (size_t i = 0; i < count; ++i) {
    U v;
    std::memcpy(&v, s + i * E, E);
    if (rot) v = rotl1(v);
    for (size_t j = 0; j < E; ++j) d[j * count + i] = static_cast<unsigned char>(v >> (8 * j));
  }
}
template <typename U>
void ungroup_typed(const unsigned char* s, unsigned char* d, size_t count, bool rot) {
  constexpr size_t E = sizeof(U);
  for (size_t i = 0; i < count; ++i) {
    U v = 0;
    for (size_t j = 0; j < E; ++j) v = static_cast<U>(v | (static_cast<U>(s[j * count + i]) << (8 * j)));
    if (rot) v = rotr1(v);
    std::memcpy(d + i * E, &v, E);
  }
}

void generic_group(const unsigned char* s, unsigned char* d, size_t count, size_t E, bool inverse) {
  for (size_t i = 0; i < count; ++i)
    for (size_t j = 0; j < E; ++j) {
      if (inverse) d[i * E + j] = s[j * count + i];
      else d[j * count + i] = s[i * E + j];
    }
}

#ifdef EBBTIDE_HAVE_ZSTD
struct ZstdContexts {
  ZSTD_CCtx* c = nullptr;
  ZSTD_DCtx* d = nullptr;
  ~ZstdContexts() {
    ZSTD_freeCCtx(c);
    ZSTD_freeDCtx(d);
  }
};
ZstdContexts& contexts() {
  thread_local ZstdContexts ctx;
  return ctx;
}
#endif

}  // namespace

void group_bytes(const void* src, void* dst, size_t n, uint16_t E, bool rot) {
  auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  size_t count = E ? n / E : 0;
  switch (E) {
    case 2: group_typed<uint16_t>(s, d, count, rot); break;
    case 4: group_typed<uint32_t>(s, d, count, rot); break;
    case 8: group_typed<uint64_t>(s, d, count, rot); break;
    default: generic_group(s, d, count, E, false); break;
  }
  std::memcpy(d + count * E, s + count * E, n - count * E);
}

void ungroup_bytes(const void* src, void* dst, size_t n, uint16_t E, bool rot) {
  auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  size_t count = E ? n / E : 0;
  switch (E) {
    case 2: ungroup_typed<uint16_t>(s, d, count, rot); break;
    case 4: ungroup_typed<uint32_t>(s, d, count, rot); break;
    case 8: ungroup_typed<uint64_t>(s, d, count, rot); break;
    default: generic_group(s, d, count, E, true); break;
  }
  std::memcpy(d + count * E, s + count * E, n - count * E);
}

bool have_zstd() {
#ifdef EBBTIDE_HAVE_ZSTD
  return true;
#else
  return false;
#endif
}

size_t compress_bound(size_t n) {
#ifdef EBBTIDE_HAVE_ZSTD
  return ZSTD_compressBound(n);
#else
  return n;
#endif
}

size_t compress_chunk(Codec codec, uint16_t E, int level, const void* src, size_t n, void* dst,
                      size_t cap, void* scratch) {
  if (codec == Codec::kNone || n == 0) return 0;
#ifdef EBBTIDE_HAVE_ZSTD
  const void* in = src;
  bool planes = (codec == Codec::kShuffleZstd || codec == Codec::kFloatZstd) && E > 1;
  if (planes) {
    group_bytes(src, scratch, n, E, codec == Codec::kFloatZstd);
    in = scratch;
  }
  auto& ctx = contexts();
  if (ctx.c == nullptr) ctx.c = ZSTD_createCCtx();
  EBB_ASSERT(ctx.c != nullptr, "ZSTD_createCCtx failed");
  size_t r = ZSTD_compressCCtx(ctx.c, dst, cap, in, n, level);
  if (ZSTD_isError(r)) throw Error(detail::concat("zstd compression failed: ", ZSTD_getErrorName(r)));
  return r < n ? r : 0;
#else
  (void)E, (void)level, (void)src, (void)dst, (void)cap, (void)scratch;
  throw Unsupported(detail::concat("codec ", to_string(codec), " needs zstd, and this build has no libzstd"));
#endif
}

void decompress_chunk(Codec codec, uint16_t E, const void* src, size_t stored, void* dst, size_t raw,
                      void* scratch, const char* what) {
  if (codec == Codec::kNone) {
    EBB_CHECK(stored == raw, what, ": raw chunk of ", stored, " bytes, expected ", raw);
    std::memcpy(dst, src, raw);
    return;
  }
#ifdef EBBTIDE_HAVE_ZSTD
  bool planes = (codec == Codec::kShuffleZstd || codec == Codec::kFloatZstd) && E > 1;
  auto& ctx = contexts();
  if (ctx.d == nullptr) ctx.d = ZSTD_createDCtx();
  EBB_ASSERT(ctx.d != nullptr, "ZSTD_createDCtx failed");
  void* out = planes ? scratch : dst;
  size_t r = ZSTD_decompressDCtx(ctx.d, out, raw, src, stored);
  if (ZSTD_isError(r) || r != raw) {
    throw InvalidArgument(detail::concat(what, ": corrupt compressed chunk (",
                                         ZSTD_isError(r) ? ZSTD_getErrorName(r) : "wrong decompressed size",
                                         ")"));
  }
  if (planes) ungroup_bytes(scratch, dst, raw, E, codec == Codec::kFloatZstd);
#else
  (void)E, (void)src, (void)stored, (void)dst, (void)raw, (void)scratch;
  throw Unsupported(detail::concat(what, ": codec ", to_string(codec), " needs zstd, and this build has no libzstd"));
#endif
}

}  // namespace ebbtide::ckpt
