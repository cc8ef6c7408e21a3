// Test hooks into the engine (engine_testing.hpp).
#include "ebbtide/io/detail/engine_testing.hpp"

#include "engine_impl.hpp"

#include "ebbtide/util/error.hpp"

namespace ebbtide::io {

detail::SlotByteLocation detail::EngineTesting::locate(const Engine& engine, SlotId slot, uint64_t byte) {
  auto& I = *engine.impl_;
  std::lock_guard lock(I.mu);
  auto it = I.slots.find(slot);
  EBB_CHECK_STATE(it != I.slots.end(), "slot ", slot, ": unknown");
  const auto at = I.stripe_pos(it->second.extent.offset + it->second.phase + byte);
  const auto& slab = *I.slabs[at.slab];
  return {slab.dir(), slab.fd(), at.file_offset};
}

void detail::EngineTesting::refuse_direct(bool refuse) { detail::set_refuse_direct_for_tests(refuse); }
void detail::EngineTesting::refuse_fallocate(bool refuse) { detail::set_refuse_fallocate_for_tests(refuse); }

}  // namespace ebbtide::io
