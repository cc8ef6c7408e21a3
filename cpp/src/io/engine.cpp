// The storage engine. Layout:
//  - Slab files (anonymous DirectFiles), one per directory, form one logical space striped
//    RAID0-style in chunk_bytes units: logical offset L lives in slab
//    (L / chunk) % N at file offset ((L / chunk) / N) * chunk + L % chunk.
//  - SlotAllocator hands out aligned extents of that logical space.
//  - A request is split at stripe boundaries into chunks; each chunk goes to
//    the worker of the block device holding its slab. A worker keeps up to
//    queue_depth chunks in flight on its TransferLoop (io_uring ring or POSIX
//    threads; Note [Transfer loop] in transfer.cpp), taking loads before stores.
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
//
// Note [Staging and direct user buffers]
//   With O_DIRECT a chunk can go straight from/to the user's buffer when its
//   address is aligned to the slab's memory alignment and its length to the
//   offset alignment; otherwise (unaligned pointer, ragged tail) it goes
//   through a page-aligned staging buffer, registered with io_uring (fixed
//   buffers). Buffered slabs (tmpfs fallback) always use the user's buffer.
//   Staging is bounded (staging_bytes); a worker that finds none free waits
//   for its own in-flight chunks to return theirs.
//
// Note [Slot phase]
//   Buffers the caller does not control (torch's CPU tensors are 64-byte
//   aligned) would all go through staging. allocate(n, like) therefore starts
//   the slot's data `phase` = like % io_align bytes into its aligned extent, and
//   every request is cut at io_align boundaries of the file: a head piece up
//   to the first boundary, an aligned middle, a tail piece after the last.
//   When the buffer shares the slot's phase, the middle moves in place with
//   O_DIRECT and only the head and tail (< io_align bytes each) are staged,
//   padded with the extent's own slack; otherwise everything is staged as
//   before. The cut depends only on the slot, so per-chunk checksums of a
//   write line up with any later read.
#include "ebbtide/io/engine.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "ebbtide/io/detail/engine_testing.hpp"
#include "ebbtide/io/detail/slot_allocator.hpp"
#include "ebbtide/io/direct_file.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/cufile_shim.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/crc32c.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io {

namespace detail {

enum Phase : int { kQueued = 0, kStarted = 1, kCancelled = 2 };

struct RequestState {
  SlotId slot = 0;
  uint64_t nbytes = 0;
  bool write = false;
  Buffer buf;
  Callback on_done;
  std::atomic<int> phase{kQueued};
  std::atomic<uint32_t> remaining{0};
  std::vector<uint32_t> crcs;  // write: computed per chunk; read: expected
  std::mutex mu;
  std::condition_variable cv;
  bool done = false, finished = false, was_cancelled = false;
  std::exception_ptr error;
};

}  // namespace detail

// ---------------------------------------------------------------- Request

bool Request::done() const {
  EBB_CHECK(s_, "Request is empty");
  std::lock_guard lock(s_->mu);
  return s_->done;
}

void Request::wait() const {
  EBB_CHECK(s_, "Request is empty");
  std::unique_lock lock(s_->mu);
  s_->cv.wait(lock, [&] { return s_->finished; });
  if (s_->error) std::rethrow_exception(s_->error);
}

bool Request::ok() const {
  EBB_CHECK(s_, "Request is empty");
  std::lock_guard lock(s_->mu);
  return s_->done && !s_->error;
}

bool Request::cancelled() const {
  EBB_CHECK(s_, "Request is empty");
  std::lock_guard lock(s_->mu);
  return s_->done && s_->was_cancelled;
}

std::exception_ptr Request::error() const {
  EBB_CHECK(s_, "Request is empty");
  std::lock_guard lock(s_->mu);
  return s_->error;
}

SlotId Request::slot() const { return s_ ? s_->slot : 0; }
uint64_t Request::nbytes() const { return s_ ? s_->nbytes : 0; }
bool Request::is_write() const { return s_ && s_->write; }

// ---------------------------------------------------------------- options

EngineOptions EngineOptions::with_env() const {
  EngineOptions o = *this;
  if (auto v = config::env_choice("EBBTIDE_IO_BACKEND"))
    o.backend = parse_backend(*v);
  if (auto v = config::env_bytes("EBBTIDE_IO_CHUNK_BYTES")) o.chunk_bytes = *v;
  if (auto v = config::env_int("EBBTIDE_IO_QUEUE_DEPTH")) o.queue_depth = static_cast<unsigned>(*v);
  if (auto v = config::env_bool("EBBTIDE_IO_CHECKSUM")) o.checksum = *v;
  if (auto v = config::env_bool("EBBTIDE_IO_DIRECT")) o.direct = *v;
  return o;
}

// ---------------------------------------------------------------- engine

