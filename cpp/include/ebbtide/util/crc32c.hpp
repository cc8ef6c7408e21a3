// CRC-32C (Castagnoli), hardware-accelerated with SSE4.2 when the CPU has it,
// table-driven otherwise. crc32c(data, n, crc) extends a running value, so a
// checksum can be computed over pieces: crc32c(b, nb, crc32c(a, na)).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ebbtide {

uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc = 0);
// True when the hardware path is used (for logs and benchmarks).
bool crc32c_hardware();

}  // namespace ebbtide
