#include "ebbtide/io/detail/slot_allocator.hpp"

#include "ebbtide/util/error.hpp"

namespace ebbtide::io::detail {

SlotAllocator::SlotAllocator(uint64_t alignment) : alignment_(alignment) {
  EBB_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0, "slot alignment ", alignment,
            " is not a power of two");
}

void SlotAllocator::insert_free(uint64_t offset, uint64_t length) {
  by_offset_.emplace(offset, length);
  by_size_.emplace(length, offset);
}

void SlotAllocator::erase_free(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  by_offset_.erase(it);
}

std::optional<Extent> SlotAllocator::allocate(uint64_t nbytes) {
  EBB_CHECK(nbytes > 0, "cannot allocate a slot of 0 bytes");
  EBB_CHECK(nbytes <= UINT64_MAX - alignment_, "slot size ", nbytes, " is too large");
  const uint64_t need = round(nbytes);
  // Best fit: the smallest free extent that holds `need`; ties go to the lowest offset.
  auto fit = by_size_.lower_bound({need, 0});
  if (fit == by_size_.end()) return std::nullopt;
  const uint64_t offset = fit->second, length = fit->first;
  erase_free(by_offset_.find(offset));
  if (length > need) insert_free(offset + need, length - need);
  used_ += need;
  ++live_;
  return Extent{offset, need};
}

void SlotAllocator::free(const Extent& e) {
  EBB_CHECK(e.length > 0 && e.length % alignment_ == 0 && e.offset % alignment_ == 0 &&
                e.offset + e.length <= capacity_,
            "extent [", e.offset, ", +", e.length, ") is not an allocation of this space (capacity ",
            capacity_, ")");
  uint64_t offset = e.offset, length = e.length;
  auto next = by_offset_.lower_bound(offset);
  EBB_CHECK(next == by_offset_.end() || next->first >= offset + length, "extent [", offset, ", +",
            length, ") overlaps free space (freed twice?)");
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    EBB_CHECK(prev->first + prev->second <= offset, "extent [", offset, ", +", length,
              ") overlaps free space (freed twice?)");
    if (prev->first + prev->second == offset) {  // coalesce with the extent before
      offset = prev->first;
      length += prev->second;
      erase_free(prev);
    }
  }
  if (next != by_offset_.end() && next->first == offset + length) {  // and the one after
    length += next->second;
    erase_free(next);
  }
  insert_free(offset, length);
  used_ -= e.length;
  --live_;
}

void SlotAllocator::grow(uint64_t new_capacity) {
  EBB_CHECK(new_capacity >= capacity_ && new_capacity % alignment_ == 0, "cannot grow space from ",
            capacity_, " to ", new_capacity, " bytes");
  if (new_capacity == capacity_) return;
  uint64_t offset = capacity_, length = new_capacity - capacity_;
  if (!by_offset_.empty()) {
    auto last = std::prev(by_offset_.end());
    if (last->first + last->second == capacity_) {
      offset = last->first;
      length += last->second;
      erase_free(last);
    }
  }
  insert_free(offset, length);
  capacity_ = new_capacity;
}

uint64_t SlotAllocator::largest_free() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

uint64_t SlotAllocator::shortfall(uint64_t nbytes) const {
  const uint64_t need = round(nbytes);
  if (largest_free() >= need) return 0;
  uint64_t tail = 0;  // free bytes ending at capacity, usable after growth
  if (!by_offset_.empty()) {
    auto last = std::prev(by_offset_.end());
    if (last->first + last->second == capacity_) tail = last->second;
  }
  return need - tail;
}

}  // namespace ebbtide::io::detail
