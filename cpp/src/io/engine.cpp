// The storage engine's workers and requests: opening the slabs and one
// TransferLoop per block device, splitting requests into chunks, the worker
// loop that stages, transfers and completes them, and cancellation. The slot
// table is in engine_slots.cpp, the striping in striping.cpp, device buffers
// in engine_device_copy.cpp.
//
// Note [Staging and direct user buffers]
//   With O_DIRECT a chunk can go straight from/to the user's buffer when its
//   address is aligned to the slab's memory alignment and its length to the
//   offset alignment; otherwise (unaligned pointer, ragged tail) it goes
//   through a page-aligned staging buffer, registered with io_uring (fixed
//   buffers). Buffered slabs (tmpfs fallback) always use the user's buffer.
//   Staging is bounded (staging_bytes); a worker that finds none free waits
//   for its own in-flight chunks to return theirs.
#include "engine_impl.hpp"

#include <algorithm>
#include <map>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io {

namespace {
bool aligned_to(const void* p, uint64_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }
}  // namespace

using detail::ReqPtr;
using detail::RequestState;

Engine::Impl::Impl(EngineOptions o) : opt(std::move(o)) {
  EBB_CHECK(!opt.dirs.empty(), "the storage engine needs at least one directory");
  EBB_CHECK(opt.queue_depth >= 1 && opt.queue_depth <= 4096, "queue_depth ", opt.queue_depth,
            " is out of range [1, 4096]");
  EBB_CHECK(opt.chunk_bytes >= 4096 && opt.chunk_bytes <= (1ull << 30), "chunk_bytes ", opt.chunk_bytes,
            " is out of range [4 KiB, 1 GiB]");
  EBB_CHECK(opt.slab_grow_bytes > 0, "slab_grow_bytes must be positive");
  EBB_CHECK(opt.staging_bytes > 0, "staging_bytes must be positive");

  for (const auto& dir : opt.dirs) {
    slabs.push_back(DirectFile::create_anonymous(dir, opt.direct));
    const auto& s = *slabs.back();
    align = std::max({align, s.mem_align(), s.offset_align()});
    if (s.direct()) {
      dio_align = std::max(dio_align, s.offset_align());
      io_align = std::max({io_align, s.mem_align(), s.offset_align()});
    }
    all_direct = all_direct && s.direct();
  }
  EBB_CHECK(opt.chunk_bytes % align == 0, "chunk_bytes ", opt.chunk_bytes,
            " is not a multiple of the I/O alignment ", align);
  grow_step = (opt.slab_grow_bytes + opt.chunk_bytes - 1) / opt.chunk_bytes * opt.chunk_bytes;
  if (opt.capacity_bytes > 0) {
    slab_limit = opt.capacity_bytes / opt.chunk_bytes * opt.chunk_bytes;
    EBB_CHECK(slab_limit > 0, "capacity_bytes ", opt.capacity_bytes, " is smaller than chunk_bytes ",
              opt.chunk_bytes);
  }
  alloc = detail::SlotAllocator(align);

  size_t nstaging = std::max<uint64_t>(1, opt.staging_bytes / opt.chunk_bytes);
  mem::PinnedPoolOptions po;
  po.cuda_register = opt.cuda_register;
  po.driver = opt.cuda_driver;
  staging = std::make_unique<mem::PinnedPool>(opt.chunk_bytes, nstaging, po);
  cufile_handles.assign(slabs.size(), 0);

  std::map<dev_t, Device*> by_dev;
  for (auto& s : slabs) {
    auto it = by_dev.find(s->device());
    if (it == by_dev.end()) {
      devices.push_back(std::make_unique<Device>());
      devices.back()->dev = s->device();
      it = by_dev.emplace(s->device(), devices.back().get()).first;
    }
    it->second->slabs.push_back(s.get());
    slab_device.push_back(it->second);
  }

  // One backend kind for every device: what AUTO picks for the first holds
  // for all, and a device refusing it sends all of them to POSIX.
  std::vector<iovec> fixed(staging->count());
  for (size_t i = 0; i < fixed.size(); ++i) fixed[i] = {staging->buffer(i), staging->buffer_bytes()};
  try {
    for (auto& d : devices) {
      const BackendKind k = &d == &devices.front() ? opt.backend : devices.front()->loop->backend();
      d->loop = std::make_unique<TransferLoop>(opt.queue_depth, fixed, k, "io");
    }
  } catch (const Unsupported&) {
    if (opt.backend != BackendKind::kAuto) throw;
    log::info("io: backend auto -> posix (io_uring refused on a second device)");
    for (auto& d : devices) d->loop = std::make_unique<TransferLoop>(opt.queue_depth, fixed, BackendKind::kPosix, "io");
  }
  kind = devices.front()->loop->backend();
  st.backend = std::string(to_string(kind));
  st.alignment = dio_align ? dio_align : align;
  st.direct = all_direct;

  for (auto& d : devices) {
    Device* dp = d.get();
    dp->thread = std::thread([this, dp] { run_device(*dp); });
  }
}

