// Internal: statx(STATX_DIOALIGN), in its own translation unit (dio_align.cpp)
// because <linux/stat.h> and glibc's <sys/stat.h> clash.
#pragma once

#include <cstdint>

namespace ebbtide::io::detail {

// The O_DIRECT alignments the kernel reports for `fd`; false where it reports
// none (before Linux 6.1, or a filesystem without direct I/O).
bool query_dio_align(int fd, uint32_t* mem_align, uint32_t* offset_align);

}  // namespace ebbtide::io::detail
