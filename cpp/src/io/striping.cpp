// Striping: the engine's slabs form one logical space, RAID0-style in
// chunk_bytes units (layout in engine_impl.hpp).
//
// Note [Slot phase]
//   Buffers the caller does not control (torch's CPU tensors are 64-byte
//   aligned) would all go through staging. allocate(n, like) therefore starts
//   the slot's data `phase` = like % io_align bytes into its aligned extent, and
//   every request is cut at io_align boundaries of the file: a head piece up
//   to the first boundary, an aligned middle, a tail piece after the last.
//   When the buffer shares the slot's phase, the middle moves in place with
//   O_DIRECT and only the head and tail (< io_align bytes each) are staged,
//   padded with the extent's own slack; otherwise everything is staged.
//   The cut depends only on the slot, so per-chunk checksums of a
//   write line up with any later read.
#include "engine_impl.hpp"

#include <algorithm>

#include "ebbtide/util/error.hpp"

namespace ebbtide::io {

Engine::Impl::StripePos Engine::Impl::stripe_pos(uint64_t logical) const {
  const uint64_t chunk = opt.chunk_bytes, n = slabs.size(), stripe = logical / chunk;
  return {static_cast<size_t>(stripe % n), (stripe / n) * chunk + logical % chunk};
}

// Grows every slab so that `nbytes` more fit in the logical space. Engine lock held.
void Engine::Impl::grow_for(uint64_t nbytes) {
  const uint64_t n = slabs.size();
  const uint64_t short_by = alloc.shortfall(nbytes);
  if (short_by == 0) return;
  auto round_up = [](uint64_t v, uint64_t unit) { return (v + unit - 1) / unit * unit; };
  const uint64_t need = round_up((short_by + n - 1) / n, opt.chunk_bytes);  // per slab, at least
  uint64_t target = slab_size + round_up((short_by + n - 1) / n, grow_step);
  if (slab_limit && target > slab_limit) {
    if (slab_size + need > slab_limit)
      throw IoError(ENOSPC, slabs[0]->dir(), -1,
                    ebbtide::detail::concat("cannot reserve ", nbytes, " bytes: capacity_bytes ", opt.capacity_bytes,
                                   " per directory reached (", alloc.used(), " of ", alloc.capacity(),
                                   " bytes in use)"));
    target = slab_limit;
  }
  try {
    for (auto& s : slabs) s->grow_to(target);  // IoError names the directory
  } catch (const IoError& e) {
    // Note [Slab growth]: a whole step did not fit the free space; grow by
    // what this reservation needs, so a device with less than a step free
    // still takes what fits.
    if (e.err() != ENOSPC || slab_size + need >= target) throw;
    target = slab_size + need;
    for (auto& s : slabs) s->grow_to(target);
  }
  slab_size = target;
  alloc.grow(slab_size * n);
}

// Splits a request at stripe boundaries, and at io_align boundaries around a
// head and a tail (Note [Slot phase]); `base` is the logical offset of its
// first byte.
auto Engine::Impl::split(const ReqPtr& req, uint64_t base) const -> std::vector<Chunk*> {
  const uint64_t chunk = opt.chunk_bytes, ia = io_align;
  const mem::Buffer& b = req->buf;
  std::vector<Chunk*> pieces;
  uint64_t pos = 0;
  while (pos < b.nbytes) {
    const uint64_t logical = base + pos;
    const StripePos at = stripe_pos(logical);
    uint64_t len = std::min(chunk - logical % chunk, b.nbytes - pos);
    if (ia > 1) {
      if (logical % ia != 0) len = std::min(len, ia - logical % ia);  // head
      else if (len >= ia) len -= len % ia;                              // aligned middle; tail next
    }
    auto* c = new Chunk();
    c->req = req;
    c->index = static_cast<uint32_t>(pieces.size());
    c->slab = slabs[at.slab].get();
    c->dev = slab_device[at.slab];
    c->slab_index = at.slab;
    c->device = b.on_device();
    c->file_off = at.file_offset;
    c->user = static_cast<char*>(b.ptr) + pos;
    c->len = len;
    const uint64_t unit = ia > 1 ? ia : align;
    c->delta = c->file_off % unit;
    c->io_len = (c->delta + len + unit - 1) / unit * unit;
    pieces.push_back(c);
    pos += len;
  }
  return pieces;
}

}  // namespace ebbtide::io
