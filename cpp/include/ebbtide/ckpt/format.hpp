// On-disk format of one checkpoint shard file (docs/checkpoint-format.md).
//
// A shard holds blobs (raw tensor storages) cut into chunks; each chunk is
// stored at a 4 KiB-aligned file offset, optionally compressed, with a crc32c
// of its stored bytes. The binary header (blob table, chunk table, names and
// the caller's JSON metadata) follows the data; the superblock at offset 0
// points to it and is written last. All integers are little-endian.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ebbtide::ckpt {

// Newest version this build reads and writes. Unstriped shards are still
// written as version 1 (readable by older builds); striped ones need 2.
inline constexpr uint32_t kFormatVersion = 2;
inline constexpr uint32_t kFormatVersionUnstriped = 1;
inline constexpr uint32_t kFlagStripeFile = 1;  // superblock flag: a stripe data file (no header)
inline constexpr uint64_t kBlockBytes = 4096;  // file offset alignment of every chunk
inline constexpr uint64_t kDataStart = kBlockBytes;
inline constexpr uint64_t kMaxChunkBytes = 1ull << 30;  // largest raw chunk a writer makes (chunk_bytes <= 1 GiB)
inline constexpr char kSuperMagic[16] = {'E', 'B', 'B', 'T', 'I', 'D', 'E', '-',
                                         'C', 'K', 'P', 'T', '\0', '\0', '\0', '\0'};

enum class Codec : uint16_t {
  kNone = 0,         // raw bytes
  kZstd = 1,         // zstd frame of the raw bytes
  kShuffleZstd = 2,  // byte planes (Note [Byte grouping] in codec.cpp), then zstd
  kFloatZstd = 3,    // IEEE floats: sign bit rotated to the bottom, byte planes, zstd
};
std::string_view to_string(Codec c);
// "none" | "zstd" | "shuffle-zstd" | "float-zstd"; InvalidArgument otherwise.
Codec parse_codec(std::string_view text);

// Superblock: the first 64 bytes of block 0 (rest of the block zero).
struct Superblock {
  uint32_t format_version = kFormatVersion;
  uint32_t flags = 0;         // kFlagStripeFile for stripe data files
  uint64_t header_offset = 0;
  uint64_t header_bytes = 0;
  uint64_t file_bytes = 0;   // size of the complete file
  uint32_t header_crc = 0;   // crc32c of the header bytes
  // Version 2 (Note [Striping] in writer_shard.cpp): files of the shard (1 when not
  // striped; v1 files read as 1), and this file's stripe number (0 = the
  // shard file holding the header, k >= 1 = stripe data file k).
  uint16_t stripe_index = 0;
  uint16_t stripe_count = 1;
  uint32_t super_crc = 0;    // crc32c of bytes [0, 56) of the superblock
};
inline constexpr size_t kSuperBytes = 64;
void encode_superblock(const Superblock& sb, unsigned char out[kSuperBytes]);
// Throws InvalidArgument naming `path` for a bad magic or crc, Unsupported for
// a newer format version.
Superblock decode_superblock(const unsigned char in[kSuperBytes], const std::string& path);

struct ChunkEntry {
  uint64_t file_offset = 0;  // multiple of kBlockBytes
  uint64_t raw_offset = 0;   // offset of the chunk's bytes inside its blob
  uint32_t raw_bytes = 0;
  uint32_t stored_bytes = 0;
  uint32_t crc = 0;          // crc32c of the stored bytes
  uint32_t blob = 0;
  Codec codec = Codec::kNone;
  uint16_t stripe = 0;       // file holding the chunk: 0 = the shard file, k = stripe file k
};
inline constexpr size_t kChunkEntryBytes = 40;

struct BlobEntry {
  std::string name;          // for messages: the tensor (storage) it holds
  uint64_t nbytes = 0;
  uint32_t first_chunk = 0;
  uint32_t chunk_count = 0;
  Codec codec = Codec::kNone;  // requested codec (chunks may fall back to kNone)
  uint16_t elem_bytes = 1;
};
inline constexpr size_t kBlobEntryBytes = 32;

struct Header {
  std::vector<BlobEntry> blobs;
  std::vector<ChunkEntry> chunks;
  std::string meta;          // caller's JSON metadata, opaque here
};
std::string encode_header(const Header& h);
// Decodes untrusted bytes (Note [Hostile headers] in format.cpp): returns only
// tables under which reading writes each byte of each blob exactly once,
// inside it. Throws InvalidArgument naming `path` and the entry otherwise.
// Chunk extents against the real file sizes are checked by ShardReader.
Header decode_header(std::string_view bytes, const std::string& path);

// Well-formed UTF-8: no overlong forms, surrogates or code points past
// U+10FFFF (names read from files become Python strings).
bool valid_utf8(std::string_view s);

inline constexpr uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
// [offset, offset + len) lies inside [0, limit), computed without overflow.
inline constexpr bool fits_within(uint64_t offset, uint64_t len, uint64_t limit) {
  return len <= limit && offset <= limit - len;
}

}  // namespace ebbtide::ckpt
