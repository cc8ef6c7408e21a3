// Encoding of the superblock and the binary header (docs/checkpoint-format.md).
#include "ebbtide/ckpt/format.hpp"

#include <cstring>

#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::ckpt {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the checkpoint format is little-endian");

constexpr char kHeaderMagic[8] = {'E', 'B', 'B', 'H', 'D', 'R', '0', '1'};
constexpr size_t kHeaderPrefixBytes = 32;

template <typename T>
void put(std::string& s, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  s.append(b, sizeof(T));
}
template <typename T>
void put_at(unsigned char* p, size_t off, T v) { std::memcpy(p + off, &v, sizeof(T)); }
template <typename T>
T get_at(const unsigned char* p, size_t off) {
  T v;
  std::memcpy(&v, p + off, sizeof(T));
  return v;
}

}  // namespace

bool valid_utf8(std::string_view s) {
  static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
  size_t i = 0;
  while (i < s.size()) {
    auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : 4;
    if (n == 4 || n >= s.size() - i) return false;  // a bad lead byte, or the sequence is cut off
    uint32_t cp = n == 0 ? c : c & (0x7Fu >> (n + 1));
    for (size_t k = 1; k <= n; ++k) {
      auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

std::string_view to_string(Codec c) {
  switch (c) {
    case Codec::kNone: return "none";
    case Codec::kZstd: return "zstd";
    case Codec::kShuffleZstd: return "shuffle-zstd";
    case Codec::kFloatZstd: return "float-zstd";
  }
  return "unknown";
}

Codec parse_codec(std::string_view t) {
  if (t == "none") return Codec::kNone;
  if (t == "zstd") return Codec::kZstd;
  if (t == "shuffle-zstd") return Codec::kShuffleZstd;
  if (t == "float-zstd") return Codec::kFloatZstd;
  throw InvalidArgument(ebbtide::detail::concat("codec '", t, "' is not valid (valid: none, zstd, shuffle-zstd, float-zstd)"));
}

void encode_superblock(const Superblock& sb, unsigned char out[kSuperBytes]) {
  std::memset(out, 0, kSuperBytes);
  std::memcpy(out, kSuperMagic, 16);
  put_at(out, 16, sb.format_version);
  put_at(out, 20, sb.flags);
  put_at(out, 24, sb.header_offset);
  put_at(out, 32, sb.header_bytes);
  put_at(out, 40, sb.file_bytes);
  put_at(out, 48, sb.header_crc);
  if (sb.format_version >= 2) {
    put_at(out, 52, sb.stripe_index);
    put_at(out, 54, sb.stripe_count);
  }
  put_at(out, 56, crc32c(out, 56));
}

Superblock decode_superblock(const unsigned char in[kSuperBytes], const std::string& path) {
  if (std::memcmp(in, kSuperMagic, 16) != 0) {
    bool zero = true;
    for (size_t i = 0; i < 16; ++i) zero = zero && in[i] == 0;
    throw InvalidArgument(ebbtide::detail::concat(path, ": not an ebbtide checkpoint shard (bad magic at offset 0",
                                         zero ? "; the superblock was never written: incomplete file" : "",
                                         ")"));
  }
  Superblock sb;
  sb.format_version = get_at<uint32_t>(in, 16);
  if (sb.format_version > kFormatVersion || sb.format_version == 0) {
    throw Unsupported(ebbtide::detail::concat(path, ": checkpoint format version ", sb.format_version,
                                     " is not supported by this ebbtide (it reads versions 1 to ",
                                     kFormatVersion, "); upgrade ebbtide to load it"));
  }
  uint32_t crc = crc32c(in, 56);
  sb.super_crc = get_at<uint32_t>(in, 56);
  if (crc != sb.super_crc) throw ChecksumError(path + " (superblock)", 0, sb.super_crc, crc);
  sb.flags = get_at<uint32_t>(in, 20);
  sb.header_offset = get_at<uint64_t>(in, 24);
  sb.header_bytes = get_at<uint64_t>(in, 32);
  sb.file_bytes = get_at<uint64_t>(in, 40);
  sb.header_crc = get_at<uint32_t>(in, 48);
  if (sb.format_version >= 2) {
    sb.stripe_index = get_at<uint16_t>(in, 52);
    sb.stripe_count = get_at<uint16_t>(in, 54);
    if (sb.stripe_count == 0 || sb.stripe_index >= sb.stripe_count)
      throw InvalidArgument(ebbtide::detail::concat(path, ": corrupt superblock (stripe ", sb.stripe_index, " of ",
                                           sb.stripe_count, ")"));
  }
  return sb;
}

std::string encode_header(const Header& h) {
  std::string names;
  for (const auto& b : h.blobs) names += b.name;
  std::string s;
  s.reserve(kHeaderPrefixBytes + h.blobs.size() * kBlobEntryBytes + h.chunks.size() * kChunkEntryBytes +
            names.size() + h.meta.size());
  s.append(kHeaderMagic, 8);
  put<uint32_t>(s, static_cast<uint32_t>(h.blobs.size()));
  put<uint32_t>(s, static_cast<uint32_t>(h.chunks.size()));
  put<uint64_t>(s, names.size());
  put<uint64_t>(s, h.meta.size());
  uint32_t name_off = 0;
  for (const auto& b : h.blobs) {
    put<uint64_t>(s, b.nbytes);
    put<uint32_t>(s, b.first_chunk);
    put<uint32_t>(s, b.chunk_count);
    put<uint32_t>(s, name_off);
    put<uint32_t>(s, static_cast<uint32_t>(b.name.size()));
    put<uint16_t>(s, static_cast<uint16_t>(b.codec));
    put<uint16_t>(s, b.elem_bytes);
    put<uint32_t>(s, 0);
    name_off += static_cast<uint32_t>(b.name.size());
  }
  for (const auto& c : h.chunks) {
    put<uint64_t>(s, c.file_offset);
    put<uint64_t>(s, c.raw_offset);
    put<uint32_t>(s, c.raw_bytes);
    put<uint32_t>(s, c.stored_bytes);
    put<uint32_t>(s, c.crc);
    put<uint32_t>(s, c.blob);
    put<uint16_t>(s, static_cast<uint16_t>(c.codec));
    put<uint16_t>(s, c.stripe);
    put<uint32_t>(s, 0);
  }
  s += names;
  s += h.meta;
  return s;
}

// Note [Hostile headers]
// A checkpoint may come from anyone, and a valid crc32c only says the bytes
// are the ones somebody wrote, not that ebbtide's writer wrote them. So the
// header is decoded as hostile input and accepted only when reading it back
// writes every byte of every blob exactly once and nothing outside it:
// - blob b's chunks are the run [first_chunk, first_chunk + chunk_count);
//   each of them names b, and their raw ranges tile [0, nbytes) in order
//   (the first starts at 0, each starts where the previous ended, the last
//   ends at nbytes), so a blob with bytes has chunks and none overlap;
// - the runs together hold every chunk once (they are disjoint because a
//   chunk names one blob, and their lengths add up to the chunk count);
// - 0 < raw_bytes <= kMaxChunkBytes and 0 < stored_bytes <= raw_bytes (the
//   writer stores a chunk compressed only when that is smaller), equal for
//   codec none; this bounds every staging and scratch buffer;
// - a chunk's file offset is aligned and past the superblock block;
// - names are in range and valid UTF-8.
// All sums are checked before they are formed (fits_within), so a value near
// 2^64 cannot wrap around a bound. ShardReader then checks each chunk's
// extent against the real size of the file holding it.
Header decode_header(std::string_view bytes, const std::string& path) {
  auto bad = [&](auto&&... what) {
    return InvalidArgument(ebbtide::detail::concat(path, ": corrupt checkpoint header (", what..., ")"));
  };
  if (bytes.size() < kHeaderPrefixBytes || std::memcmp(bytes.data(), kHeaderMagic, 8) != 0)
    throw bad("bad header magic");
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  uint64_t nb = get_at<uint32_t>(p, 8), nc = get_at<uint32_t>(p, 12);
  uint64_t names_bytes = get_at<uint64_t>(p, 16), meta_bytes = get_at<uint64_t>(p, 24);
  uint64_t need = kHeaderPrefixBytes + nb * kBlobEntryBytes + nc * kChunkEntryBytes;  // < 2^39: no overflow
  if (need > bytes.size() || names_bytes > bytes.size() - need || meta_bytes != bytes.size() - need - names_bytes)
    throw bad("table sizes do not match the header length");
  Header h;
  h.blobs.resize(nb);
  h.chunks.resize(nc);
  const unsigned char* names = p + need;
  size_t off = kHeaderPrefixBytes;
  uint64_t listed = 0;
  for (uint64_t i = 0; i < nb; ++i) {
    auto& b = h.blobs[i];
    b.nbytes = get_at<uint64_t>(p, off);
    b.first_chunk = get_at<uint32_t>(p, off + 8);
    b.chunk_count = get_at<uint32_t>(p, off + 12);
    uint64_t no = get_at<uint32_t>(p, off + 16), nl = get_at<uint32_t>(p, off + 20);
    auto codec = get_at<uint16_t>(p, off + 24);
    b.elem_bytes = get_at<uint16_t>(p, off + 26);
    if (!fits_within(no, nl, names_bytes)) throw bad("name of blob ", i, " out of range");
    b.name.assign(reinterpret_cast<const char*>(names + no), nl);
    if (!valid_utf8(b.name)) throw bad("name of blob ", i, " is not UTF-8");
    if (!fits_within(b.first_chunk, b.chunk_count, nc))
      throw bad("chunks ", b.first_chunk, "+", b.chunk_count, " of blob '", b.name, "' out of range (", nc, " chunks)");
    if (codec > static_cast<uint16_t>(Codec::kFloatZstd)) throw bad("unknown codec ", codec, " of blob '", b.name, "'");
    if (b.elem_bytes == 0) throw bad("element size 0 for blob '", b.name, "'");
    b.codec = static_cast<Codec>(codec);
    listed += b.chunk_count;
    off += kBlobEntryBytes;
  }
  if (listed != nc) throw bad("the blobs list ", listed, " chunks, the chunk table has ", nc);
  for (uint64_t i = 0; i < nc; ++i) {
    auto& c = h.chunks[i];
    c.file_offset = get_at<uint64_t>(p, off);
    c.raw_offset = get_at<uint64_t>(p, off + 8);
    c.raw_bytes = get_at<uint32_t>(p, off + 16);
    c.stored_bytes = get_at<uint32_t>(p, off + 20);
    c.crc = get_at<uint32_t>(p, off + 24);
    c.blob = get_at<uint32_t>(p, off + 28);
    auto codec = get_at<uint16_t>(p, off + 32);
    c.stripe = get_at<uint16_t>(p, off + 34);
    if (c.blob >= nb) throw bad("chunk ", i, " names blob ", c.blob, " of ", nb);
    if (codec > static_cast<uint16_t>(Codec::kFloatZstd)) throw bad("unknown codec ", codec, " of chunk ", i);
    c.codec = static_cast<Codec>(codec);
    if (c.file_offset % kBlockBytes != 0 || c.file_offset < kDataStart ||
        !fits_within(c.file_offset, align_up(c.stored_bytes, kBlockBytes), UINT64_MAX))
      throw bad("chunk ", i, " at file offset ", c.file_offset, " is unaligned, inside the superblock block or past the end of any file");
    if (c.raw_bytes == 0 || c.raw_bytes > kMaxChunkBytes || c.stored_bytes == 0 || c.stored_bytes > c.raw_bytes ||
        (c.codec == Codec::kNone && c.stored_bytes != c.raw_bytes))
      throw bad("chunk ", i, " has ", c.raw_bytes, " raw and ", c.stored_bytes, " stored bytes (codec ",
                to_string(c.codec), ")");
    off += kChunkEntryBytes;
  }
  for (uint64_t i = 0; i < nb; ++i) {
    const auto& b = h.blobs[i];
    uint64_t covered = 0;  // bytes [0, covered) of the blob have a chunk
    for (uint32_t k = 0; k < b.chunk_count; ++k) {
      const auto& c = h.chunks[uint64_t{b.first_chunk} + k];
      if (c.blob != i)
        throw bad("blob '", b.name, "' lists chunk ", uint64_t{b.first_chunk} + k, ", which belongs to blob ", c.blob);
      if (c.raw_offset != covered || !fits_within(c.raw_offset, c.raw_bytes, b.nbytes))
        throw bad("chunk ", uint64_t{b.first_chunk} + k, " of blob '", b.name, "' covers bytes at ", c.raw_offset,
                  "+", c.raw_bytes, "; the blob has ", b.nbytes, " bytes and the chunk should start at ", covered);
      covered += c.raw_bytes;
    }
    if (covered != b.nbytes)
      throw bad("the chunks of blob '", b.name, "' cover ", covered, " of its ", b.nbytes, " bytes");
  }
  h.meta.assign(reinterpret_cast<const char*>(names + names_bytes), meta_bytes);
  return h;
}

}  // namespace ebbtide::ckpt
