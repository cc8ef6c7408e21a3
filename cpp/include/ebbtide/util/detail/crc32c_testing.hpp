// Test hooks into crc32c (not for production use): each implementation on its
// own, so tests can check the hardware path against the table-driven one.
// Both have crc32c()'s contract.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ebbtide::detail {

// Always the table-driven path.
uint32_t crc32c_software(const void* data, size_t nbytes, uint32_t crc = 0);
// The SSE4.2 path; falls back to the table when crc32c_hardware() is false.
uint32_t crc32c_hw(const void* data, size_t nbytes, uint32_t crc = 0);

}  // namespace ebbtide::detail