Engine::Impl::~Impl() {
  shutdown();
  if (std::any_of(cufile_handles.begin(), cufile_handles.end(), [](auto h) { return h != 0; })) {
    auto* cf = mem::cufile::cufile();  // loaded already: handles exist
    for (auto h : cufile_handles) {
      if (h == 0) continue;
      try {
        cf->handle_deregister(h);
      } catch (const std::exception& e) {
        log::warn("io: cuFile handle deregistration failed: ", e.what());
      }
    }
  }
}

void Engine::Impl::shutdown() {
  for (auto& d : devices) {
    {
      std::lock_guard lock(d->mu);
      d->stop = true;
    }
    d->cv.notify_all();
  }
  for (auto& d : devices)
    if (d->thread.joinable()) d->thread.join();
}

std::string Engine::Impl::describe() const {
  std::string b = devices.empty() || !devices[0]->loop ? "?" : devices[0]->loop->describe();
  return ebbtide::detail::concat("ebbtide io engine: ", b, ", ", slabs.size(), " dir(s) on ", devices.size(),
                        " device(s), chunk ", config::format_bytes(static_cast<double>(opt.chunk_bytes)),
                        ", ", all_direct ? "O_DIRECT" : "buffered I/O on some dirs", " (align ",
                        st.alignment, "), staging ", staging->count(), " x ",
                        config::format_bytes(static_cast<double>(staging->buffer_bytes())),
                        ", checksum ", opt.checksum ? "crc32c" : "off");
}

Engine::Impl::Start Engine::Impl::start(Device& d, Chunk* c) {
  RequestState& rq = *c->req;
  if (rq.write) {
    int expected = detail::kQueued;
    if (!rq.phase.compare_exchange_strong(expected, detail::kStarted) && expected == detail::kCancelled) {
      complete_chunk(c, nullptr);
      return Start::kDone;
    }
  }
  const auto& slab = *c->slab;
  if (c->device && try_cufile(c)) {  // synchronous GPUDirect transfer, done
    complete_chunk(c, nullptr);
    return Start::kDone;
  }
  const bool use_user = !c->device && (!slab.direct() || (c->delta == 0 && aligned_to(c->user, slab.mem_align()) &&
                                                          c->len % slab.offset_align() == 0));
  if (use_user) {
    c->io_buf = c->user;
    c->io_len = c->len;
    c->delta = 0;
  } else {
    if (d.loop->in_flight() > 0) {
      auto lease = staging->try_acquire();
      if (!lease) return Start::kNoStaging;
      c->lease = std::move(*lease);
    } else {
      c->lease = staging->acquire();
    }
    c->staging = static_cast<int>(staging->index_of(c->lease));
    c->io_buf = static_cast<char*>(c->lease.data());
    if (!c->device) bytes_staged.fetch_add(c->len, std::memory_order_relaxed);
  }
  if (rq.write && c->device) {  // device -> pinned staging on the caller's stream
    try {
      copy_device(c, false);
    } catch (...) {
      complete_chunk(c, std::current_exception());
      return Start::kDone;
    }
    pad_staging(c);
  }
  if (rq.write) {
    if (c->staging >= 0 && !c->device) {
      std::memcpy(c->io_buf + c->delta, c->user, c->len);
      pad_staging(c);
    }
    if (opt.checksum) rq.crcs[c->index] = crc32c(c->io_buf + c->delta, c->len);
  }
  d.loop->start(*c->slab, rq.write, c->io_buf, c->io_len, c->file_off - c->delta, c->staging,
                [this, c](std::exception_ptr err) { on_transferred(c, std::move(err)); });
  return Start::kSubmitted;
}

