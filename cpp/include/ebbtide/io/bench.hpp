// The I/O benchmark behind `ebbtide bench io` and ebbtide-bench-io: writes
// `total_bytes` through the engine in `request_bytes` requests, then reads them
// back, and reports GB/s (10^9 bytes per second). The slabs are flushed
// (syncfs, untimed) between the write and the read, so the read does not
// overlap the device's write-back. With a CUDA device present and `device`
// set, also measures device->file and file->device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ebbtide/io/engine.hpp"

namespace ebbtide::io {

struct BenchOptions {
  std::vector<std::string> dirs;
  uint64_t total_bytes = 1ull << 30;
  uint64_t chunk_bytes = 1ull << 20;
  uint64_t request_bytes = 64ull << 20;
  unsigned queue_depth = 16;
  BackendKind backend = BackendKind::kAuto;
  bool checksum = false;
  bool device = true;  // also run device-pointer transfers when a GPU is present
  bool verify = true;  // compare read-back data with what was written
  bool huge_pages = true;  // ask for transparent huge pages for the buffers (Note [Bench buffers])
};

struct BenchResult {
  std::string backend;
  std::string describe;
  uint64_t bytes = 0;
  double write_seconds = 0, read_seconds = 0;
  double write_gbps = 0, read_gbps = 0;
  bool device_measured = false;
  double device_write_gbps = 0, device_read_gbps = 0;  // device->file, file->device
  bool verified = false;
  bool direct = false;  // O_DIRECT on every slab (else the page cache may flatter reads)
  uint64_t alignment = 0;
  bool huge_pages = false;  // every buffer is backed by huge pages (what the kernel gave)
};

BenchResult run_io_bench(const BenchOptions& options);

}  // namespace ebbtide::io
