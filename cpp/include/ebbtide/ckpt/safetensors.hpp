// The safetensors file format: an 8-byte little-endian header length N, N
// bytes of JSON (per tensor: dtype, shape, data_offsets; optional
// "__metadata__" string map), then the data section, the tensors' bytes
// tightly packed. Parsing treats every file as hostile (Note [Hostile
// safetensors] in safetensors.cpp); reading and writing go through the
// checkpoint I/O path (O_DIRECT where allowed, io_uring when available).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ebbtide/mem/fork_origin.hpp"
#include "ebbtide/io/engine.hpp"
#include "ebbtide/mem/buffer.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/cufile_shim.hpp"

namespace ebbtide::ckpt::safetensors {

// Largest header accepted (the safetensors package's own limit).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
inline constexpr size_t kMaxDims = 64;

// Bits per element of a safetensors dtype name ("F32" -> 32, "F4" -> 4);
// 0 for a name the format does not define.
uint32_t dtype_bits(std::string_view dtype);

struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

using Metadata = std::vector<std::pair<std::string, std::string>>;

struct Header {
  std::vector<TensorInfo> tensors;  // in the order of the JSON text
  Metadata metadata;                // "__metadata__", in the order of the JSON text
  uint64_t data_offset = 0;         // file offset of the data section: 8 + N
  uint64_t data_bytes = 0;
};

// Parses and validates a whole file's header: `json` is the N header bytes,
// `file_bytes` the file's size. The result's tensors cover the data section
// exactly. Throws InvalidArgument naming `path`, the tensor and the problem.
Header parse_header(std::string_view json, uint64_t file_bytes, const std::string& path);

// The header JSON for `tensors` (their offsets as given) and `metadata`,
// padded with spaces so that the data section starts at a multiple of 8.
std::string encode_header(const std::vector<TensorInfo>& tensors, const Metadata& metadata);

struct ReadTarget {
  size_t tensor = 0;  // index into Header::tensors
  mem::Buffer dst;    // exactly end - begin bytes; device buffers: Note [Reads into device memory]
  // The caller owns the 4 KiB blocks around [ptr, ptr + bytes): an O_DIRECT
  // read may land in place and overwrite the rest of those blocks
  // (Note [Reading in place]).
  bool own_blocks = false;
};

struct IoOptions {
  bool direct = true;                                // O_DIRECT where the filesystem allows it
  io::BackendKind backend = io::BackendKind::kAuto;
  unsigned queue_depth = 8;                          // transfers in flight
  // Device tensors: read by cuFile (GPUDirect Storage) straight into device
  // memory when it is usable and the file is O_DIRECT, else through pinned
  // staging (Note [Reads into device memory] in safetensors_read.cpp).
  bool try_cufile = true;
  // The drivers to use; null: the process-wide ones (mem::cuda::driver(),
  // mem::cufile::cufile()). Tests give simulated ones.
  mem::cuda::Driver* cuda_driver = nullptr;
  mem::cufile::Driver* cufile_driver = nullptr;
  // Defaults with EBBTIDE_CKPT_DIRECT, EBBTIDE_CKPT_QUEUE_DEPTH and
  // EBBTIDE_IO_BACKEND applied (docs/configuration.md).
  static IoOptions from_env();
};

class Reader : public mem::ForkOrigin {
 public:
  // Opens `path` (a regular file, Note [Regular files only] in io/direct_file.cpp)
  // and validates its header. InvalidArgument (not a valid safetensors file,
  // naming the file and the tensor), IoError (cannot read it).
  explicit Reader(const std::string& path, const IoOptions& options = IoOptions::from_env());
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const Header& header() const;
  const std::string& path() const;
  uint64_t file_bytes() const;
  bool direct() const;  // O_DIRECT in effect
  // Reads the targets' tensors (each at most once). IoError naming the file
  // and offset; InvalidArgument for a bad target (a destination whose size is
  // not the tensor's, before anything is read). Returns the I/O path used.
  std::string read(const std::vector<ReadTarget>& targets);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct SaveTensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  mem::Buffer src;  // exactly dtype x shape bytes; a device buffer is copied through pinned staging
};

struct SaveResult {
  uint64_t file_bytes = 0;
  uint64_t data_bytes = 0;
  std::string backend;  // I/O path used
};

// Writes `tensors` (sorted by element size, largest first, then by name, so
// every tensor starts at a multiple of its element size) and `metadata` to
// `path`: into a temporary file beside it, made durable, then renamed over
// `path` and the directory synced. InvalidArgument for a bad tensor (naming
// it), IoError naming the file. The memory must not change until it returns.
SaveResult save(const std::string& path, const std::vector<SaveTensor>& tensors, const Metadata& metadata,
                const IoOptions& options = IoOptions::from_env());

// Waits until the files that saves renamed over are closed, so their blocks
// are free (Note [Replaced files] in safetensors_save.cpp: save() closes the file
// it replaces on a background thread, and waits for this itself first).
void finish_replaced_files();
// Tests: holds (true) or lets go (false) the closing of replaced files.
void pause_replaced_files(bool paused);

}  // namespace ebbtide::ckpt::safetensors
