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
// While held, every write into a named file (a checkpoint shard) waits just
// before it would be issued, until hold_file_writes(false): a test stages a
// save that is certainly still in flight, without timing. held_file_writes()
// is the number of writing threads waiting there now.
void hold_file_writes(bool hold);
int held_file_writes();
// Disarms every fault and releases held writes.
void clear_faults();

namespace detail {
// The errno a write of [offset, offset + len) into `file` must fail with, or
// 0; consumes the fault. Parks the calling thread for a parking fault; waits
// while named-file writes are held.
int take_write_fault(const DirectFile& file, uint64_t offset, uint64_t len);
}  // namespace detail

}  // namespace ebbtide::io
