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
  throw InvalidArgument(detail::concat("codec '", t, "' is not valid (valid: none, zstd, shuffle-zstd, float-zstd)"));
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
    throw InvalidArgument(detail::concat(path, ": not an ebbtide checkpoint shard (bad magic at offset 0",
                                         zero ? "; the superblock was never written: incomplete file" : "",
                                         ")"));
  }
  Superblock sb;
  sb.format_version = get_at<uint32_t>(in, 16);
  if (sb.format_version > kFormatVersion || sb.format_version == 0) {
    throw Unsupported(detail::concat(path, ": checkpoint format version ", sb.format_version,
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
      throw InvalidArgument(detail::concat(path, ": corrupt superblock (stripe ", sb.stripe_index, " of ",
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

Header decode_header(std::string_view bytes, const std::string& path) {
  auto bad = [&](const char* what) {
    return InvalidArgument(detail::concat(path, ": corrupt checkpoint header (", what, ")"));
  };
  if (bytes.size() < kHeaderPrefixBytes || std::memcmp(bytes.data(), kHeaderMagic, 8) != 0)
    throw bad("bad header magic");
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  uint64_t nb = get_at<uint32_t>(p, 8), nc = get_at<uint32_t>(p, 12);
  uint64_t names_bytes = get_at<uint64_t>(p, 16), meta_bytes = get_at<uint64_t>(p, 24);
  uint64_t need = kHeaderPrefixBytes + nb * kBlobEntryBytes + nc * kChunkEntryBytes;
  if (names_bytes > bytes.size() || meta_bytes > bytes.size() || need + names_bytes + meta_bytes != bytes.size())
    throw bad("table sizes do not match the header length");
  Header h;
  h.blobs.resize(nb);
  h.chunks.resize(nc);
  const unsigned char* names = p + need;
  size_t off = kHeaderPrefixBytes;
  for (auto& b : h.blobs) {
    b.nbytes = get_at<uint64_t>(p, off);
    b.first_chunk = get_at<uint32_t>(p, off + 8);
    b.chunk_count = get_at<uint32_t>(p, off + 12);
    uint64_t no = get_at<uint32_t>(p, off + 16), nl = get_at<uint32_t>(p, off + 20);
    b.codec = static_cast<Codec>(get_at<uint16_t>(p, off + 24));
    b.elem_bytes = get_at<uint16_t>(p, off + 26);
    if (no + nl > names_bytes) throw bad("blob name out of range");
    if (uint64_t{b.first_chunk} + b.chunk_count > nc) throw bad("blob chunk range out of range");
    if (b.codec > Codec::kFloatZstd || b.elem_bytes == 0) throw bad("unknown codec or element size");
    b.name.assign(reinterpret_cast<const char*>(names + no), nl);
    off += kBlobEntryBytes;
  }
  for (auto& c : h.chunks) {
    c.file_offset = get_at<uint64_t>(p, off);
    c.raw_offset = get_at<uint64_t>(p, off + 8);
    c.raw_bytes = get_at<uint32_t>(p, off + 16);
    c.stored_bytes = get_at<uint32_t>(p, off + 20);
    c.crc = get_at<uint32_t>(p, off + 24);
    c.blob = get_at<uint32_t>(p, off + 28);
    c.codec = static_cast<Codec>(get_at<uint16_t>(p, off + 32));
    c.stripe = get_at<uint16_t>(p, off + 34);
    if (c.blob >= nb || c.codec > Codec::kFloatZstd) throw bad("chunk entry out of range");
    if (c.file_offset % kBlockBytes != 0) throw bad("unaligned chunk offset");
    if (c.raw_offset + c.raw_bytes > h.blobs[c.blob].nbytes) throw bad("chunk beyond its blob");
    off += kChunkEntryBytes;
  }
  h.meta.assign(reinterpret_cast<const char*>(names + names_bytes), meta_bytes);
  return h;
}

}  // namespace ebbtide::ckpt
