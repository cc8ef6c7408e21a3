// Allocator of aligned variable-size extents inside a growable address space
// (the engine's logical slab space). Best fit over free extents, coalesced on
// free; the space grows at its end by grow(). Not thread safe: the engine
// serializes calls under its own lock.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace ebbtide::io::detail {

struct Extent {
  uint64_t offset = 0;
  uint64_t length = 0;
};

class SlotAllocator {
 public:
  // `alignment` (> 0, power of two): every offset and length is a multiple of it.
  explicit SlotAllocator(uint64_t alignment);

  // Reserves round_up(nbytes, alignment) bytes (nbytes > 0); nullopt when no
  // free extent is large enough (the caller grows the space and retries).
  std::optional<Extent> allocate(uint64_t nbytes);
  // Returns an extent obtained from allocate(). InvalidArgument when it is not
  // a live allocation (overlaps free space or lies outside the space).
  void free(const Extent& extent);
  // Extends the space to `new_capacity` (a multiple of alignment, >= capacity()).
  void grow(uint64_t new_capacity);

  uint64_t alignment() const { return alignment_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }
  uint64_t free_bytes() const { return capacity_ - used_; }
  uint64_t live() const { return live_; }  // extents handed out, not yet freed
  size_t free_extents() const { return by_offset_.size(); }
  uint64_t largest_free() const;
  // Bytes needed at the end of the space so that `nbytes` fits (0 when it fits now).
  uint64_t shortfall(uint64_t nbytes) const;
  uint64_t round(uint64_t nbytes) const { return (nbytes + alignment_ - 1) / alignment_ * alignment_; }

 private:
  void insert_free(uint64_t offset, uint64_t length);
  void erase_free(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t alignment_;
  uint64_t capacity_ = 0;
  uint64_t used_ = 0;
  uint64_t live_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;               // offset -> length
  std::set<std::pair<uint64_t, uint64_t>> by_size_;      // (length, offset)
};

}  // namespace ebbtide::io::detail
