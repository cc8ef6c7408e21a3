// Note [Untrusted byte ranges]
// A DCP checkpoint names its data as (file, offset, length) triples in a
// metadata file the loader cannot trust. Byte ranges of plain files are read
// here, never with Python's open(): the file must be a regular file opened
// without following a symlink (Note [Regular files only]), and every range
// must lie inside the file's size as fstat reports it, checked without
// overflow, before any byte is read. The caller confines the file names to
// the checkpoint directory (python/ebbtide/checkpoint/dcp_writer.py).
#include <cstring>

#include "ebbtide/ckpt/reader.hpp"
#include "ebbtide/util/error.hpp"
#include "shard_io.hpp"

namespace ebbtide::ckpt {

FileProbe probe_file(const std::string& path) {
  const auto file = detail::open_shard(path, false, false);
  const io::DirectFile& f = *file;
  FileProbe p;
  p.size = f.size();
  if (p.size >= kSuperBytes) {
    char magic[sizeof kSuperMagic];
    io::read_exact(f, magic, sizeof magic, 0);
    p.shard = std::memcmp(magic, kSuperMagic, sizeof magic) == 0;
  }
  return p;
}

void read_file_ranges(const std::string& path, const std::vector<FileRange>& ranges) {
  const auto file = detail::open_shard(path, false, false);
  const io::DirectFile& f = *file;
  const uint64_t size = f.size();
  for (const auto& r : ranges)
    EBB_CHECK(fits_within(r.offset, r.len, size), path, ": byte range [", r.offset, ", ", r.offset, " + ", r.len,
              ") lies outside the file (", size, " bytes)");
  for (const auto& r : ranges) {
    EBB_CHECK(r.dst != nullptr || r.len == 0, path, ": null destination for ", r.len, " bytes");
    io::read_exact(f, r.dst, r.len, r.offset);
  }
}

}  // namespace ebbtide::ckpt
