// The slot table and the engine's statistics: allocate, free, and what a
// finished request changes in them.
//
// Note [Slot lifecycle]
//   allocate() -> EMPTY --write--> WRITING --ok--> STORED --read--> READING -> STORED
//                                     |--fail/cancel--> EMPTY (nothing stored)
//   A write to a STORED slot first drops the old contents (EMPTY while it runs).
//   free(): from EMPTY/STORED the space returns at once; with I/O in flight the
//   slot becomes FREE_PENDING (a queued write is cancelled) and its space
//   returns when the last request completes. Slot ids are never reused, so a
//   second free() of the same id is a StateError, as are reads of EMPTY slots,
//   writes while a request is in flight on the slot, and any use after free.
#include "engine_impl.hpp"

#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io {

using detail::ReqPtr;
using detail::SlotMeta;

void Engine::Impl::release_slot(std::unordered_map<SlotId, SlotMeta>::iterator it) {
  alloc.free(it->second.extent);
  slots.erase(it);
}

void Engine::Impl::finalize(const ReqPtr& req) {
  const bool cancelled = req->phase.load() == detail::kCancelled;
  std::exception_ptr err;
  {
    std::lock_guard lock(req->mu);
    err = req->error;
  }
  if (cancelled && !err)
    err = std::make_exception_ptr(StateError(ebbtide::detail::concat("write to slot ", req->slot, " was cancelled")));
  {
    std::lock_guard lock(mu);
    auto it = slots.find(req->slot);
    EBB_ASSERT(it != slots.end(), "slot ", req->slot, " vanished with a request in flight");
    SlotMeta& m = it->second;
    if (req->write) {
      m.writing = false;
      m.pending_write.reset();
      if (!err) {
        m.stored = req->nbytes;
        m.crcs = std::move(req->crcs);
        if (!m.free_pending) st.bytes_stored += req->nbytes;
        ++st.writes;
        st.bytes_written += req->nbytes;
      } else if (cancelled) {
        ++st.cancelled;
      } else {
        ++st.write_errors;
      }
    } else {
      --m.readers;
      if (!err) {
        ++st.reads;
        st.bytes_read += req->nbytes;
      } else {
        ++st.read_errors;
      }
    }
    if (m.free_pending && !m.writing && m.readers == 0) release_slot(it);
  }
  {
    std::lock_guard lock(req->mu);
    req->done = true;
    req->was_cancelled = cancelled;
    req->error = err;
  }
  if (req->on_done) {
    try {
      req->on_done(Request(req));
    } catch (const std::exception& e) {
      log::error("io: completion callback for slot ", req->slot, " threw: ", e.what());
    } catch (...) {
      log::error("io: completion callback for slot ", req->slot, " threw a non-standard exception");
    }
    req->on_done = nullptr;  // drop what the callback holds (Python buffers) now
  }
  // Stats first: whoever wait() releases may read them at once (pending 0).
  {
    std::lock_guard lock(mu);
    --st.pending;
    drain_cv.notify_all();
  }
  {
    std::lock_guard lock(req->mu);
    req->finished = true;
  }
  req->cv.notify_all();
}

SlotId Engine::allocate(uint64_t nbytes, const void* like) {
  auto& I = *impl_;
  EBB_CHECK(nbytes > 0, "cannot allocate a slot of 0 bytes");
  const uint64_t phase = like != nullptr && I.io_align > 1 ? reinterpret_cast<uintptr_t>(like) % I.io_align : 0;
  std::lock_guard lock(I.mu);
  EBB_CHECK_STATE(!I.closing, "allocate: the engine is closed");
  auto ext = I.alloc.allocate(nbytes + phase);
  if (!ext) {
    I.grow_for(nbytes + phase);
    ext = I.alloc.allocate(nbytes + phase);
    EBB_ASSERT(ext.has_value(), "no extent after growing for ", nbytes + phase, " bytes");
  }
  SlotId id = I.next_slot++;
  SlotMeta meta;
  meta.extent = *ext;
  meta.phase = phase;
  I.slots.emplace(id, std::move(meta));
  ++I.st.slots_live;
  I.st.bytes_reserved += ext->length;
  return id;
}

void Engine::free(SlotId slot) {
  auto& I = *impl_;
  ReqPtr to_cancel;
  {
    std::lock_guard lock(I.mu);
    EBB_CHECK_STATE(!I.closed, "free of slot ", slot, ": the engine is closed");
    auto it = I.slots.find(slot);
    EBB_CHECK_STATE(it != I.slots.end() && !it->second.free_pending, "free of slot ", slot,
                    ": unknown or already freed slot");
    SlotMeta& m = it->second;
    --I.st.slots_live;
    I.st.bytes_reserved -= m.extent.length;
    I.st.bytes_stored -= m.stored;
    m.stored = 0;
    if (!m.writing && m.readers == 0) {
      I.release_slot(it);
    } else {
      m.free_pending = true;
      to_cancel = m.pending_write;
    }
  }
  if (to_cancel) I.cancel(to_cancel);
}

uint64_t Engine::slot_capacity(SlotId slot) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->slots.find(slot);
  EBB_CHECK_STATE(it != impl_->slots.end() && !it->second.free_pending, "slot ", slot,
                  ": unknown or already freed slot");
  return it->second.extent.length - it->second.phase;
}

uint64_t Engine::stored_bytes(SlotId slot) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->slots.find(slot);
  EBB_CHECK_STATE(it != impl_->slots.end() && !it->second.free_pending, "slot ", slot,
                  ": unknown or already freed slot");
  return it->second.stored;
}

EngineStats Engine::stats() const {
  std::lock_guard lock(impl_->mu);
  EngineStats s = impl_->st;
  s.slab_bytes = impl_->slab_size * impl_->slabs.size();
  s.bytes_staged = impl_->bytes_staged.load(std::memory_order_relaxed);
  return s;
}

}  // namespace ebbtide::io
