// The tensor cache's C entry points for the torch hooks module (ebbtide._torch).
//
// Note [Two modules]
// ebbtide._core holds the core and imports without torch (checkpoints, the
// I/O bench and the planner need none). The saved-tensor hooks run once per
// saved tensor and must not pay for Python calls, so they are C++ against
// libtorch, in a second module, ebbtide._torch, built only where torch's
// headers are. It links no core code (two copies would mean two of every
// process-wide pool): it reaches the core of a CacheCore object through this
// table, which _core publishes as the capsule `_core._glue_api`.
// Every function is called with the interpreter's lock held, releases it
// where the core may block, and reports an error as a Python exception set
// (the same translation _core's bindings make) and a false/empty result:
// no C++ exception crosses between the modules.
#pragma once
#include <Python.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "ebbtide/cache/tensor_cache.hpp"

namespace ebbtide::py {

struct GlueApi {
  // 3: SaveRequest::lead_bytes; 4: kept_resident; 5: kept_resident takes changes
  static constexpr uint32_t kVersion = 5;
  uint32_t version = kVersion;
  uint32_t size = sizeof(GlueApi);
  // The core of a CacheCore object; nullptr and TypeError otherwise.
  cache::TensorCache* (*core_of)(PyObject* obj);
  // A Python object as a glue object of the core (Note [Glue objects]); a
  // reference is taken.
  cache::GlueObj (*glue_obj)(PyObject* obj);
  bool (*save)(cache::TensorCache* c, cache::SaveRequest& r, cache::SaveResult* out);
  bool (*unpack)(cache::TensorCache* c, cache::EntryId id, uintptr_t stream, int64_t task, bool have_original,
                 void* into, cache::Unpacked* out);
  // Returns 1 when the entry is gone, 0 when not, -1 on error.
  int (*release_handle)(cache::TensorCache* c, cache::HandleId handle, cache::EntryId id);
  // Device entries load into `buffers` (address, owner), host ones into the core's.
  bool (*start_loads)(cache::TensorCache* c, const std::vector<cache::EntryId>& ids,
                      const std::vector<std::pair<uintptr_t, PyObject*>>& buffers, uintptr_t stream);
  bool (*start_load)(cache::TensorCache* c, cache::EntryId id, void* dst, uintptr_t stream, PyObject* owner);
  bool (*reuse)(cache::TensorCache* c, cache::EntryId id);
  bool (*prefetch_scope)(cache::TensorCache* c, int microbatch, int64_t scope, int64_t task,
                         std::vector<cache::Candidate>* out);
  bool (*hold_live)(cache::TensorCache* c, cache::EntryId id, PyObject* live);
  // TensorCache::add_kept_resident (Note [Joint resident peak]); never fails.
  void (*kept_resident)(cache::TensorCache* c, int64_t delta);
  // The exception type the core's StateError becomes (closed cache, unknown entry).
  PyObject* state_error;
  // mem::fork_generation() (Note [Objects across fork]).
  uint64_t (*fork_generation)();
};


}  // namespace ebbtide::py
