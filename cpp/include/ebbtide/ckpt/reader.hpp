// Checkpoint shard reader: validates the superblock and header, reads blobs
// back (O_DIRECT, checksums verified, decompressed) into host or device
// memory, and verifies whole shards for `ebbtide ckpt inspect`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ebbtide/mem/fork_origin.hpp"
#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/mem/buffer.hpp"
#include "ebbtide/mem/cuda_shim.hpp"

namespace ebbtide::ckpt {

// Where read() puts blob `blob`: `dst` holds exactly the blob's nbytes (a
// CUDA device buffer is copied on its stream). With `part`, `dst` receives
// the blob's bytes [offset, offset + dst.nbytes), which must lie within it
// (a DCP item's tensor inside its torch.save frame).
struct BlobTarget {
  uint32_t blob = 0;
  mem::Buffer dst;
  uint64_t offset = 0;
  bool part = false;
};

struct VerifyProblem {
  std::string blob;          // blob (tensor) name
  uint64_t file_offset = 0;  // chunk offset in the shard file
  std::string message;
};

class ShardReader : public mem::ForkOrigin {
 public:
  // Opens and validates `path`. InvalidArgument (corrupt, truncated, not a
  // shard), Unsupported (newer format version), IoError (cannot read).
  // A striped shard (superblock stripe_count > 1) needs `stripe_paths`, the
  // stripe files 1..count-1 in order (InvalidArgument otherwise); a missing
  // or bad stripe file is reported by read()/verify(), naming it and a tensor.
  explicit ShardReader(const std::string& path, bool direct = true, std::vector<std::string> stripe_paths = {});
  ~ShardReader();
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  const Superblock& superblock() const;
  const Header& header() const;
  const std::string& path() const;
  uint64_t file_bytes() const;  // actual size on disk (all stripe files together)
  size_t stripe_count() const;  // files of the shard (1 when not striped)

  // Checks without reading data that read() can read every chunk: its file
  // (a stripe file opened, its superblock valid) holds the chunk's extent.
  // Throws what read() would throw for the first chunk in table order that
  // fails: IoError for a stripe file that cannot be opened or a chunk past
  // the end of its file, InvalidArgument for a bad stripe file.
  void check_extents() const;
  // Reads the given blobs; ChecksumError / InvalidArgument name the blob and
  // the file offset of the bad chunk. A destination whose size is not the
  // blob's is refused (InvalidArgument) before anything is read. Device
  // destinations are copied with `cuda_driver` (null: the process's; tests
  // give a simulated one): raw chunks straight from the page-locked staging
  // buffer they were read into, on the destination's stream.
  void read(const std::vector<BlobTarget>& targets, unsigned threads = 0, mem::cuda::Driver* cuda_driver = nullptr);
  // Reads and checks every chunk (checksum, decompression); never throws for
  // bad data, returns the problems found.
  std::vector<VerifyProblem> verify(unsigned threads = 0);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Plain files (not shards), e.g. the .distcp files of torch's DCP
// FileSystemWriter: Note [Untrusted byte ranges] in range_read.cpp.
struct FileRange {
  uint64_t offset = 0;
  uint64_t len = 0;
  void* dst = nullptr;  // host memory of `len` bytes
};
struct FileProbe {
  uint64_t size = 0;   // bytes
  bool shard = false;  // starts with an ebbtide shard superblock magic
};
// Opens `path` as a regular file (InvalidArgument for a symlink, FIFO,
// directory...; IoError naming it when it cannot be opened).
FileProbe probe_file(const std::string& path);
// Reads each range (pread); InvalidArgument naming the file and the range
// when one does not lie inside the file.
void read_file_ranges(const std::string& path, const std::vector<FileRange>& ranges);

}  // namespace ebbtide::ckpt
