// libFuzzer target: the checkpoint shard decoders and reader on hostile bytes.
//
// The input is a shard file. Before it is read, its checksums are repaired
// (superblock, header, and each chunk's crc32c where the chunk lies in the
// input), so mutations reach the checks behind them: a CRC is no defence
// against a crafted file (Note [Hostile headers] in cpp/src/ckpt/format.cpp).
// Then the pure decoders run on the bytes, and ShardReader opens the file,
// checks its extents (what `load()` and `ebbtide ckpt inspect` both do
// before any data is read), reads every blob twice (into buffers filled
// with 0xAA, then 0x55: a byte the reader never wrote would differ) and
// verifies it. Only ebbtide's typed errors may escape the reader, and once
// check_extents() has passed, read() may fail only for the data itself (a
// checksum, a chunk that does not decode), never for a file or an extent
// the check let through; anything else (a crash, a sanitizer report,
// another exception, two reads that disagree) is a finding. The metadata
// JSON and the object tree in it are parsed in Python only: their seeded
// sweeps are in python/tests/test_ckpt_validation.py.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/reader.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"

namespace {

using namespace ebbtide::ckpt;

constexpr uint64_t kMaxLoadBytes = 64ull << 20;  // larger declared blobs are decoded, not read

template <typename T>
T get(const std::string& s, uint64_t off) {
  T v{};
  if (off <= s.size() && sizeof(T) <= s.size() - off) std::memcpy(&v, s.data() + off, sizeof(T));
  return v;
}
template <typename T>
void put(std::string& s, uint64_t off, T v) {
  if (off <= s.size() && sizeof(T) <= s.size() - off) std::memcpy(s.data() + off, &v, sizeof(T));
}

// Recomputes the chunk, header and superblock checksums the input claims.
void repair_checksums(std::string& s) {
  if (s.size() < kSuperBytes) return;
  uint64_t h = get<uint64_t>(s, 24), hlen = get<uint64_t>(s, 32);
  if (fits_within(h, hlen, s.size()) && hlen >= 32) {
    uint64_t nb = get<uint32_t>(s, h + 8), nc = get<uint32_t>(s, h + 12);
    uint64_t table = h + 32 + nb * kBlobEntryBytes;
    for (uint64_t i = 0; i < nc && table + (i + 1) * kChunkEntryBytes <= h + hlen; ++i) {
      uint64_t e = table + i * kChunkEntryBytes;
      uint64_t off = get<uint64_t>(s, e), stored = get<uint32_t>(s, e + 20);
      if (fits_within(off, stored, s.size())) put<uint32_t>(s, e + 24, ebbtide::crc32c(s.data() + off, stored));
    }
    put<uint32_t>(s, 48, ebbtide::crc32c(s.data() + h, hlen));
  }
  put<uint32_t>(s, 56, ebbtide::crc32c(s.data(), 56));
}

std::string g_dir;  // where the input is written, removed at exit

const std::string& scratch_dir() {
  if (g_dir.empty()) {
    const char* t = std::getenv("TMPDIR");
    std::string templ = std::string(t && *t ? t : "/tmp") + "/ebbtide-fuzz-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) std::abort();
    g_dir = buf.data();
    std::atexit([] {
      ::unlink((g_dir + "/shard.ebt").c_str());
      ::rmdir(g_dir.c_str());
    });
  }
  return g_dir;
}

void read_all(ShardReader& r) {
  const auto& h = r.header();
  uint64_t total = 0;
  for (const auto& b : h.blobs) total += b.nbytes;  // each <= chunks x 1 GiB: no overflow
  if (total > kMaxLoadBytes) return;
  std::vector<std::vector<char>> first, second;
  for (char fill : {'\xAA', '\x55'}) {
    auto& bufs = fill == '\xAA' ? first : second;
    std::vector<BlobTarget> targets;
    for (uint32_t b = 0; b < h.blobs.size(); ++b) {
      bufs.emplace_back(h.blobs[b].nbytes, fill);
      targets.push_back({b, {bufs.back().data(), bufs.back().size()}});
    }
    r.read(targets, 1);
  }
  if (first != second) std::abort();  // a byte of a destination was not written by the read
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  repair_checksums(bytes);
  const std::string name = "input";
  if (bytes.size() >= kSuperBytes) {
    try {
      auto sb = decode_superblock(reinterpret_cast<const unsigned char*>(bytes.data()), name);
      if (fits_within(sb.header_offset, sb.header_bytes, bytes.size()))
        decode_header(std::string_view(bytes).substr(sb.header_offset, sb.header_bytes), name);
    } catch (const ebbtide::Error&) {
    }
  }
  std::string path = scratch_dir() + "/shard.ebt";
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  try {
    // A striped shard names stripe files that do not exist: their errors are exercised too.
    uint16_t count = bytes.size() >= kSuperBytes ? get<uint16_t>(bytes, 54) : 1;
    std::vector<std::string> stripes;
    for (uint16_t k = 1; k < count && k < 8; ++k) stripes.push_back(scratch_dir() + "/missing-" + std::to_string(k));
    ShardReader r(path, false, stripes);
    r.check_extents();
    try {
      read_all(r);
    } catch (const ebbtide::ChecksumError&) {
    } catch (const ebbtide::IoError&) {
      std::abort();  // a file or an extent check_extents() passed
    } catch (const ebbtide::Error&) {
    }
    r.verify(1);
  } catch (const ebbtide::Error&) {
  }
  return 0;
}