// The chunk's disk transfer has ended: verify and copy out what was read.
void Engine::Impl::on_transferred(Chunk* c, std::exception_ptr err) {
  if (err) {
    complete_chunk(c, std::move(err));
    return;
  }
  const bool write = c->req->write;
  if (!write) {
    if (opt.checksum) {
      uint32_t expected = c->req->crcs[c->index];
      uint32_t actual = crc32c(c->io_buf + c->delta, c->len);
      if (actual != expected) {
        complete_chunk(c, std::make_exception_ptr(ChecksumError(c->slab->label(),
                                                                static_cast<int64_t>(c->file_off), expected, actual)));
        return;
      }
    }
    if (c->device) {  // pinned staging -> device on the caller's stream
      try {
        copy_device(c, true);
      } catch (...) {
        complete_chunk(c, std::current_exception());
        return;
      }
    } else if (c->staging >= 0) {
      std::memcpy(c->user, c->io_buf + c->delta, c->len);
    }
  }
  complete_chunk(c, nullptr);
}

void Engine::Impl::complete_chunk(Chunk* c, std::exception_ptr err) {
  if (c->staging >= 0) c->lease.reset();
  ReqPtr req = std::move(c->req);
  delete c;
  if (err) {
    std::lock_guard lock(req->mu);
    if (!req->error) req->error = std::move(err);
  }
  if (req->remaining.fetch_sub(1) == 1) finalize(req);
}

