// Test hooks into the engine (not for production use): where a slot's bytes
// live on disk, so tests can corrupt them, and forcing the O_DIRECT refusal
// path on filesystems that accept O_DIRECT.
#pragma once

#include <cstdint>
#include <string>

#include "ebbtide/io/engine.hpp"

namespace ebbtide::io::detail {

struct SlotByteLocation {
  std::string dir;
  int fd = -1;             // the slab's file descriptor (open /proc/self/fd/<fd>)
  uint64_t file_offset = 0;
};

struct EngineTesting {
  // Where byte `byte` of `slot` is stored. StateError for an unknown slot.
  static SlotByteLocation locate(const Engine& engine, SlotId slot, uint64_t byte);
  // Makes new DirectFiles (slabs, checkpoint files) behave as if O_DIRECT were refused (EINVAL).
  static void refuse_direct(bool refuse);
  // Makes DirectFiles grow with ftruncate (sparse) as if fallocate were unsupported.
  static void refuse_fallocate(bool refuse);
};

}  // namespace ebbtide::io::detail