namespace {

using detail::RequestState;
using ReqPtr = std::shared_ptr<RequestState>;

struct Chunk;
struct Device {
  dev_t dev = 0;
  std::vector<DirectFile*> slabs;
  std::unique_ptr<TransferLoop> loop;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Chunk*> loads, stores;
  bool stop = false;
  std::thread thread;
};

struct Chunk {
  ReqPtr req;
  uint32_t index = 0;
  DirectFile* slab = nullptr;
  size_t slab_index = 0;
  Device* dev = nullptr;
  uint64_t file_off = 0;
  char* user = nullptr;
  uint64_t len = 0;     // bytes of user data
  uint64_t io_len = 0;  // bytes moved (delta + len rounded up to the alignment on staging)
  uint64_t delta = 0;   // staging: the data starts this far into io_buf (file_off - delta is aligned)
  int staging = -1;  // index of `lease` in the pool (io_uring fixed buffer)
  mem::PinnedPool::Lease lease;
  char* io_buf = nullptr;
  bool device = false;  // `user` is a CUDA device address
};

struct SlotMeta {
  detail::Extent extent;
  uint64_t phase = 0;  // data starts this far into the extent (Note [Slot phase])
  uint64_t stored = 0;
  std::vector<uint32_t> crcs;
  bool writing = false;
  unsigned readers = 0;
  bool free_pending = false;
  ReqPtr pending_write;
};

bool aligned_to(const void* p, uint64_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

struct Engine::Impl {
  EngineOptions opt;
  BackendKind kind = BackendKind::kPosix;
  std::vector<std::unique_ptr<DirectFile>> slabs;
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> slab_device;
  std::unique_ptr<mem::PinnedPool> staging;
  std::mutex cufile_mu;
  std::vector<mem::cufile::Handle> cufile_handles;  // per slab, 0 = not registered
  std::atomic<bool> cufile_off{false};
  std::atomic<uint64_t> bytes_staged{0};  // host bytes that went through staging (stats)
  uint64_t align = 4096;      // slot alignment
  uint64_t dio_align = 0;     // largest O_DIRECT offset alignment (stats)
  uint64_t io_align = 0;      // largest O_DIRECT memory/offset alignment; 0: no direct slab
  uint64_t slab_limit = 0;    // per slab, 0 = none
  uint64_t grow_step = 0;
  uint64_t slab_size = 0;     // every slab holds at least this much
  bool all_direct = true;

  mutable std::mutex mu;
  std::condition_variable drain_cv;
  detail::SlotAllocator alloc{4096};
  std::unordered_map<SlotId, SlotMeta> slots;
  SlotId next_slot = 1;
  bool closing = false, closed = false;
  EngineStats st;

  explicit Impl(EngineOptions o);
  ~Impl();
  void shutdown();

  void grow_for(uint64_t nbytes);
  ReqPtr submit(SlotId slot, const Buffer& b, Callback cb, bool write);
  void run_device(Device& d);
  enum class Start { kSubmitted, kDone, kNoStaging };
  Start start(Device& d, Chunk* c);
  static void pad_staging(Chunk* c) {  // zero what the staged block holds besides the data
    std::memset(c->io_buf, 0, c->delta);
    std::memset(c->io_buf + c->delta + c->len, 0, c->io_len - c->delta - c->len);
  }
  void copy_device(Chunk* c, bool to_device);
  bool try_cufile(Chunk* c);
  void on_transferred(Chunk* c, std::exception_ptr err);
  void complete_chunk(Chunk* c, std::exception_ptr err);
  void finalize(const ReqPtr& req);
  void release_slot(std::unordered_map<SlotId, SlotMeta>::iterator it);
  bool cancel(const ReqPtr& req);
  std::string describe() const;
};

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

// Copies one chunk between the caller's device buffer and its pinned staging
// buffer on the caller's stream (so it is ordered after work already queued
// there), then waits for that copy only (an event, not the whole stream). The
// worker keeps up to queue_depth disk transfers in flight meanwhile, so the
// PCIe copy of chunk i+1 overlaps the disk transfer of chunk i.
void Engine::Impl::copy_device(Chunk* c, bool to_device) {
  auto* drv = mem::cuda::driver();
  EBB_ASSERT(drv != nullptr, "device chunk without a CUDA driver");
  const auto dptr = static_cast<mem::cuda::DevicePtr>(reinterpret_cast<uintptr_t>(c->user));
  const auto stream = static_cast<mem::cuda::Stream>(c->req->buf.stream);
  drv->bind_context_of(dptr);
  if (to_device) drv->memcpy_htod_async(dptr, c->io_buf + c->delta, c->len, stream);
  else drv->memcpy_dtoh_async(c->io_buf + c->delta, dptr, c->len, stream);
  auto ev = drv->event_create();
  try {
    drv->event_record(ev, stream);
    drv->event_synchronize(ev);
  } catch (...) {
    drv->event_destroy(ev);
    throw;
  }
  drv->event_destroy(ev);
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
    auto* drv = mem::cuda::driver();
    const auto dptr = static_cast<mem::cuda::DevicePtr>(reinterpret_cast<uintptr_t>(c->user));
    drv->bind_context_of(dptr);
    // cuFile is not stream-ordered: wait until the work queued on the caller's
    // stream is done, both before a write (the data must be produced) and
    // before a read (the buffer may still be in use by kernels queued there,
    // e.g. memory the caching allocator just handed out again).
    auto ev = drv->event_create();
    try {
      drv->event_record(ev, static_cast<mem::cuda::Stream>(c->req->buf.stream));
      drv->event_synchronize(ev);
    } catch (...) {
      drv->event_destroy(ev);
      throw;
    }
    drv->event_destroy(ev);
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

// Grows every slab so that `nbytes` more fit in the logical space. Engine lock held.
void Engine::Impl::grow_for(uint64_t nbytes) {
  const uint64_t n = slabs.size();
  const uint64_t short_by = alloc.shortfall(nbytes);
  if (short_by == 0) return;
  uint64_t per_slab = (short_by + n - 1) / n;
  per_slab = (per_slab + grow_step - 1) / grow_step * grow_step;
  uint64_t target = slab_size + per_slab;
  if (slab_limit && target > slab_limit) {
    uint64_t need = (short_by + n - 1) / n;
    need = (need + opt.chunk_bytes - 1) / opt.chunk_bytes * opt.chunk_bytes;
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
    uint64_t need = (short_by + n - 1) / n;
    need = (need + opt.chunk_bytes - 1) / opt.chunk_bytes * opt.chunk_bytes;
    if (e.err() != ENOSPC || slab_size + need >= target) throw;
    target = slab_size + need;
    for (auto& s : slabs) s->grow_to(target);
  }
  slab_size = target;
  alloc.grow(slab_size * n);
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

ReqPtr Engine::Impl::submit(SlotId slot, const Buffer& b, Callback cb, bool write) {
  const char* what = write ? "write" : "read";
  EBB_CHECK(b.nbytes > 0, what, " of slot ", slot, ": size must be positive (got 0 bytes)");
  EBB_CHECK(b.ptr != nullptr, what, " of slot ", slot, ": buffer pointer is null");
  if (b.kind == MemKind::kDevice && mem::cuda::driver() == nullptr)
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

  // Split at stripe boundaries, and at io_align boundaries around a head and
  // a tail (Note [Slot phase]); each piece goes to its device's queue.
  const uint64_t chunk = opt.chunk_bytes, n = slabs.size(), ia = io_align;
  std::vector<Chunk*> pieces;
  uint64_t pos = 0;
  while (pos < b.nbytes) {
    const uint64_t logical = base + pos;
    const uint64_t stripe = logical / chunk, within = logical % chunk;
    uint64_t len = std::min(chunk - within, b.nbytes - pos);
    if (ia > 1) {
      if (logical % ia != 0) len = std::min(len, ia - logical % ia);  // head
      else if (len >= ia) len -= len % ia;                              // aligned middle; tail next
    }
    auto* c = new Chunk();
    c->req = req;
    c->index = static_cast<uint32_t>(pieces.size());
    c->slab = slabs[stripe % n].get();
    c->dev = slab_device[stripe % n];
    c->slab_index = stripe % n;
    c->device = b.kind == MemKind::kDevice;
    c->file_off = (stripe / n) * chunk + within;
    c->user = static_cast<char*>(b.ptr) + pos;
    c->len = len;
    const uint64_t unit = ia > 1 ? ia : align;
    c->delta = c->file_off % unit;
    c->io_len = (c->delta + len + unit - 1) / unit * unit;
    pieces.push_back(c);
    pos += len;
  }
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

Request Engine::write(SlotId slot, const Buffer& src, Callback on_done) {
  return Request(impl_->submit(slot, src, std::move(on_done), true));
}

Request Engine::read(SlotId slot, const Buffer& dst, Callback on_done) {
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

uint64_t Engine::slot_capacity(SlotId slot) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->slots.find(slot);
  EBB_CHECK_STATE(it != impl_->slots.end() && !it->second.free_pending, "slot ", slot,
                  ": unknown or already freed slot");
  return it->second.extent.length - it->second.phase;
}

uint64_t Engine::io_alignment() const { return impl_->io_align > 1 ? impl_->io_align : 1; }

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

BackendKind Engine::backend() const { return impl_->kind; }
const EngineOptions& Engine::options() const { return impl_->opt; }
std::string Engine::describe() const { return impl_->describe(); }

// ---------------------------------------------------------------- test hooks

detail::SlotByteLocation detail::EngineTesting::locate(const Engine& engine, SlotId slot, uint64_t byte) {
  auto& I = *engine.impl_;
  std::lock_guard lock(I.mu);
  auto it = I.slots.find(slot);
  EBB_CHECK_STATE(it != I.slots.end(), "slot ", slot, ": unknown");
  const uint64_t logical = it->second.extent.offset + it->second.phase + byte;
  const uint64_t stripe = logical / I.opt.chunk_bytes, n = I.slabs.size();
  auto& slab = *I.slabs[stripe % n];
  return {slab.dir(), slab.fd(), (stripe / n) * I.opt.chunk_bytes + logical % I.opt.chunk_bytes};
}

void detail::EngineTesting::refuse_direct(bool refuse) { detail::set_refuse_direct_for_tests(refuse); }
void detail::EngineTesting::refuse_fallocate(bool refuse) { detail::set_refuse_fallocate_for_tests(refuse); }

}  // namespace ebbtide::io
