// Device buffers: copies between a CUDA device buffer and pinned staging on
// the caller's stream, and GPUDirect Storage through cuFile in AUTO mode.
#include "engine_impl.hpp"

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io {

namespace {
// Blocks until the work queued on `stream` so far is done: an event recorded
// there and waited for, not the whole stream.
void wait_for_stream(mem::cuda::Driver& drv, mem::cuda::Stream stream) {
  auto ev = drv.event_create();
  try {
    drv.event_record(ev, stream);
    drv.event_synchronize(ev);
  } catch (...) {
    drv.event_destroy(ev);
    throw;
  }
  drv.event_destroy(ev);
}
}  // namespace

// Copies one chunk between the caller's device buffer and its pinned staging
// buffer on the caller's stream (so it is ordered after work already queued
// there), then waits for that copy only (an event, not the whole stream). The
// worker keeps up to queue_depth disk transfers in flight meanwhile, so the
// PCIe copy of chunk i+1 overlaps the disk transfer of chunk i.
void Engine::Impl::copy_device(Chunk* c, bool to_device) {
  auto* drv = cuda();
  EBB_ASSERT(drv != nullptr, "device chunk without a CUDA driver");
  const auto dptr = static_cast<mem::cuda::DevicePtr>(reinterpret_cast<uintptr_t>(c->user));
  const auto stream = c->req->buf.stream;
  drv->bind_context_of(dptr);
  // Staging made where no context was current is page-locked now, in the
  // context of the device it serves (Note [Registration context]).
  if (opt.cuda_register && !staging_pin_tried.load(std::memory_order_acquire)) {
    staging->ensure_registered();
    staging_pin_tried.store(true, std::memory_order_release);
  }
  if (to_device) drv->memcpy_htod_async(dptr, c->io_buf + c->delta, c->len, stream);
  else drv->memcpy_dtoh_async(c->io_buf + c->delta, dptr, c->len, stream);
  wait_for_stream(*drv, stream);
}

// AUTO mode, device buffers: GPUDirect Storage through cuFile when it loads,
// the slab is O_DIRECT, the chunk is aligned and no checksum is wanted (that
// needs the bytes on the host). Any cuFile failure switches it off for this
// engine (one warning) and the staged path takes over, which reports real
// disk errors itself.
bool Engine::Impl::try_cufile(Chunk* c) {
  if (opt.backend != BackendKind::kAuto || !opt.try_cufile || opt.checksum || cufile_off.load() ||
      !c->slab->direct() || c->len % c->slab->offset_align() != 0)
    return false;
  auto* cf = mem::cufile::cufile();
  if (cf == nullptr) {
    cufile_off = true;
    return false;
  }
  try {
    mem::cufile::Handle h = 0;
    {
      std::lock_guard lock(cufile_mu);
      if (cufile_handles[c->slab_index] == 0) cufile_handles[c->slab_index] = cf->handle_register(c->slab->fd());
      h = cufile_handles[c->slab_index];
    }
    auto* drv = cuda();
    const auto dptr = static_cast<mem::cuda::DevicePtr>(reinterpret_cast<uintptr_t>(c->user));
    drv->bind_context_of(dptr);
    // cuFile is not stream-ordered: wait until the work queued on the caller's
    // stream is done, both before a write (the data must be produced) and
    // before a read (the buffer may still be in use by kernels queued there,
    // e.g. memory the caching allocator just handed out again).
    wait_for_stream(*drv, c->req->buf.stream);
    size_t n = c->req->write ? cf->write(h, c->user, c->len, static_cast<int64_t>(c->file_off))
                             : cf->read(h, c->user, c->len, static_cast<int64_t>(c->file_off));
    if (n != c->len)
      throw IoError(EIO, c->slab->label(), static_cast<int64_t>(c->file_off),
                    ebbtide::detail::concat("cuFile moved ", n, " of ", c->len, " bytes"));
    return true;
  } catch (const std::exception& e) {
    cufile_off = true;
    log::warn_once("cufile-fallback", ebbtide::detail::concat("io: cuFile failed (", e.what(),
                                                              "); using pinned staging for device buffers"));
    return false;
  }
}

}  // namespace ebbtide::io