void Engine::Impl::run_device(Device& d) {
  std::vector<Chunk*> batch;
  TransferLoop& loop = *d.loop;
  const unsigned qd = opt.queue_depth;
  for (;;) {
    batch.clear();
    {
      std::unique_lock lock(d.mu);
      if (loop.in_flight() == 0)
        d.cv.wait(lock, [&] { return d.stop || !d.loads.empty() || !d.stores.empty(); });
      if (loop.in_flight() == 0 && d.stop && d.loads.empty() && d.stores.empty()) return;
      while (loop.in_flight() + batch.size() < qd) {  // loads first: backward waits on them
        auto& q = !d.loads.empty() ? d.loads : d.stores;
        if (q.empty()) break;
        batch.push_back(q.front());
        q.pop_front();
      }
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      if (start(d, batch[i]) == Start::kNoStaging) {  // give the rest back, in order
        std::lock_guard lock(d.mu);
        for (size_t j = batch.size(); j-- > i;) {
          Chunk* c = batch[j];
          (c->req->write ? d.stores : d.loads).push_front(c);
        }
        break;
      }
    }
    try {
      loop.flush();
    } catch (const std::exception& e) {
      log::error("io: submitting to ", loop.name(), " failed: ", e.what(), "; retrying");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (loop.in_flight() > 0) {
      try {
        loop.reap(true);
      } catch (const std::exception& e) {
        log::error("io: waiting for completions failed: ", e.what(), "; retrying");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }
}

ReqPtr Engine::Impl::submit(SlotId slot, const mem::Buffer& b, Callback cb, bool write) {
  const char* what = write ? "write" : "read";
  EBB_CHECK(b.nbytes > 0, what, " of slot ", slot, ": size must be positive (got 0 bytes)");
  EBB_CHECK(b.ptr != nullptr, what, " of slot ", slot, ": buffer pointer is null");
  if (b.on_device() && cuda() == nullptr)
    throw Unsupported(ebbtide::detail::concat(what, " of slot ", slot, ": device buffer given but CUDA is unavailable (",
                                              mem::cuda::unavailable_reason(), ")"));
  auto req = std::make_shared<RequestState>();
  req->slot = slot;
  req->nbytes = b.nbytes;
  req->write = write;
  req->buf = b;
  req->on_done = std::move(cb);
  uint64_t base = 0;
  {
    std::lock_guard lock(mu);
    EBB_CHECK_STATE(!closing, what, " of slot ", slot, ": the engine is closed");
    auto it = slots.find(slot);
    EBB_CHECK_STATE(it != slots.end() && !it->second.free_pending, what, " of slot ", slot,
                    ": unknown or already freed slot");
    SlotMeta& m = it->second;
    EBB_CHECK_STATE(!m.writing, what, " of slot ", slot, ": a write to this slot is still in flight");
    if (write) {
      EBB_CHECK(b.nbytes <= m.extent.length - m.phase, "write of ", b.nbytes, " bytes does not fit slot ", slot,
                " (capacity ", m.extent.length - m.phase, " bytes)");
      EBB_CHECK_STATE(m.readers == 0, "write of slot ", slot, ": ", m.readers, " read(s) of it still in flight");
      m.writing = true;
      st.bytes_stored -= m.stored;
      m.stored = 0;
      m.crcs.clear();
      m.pending_write = req;
    } else {
      EBB_CHECK_STATE(m.stored > 0, "read of slot ", slot, ": the slot was never written (or its last write failed)");
      EBB_CHECK(b.nbytes == m.stored, "read of slot ", slot, ": buffer holds ", b.nbytes,
                " bytes but the slot stores ", m.stored);
      ++m.readers;
      req->crcs = m.crcs;
    }
    base = m.extent.offset + m.phase;
    ++st.pending;
  }

  std::vector<Chunk*> pieces = split(req, base);
  if (write && opt.checksum) req->crcs.assign(pieces.size(), 0);
  req->remaining = static_cast<uint32_t>(pieces.size());
  // Group by device (few devices: a linear scan is fine).
  for (auto& dev : devices) {
    std::vector<Chunk*> mine;
    for (Chunk* c : pieces)
      if (c->dev == dev.get()) mine.push_back(c);
    if (mine.empty()) continue;
    {
      std::lock_guard lock(dev->mu);
      for (Chunk* c : mine) (write ? dev->stores : dev->loads).push_back(c);
    }
    dev->cv.notify_one();
  }
  return req;
}

bool Engine::Impl::cancel(const ReqPtr& req) {
  if (!req || !req->write) return false;
  int expected = detail::kQueued;
  if (!req->phase.compare_exchange_strong(expected, detail::kCancelled)) return false;
  std::vector<Chunk*> removed;
  for (auto& d : devices) {
    std::lock_guard lock(d->mu);
    auto& q = d->stores;
    for (auto it = q.begin(); it != q.end();) {
      if ((*it)->req == req) {
        removed.push_back(*it);
        it = q.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Chunk* c : removed) complete_chunk(c, nullptr);
  return true;
}

// ---------------------------------------------------------------- Engine API

Engine::Engine(EngineOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

Engine::~Engine() {
  try {
    close();
  } catch (const std::exception& e) {
    log::error("io: closing the engine failed: ", e.what());
  }
}

Request Engine::write(SlotId slot, const mem::Buffer& src, Callback on_done) {
  return Request(impl_->submit(slot, src, std::move(on_done), true));
}

Request Engine::read(SlotId slot, const mem::Buffer& dst, Callback on_done) {
  return Request(impl_->submit(slot, dst, std::move(on_done), false));
}

bool Engine::cancel(const Request& request) { return impl_->cancel(request.state()); }

void Engine::drain() {
  auto& I = *impl_;
  std::unique_lock lock(I.mu);
  I.drain_cv.wait(lock, [&] { return I.st.pending == 0; });
}

void Engine::close() {
  auto& I = *impl_;
  std::vector<ReqPtr> writes;
  {
    std::lock_guard lock(I.mu);
    if (I.closing) return;
    I.closing = true;
    for (auto& [id, m] : I.slots)
      if (m.pending_write) writes.push_back(m.pending_write);
  }
  for (auto& w : writes) I.cancel(w);
  drain();
  I.shutdown();
  std::lock_guard lock(I.mu);
  I.closed = true;
}

bool Engine::closed() const {
  std::lock_guard lock(impl_->mu);
  return impl_->closed;
}

uint64_t Engine::io_alignment() const { return impl_->io_align > 1 ? impl_->io_align : 1; }

BackendKind Engine::backend() const { return impl_->kind; }
const EngineOptions& Engine::options() const { return impl_->opt; }
std::string Engine::describe() const { return impl_->describe(); }

}  // namespace ebbtide::io
