// statx(STATX_DIOALIGN) in its own translation unit: <linux/stat.h> carries the
// DIO fields that glibc's struct statx (2.36) lacks, and the two clash.
#include <fcntl.h>
#include <linux/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "dio_align.hpp"

namespace ebbtide::io::detail {

bool query_dio_align(int fd, uint32_t* mem_align, uint32_t* offset_align) {
#if defined(STATX_DIOALIGN) && defined(SYS_statx)
  struct statx sx {};
  if (::syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) != 0) return false;
  if (!(sx.stx_mask & STATX_DIOALIGN)) return false;
  *mem_align = sx.stx_dio_mem_align;
  *offset_align = sx.stx_dio_offset_align;
  return true;
#else
  (void)fd, (void)mem_align, (void)offset_align;
  return false;
#endif
}

}  // namespace ebbtide::io::detail
