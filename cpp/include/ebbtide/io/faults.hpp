// Write-fault injection for tests (Note [Fault injection] in faults.cpp).
// Process-wide; checked by the transfer loop just before it issues a write, so
// the write fails exactly as if the device had returned the errno.
#pragma once

#include <cstdint>
#include <string>

namespace ebbtide::io {

class DirectFile;

// The next `count` writes into the slab of directory `dir` (an engine's
// anonymous file there) starting at or after file offset `after_bytes` fail
// with errno `err` (> 0, e.g. ENOSPC).
void inject_write_fault(const std::string& dir, uint64_t after_bytes, int err, int count = 1);
// The next write into any named file (a checkpoint shard) that reaches past
// `after_bytes` fails with errno `err`; err = 0 disarms it; err < 0 parks the
// writing thread there for good instead (crash tests kill the process then).
void inject_file_write_fault(uint64_t after_bytes, int err);
// Disarms every fault.
void clear_faults();

namespace detail {
// The errno a write of [offset, offset + len) into `file` must fail with, or
// 0; consumes the fault. Parks the calling thread for a parking fault.
int take_write_fault(const DirectFile& file, uint64_t offset, uint64_t len);
}  // namespace detail

}  // namespace ebbtide::io
