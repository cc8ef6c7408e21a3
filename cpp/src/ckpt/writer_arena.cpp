// The snapshot arena (Note [Save pipeline] in writer.cpp): its growth and
// pages, the copies of a save's blobs into it and its registration with the
// transfer loop.
//
// Note [Framed blobs]
// A blob may carry `head` and `tail` bytes that are stored around its data,
// contiguously, as one blob: the DCP storage plugin (python/ebbtide/dcp.py)
// frames each tensor's storage with the bytes torch.save writes around it, so
// that an uncompressed item is a torch.load-able byte range of the shard file
// (Note [DCP layout] there). The write path sees ordinary blobs of
// stored_nbytes(); copy_stored() gathers any byte range of that stored form
// from head, data and tail, so a framed blob is snapshotted or pipelined like
// any other (a chunk may begin in the head or end in the tail).
#include "writer_impl.hpp"

#include <algorithm>
#include <cstring>

#include <sys/mman.h>

#include "ebbtide/mem/stream_copy.hpp"
#include "ebbtide/util/crc32c.hpp"

namespace ebbtide::ckpt {

void copy_stored(const BlobSource& b, uint64_t off, uint64_t n, char* dst, uint32_t* crc,
                 mem::cuda::Driver* drv) {
  struct Part {
    const char* src;
    uint64_t len;
    bool device;
  };
  const Part parts[] = {{b.head.data(), b.head.size(), false},
                        {static_cast<const char*>(b.data.ptr), b.data.nbytes, b.data.on_device()},
                        {b.tail.data(), b.tail.size(), false}};
  uint64_t start = 0;
  for (const auto& [src, len, device] : parts) {
    const uint64_t lo = std::max(off, start), hi = std::min(off + n, start + len);
    if (lo < hi && device) {
      const auto dev = reinterpret_cast<mem::cuda::DevicePtr>(src) + (lo - start);
      drv->bind_context_of(dev);
      drv->memcpy_dtoh_async(dst + (lo - off), dev, hi - lo, b.data.stream);
      drv->stream_synchronize(b.data.stream);
      if (crc != nullptr) *crc = crc32c(dst + (lo - off), hi - lo, *crc);
    } else if (lo < hi) {
      mem::stream_copy(dst + (lo - off), src + (lo - start), hi - lo);  // read back only by the disk
      if (crc != nullptr) *crc = crc32c(src + (lo - start), hi - lo, *crc);
    }
    start += len;
  }
}

// Note [Arena pages]
// The arena's first `huge_bytes` (the ring a synchronous save writes
// through, Note [Save ring]) are advised onto 2 MiB pages: this VM's
// virtio-blk takes a write from huge pages in far fewer pieces (1.15x
// faster steady saves). The rest, which only saves that snapshot first
// (async ones) touch, stays on 4 KiB pages: the async save's caller faults
// it in during the copy, and with MADV_HUGEPAGE (defrag=madvise: direct
// compaction in the fault) a fresh 1.3 GB took 2.2-3.2 s there against
// 0.3-0.4 s on small pages, which made the first async save in a process
// block 3x as long as a synchronous one. Its writes run in the background.
void CheckpointWriter::Impl::ensure_arena(uint64_t bytes, uint64_t huge_bytes) {
  uint64_t segs = std::max<uint64_t>(1, (bytes + kSegmentBytes - 1) / kSegmentBytes);
  if (arena && arena_segments() >= segs) return;
  loop.reset();  // its registered buffers are the old arena's
  arena = mem::HostMapping();  // unmapped before the larger one is mapped
  arena_used = false;
  // Registered with CUDA only when a save has device blobs (snapshot()):
  // CPU-only checkpoints never initialise CUDA. The compressed-chunk ring is
  // filled from the arena, never by device copies.
  arena_bytes = 0;
  arena = mem::HostMapping(segs * kSegmentBytes, "checkpoint snapshot arena", false, /*huge=*/true);
  arena_bytes = arena.size();
  const uint64_t huge = align_up(std::max<uint64_t>(huge_bytes, 1), kSegmentBytes);
  if (arena.size() > huge)  // advice only (Note [Arena pages])
    (void)::madvise(static_cast<char*>(arena.data()) + huge, arena.size() - huge, MADV_NOHUGEPAGE);
  mem::PinnedPoolOptions host_only;
  host_only.cuda_register = false;
  if (!staging) staging = std::make_unique<mem::PinnedPool>(staging_buffer_bytes(), staging_count(), host_only);
}

// Note [First async save]
// An async save snapshots the whole state into the arena, and the first
// one in a process finds no arena of that size: its caller would fault in
// a state's worth of fresh memory inside the copy (on the 2-core VM,
// 0.3-2.6 s per GB: the hypervisor backs each new page), which made it
// block 3x as long as a synchronous save. So checkpoint.py saves an async
// request the arena cannot hold as a pipelined one (through the ring, as
// a synchronous save does) and returns once its sources are read: every
// chunk copied into the ring (SaveHandle::wait_copied(); the last writes,
// the header and the syncs go on without them); its `reserve_arena` then has this thread,
// after the save is done, grow the arena to the state's size and fault it
// in (MADV_POPULATE_WRITE), off the caller's path. The next async save
// copies into present memory. A later save waits for the growth to end
// (join_bg()), as it waits for any earlier save's thread.
void CheckpointWriter::Impl::reserve(uint64_t bytes, uint64_t huge_bytes) {
  ensure_arena(bytes, huge_bytes);
  if (::madvise(arena.data(), arena.size(), MADV_POPULATE_WRITE) != 0) {  // Linux 5.14+; else: touch
    auto* p = static_cast<volatile char*>(arena.data());
    for (uint64_t o = 0; o < arena.size(); o += 4096) p[o] = 0;
  }
  arena_used = false;
}

// Host copies in pieces of <= 8 MiB over the workers, with mem::stream_copy's
// streaming stores.
void CheckpointWriter::Impl::copy_host(const std::vector<HostCopy>& copies) {
  struct Piece {
    const char* src;
    char* dst;
    uint64_t n;
  };
  std::vector<Piece> pieces;
  constexpr uint64_t kPiece = 8ull << 20;
  for (const auto& c : copies)
    for (uint64_t o = 0; o < c.nbytes; o += kPiece)
      pieces.push_back({static_cast<const char*>(c.src) + o, static_cast<char*>(c.dst) + o,
                        std::min(kPiece, c.nbytes - o)});
  workers.parallel_for(pieces.size(), [&](size_t k) { mem::stream_copy(pieces[k].dst, pieces[k].src, pieces[k].n); });
}

// Copies every blob into the arena (with `copy`; else the write's workers
// copy, Note [Pipelined save]); returns the arena offset of each.
std::vector<BlobPlan> CheckpointWriter::Impl::snapshot(const SaveRequest& req, bool copy) {
  std::vector<BlobPlan> plan(req.blobs.size());
  uint64_t off = 0;
  for (size_t i = 0; i < req.blobs.size(); ++i) {
    const auto& b = req.blobs[i];
    EBB_CHECK(b.data.ptr != nullptr || b.data.nbytes == 0, "blob '", b.name, "' has a null pointer and ", b.data.nbytes,
              " bytes");
    EBB_CHECK(b.elem_bytes > 0, "blob '", b.name, "' has element size 0");
    plan[i].arena_offset = off;
    off += align_up(b.stored_nbytes(), kBlockBytes);
  }
  ensure_arena(copy ? off : std::min(off, ring_bytes(req)), ring_bytes(req));  // Note [Save ring]
  ring_driver = nullptr;
  if (!copy) {  // the workers copy device bytes into the ring: page-locked for async copies
    for (const auto& b : req.blobs)
      if (b.data.on_device() && b.data.nbytes > 0) {
        ring_driver = need_driver(b);
        detail::CallerContext caller;  // Note [Pinning context] in shard_io.hpp
        caller.take(ring_driver);
        ring_driver->bind_context_of(reinterpret_cast<mem::cuda::DevicePtr>(b.data.ptr));
        arena.pin(ring_driver);
        break;
      }
    return plan;
  }
  auto* base = static_cast<char*>(arena.data());
  // Device copies are queued first so they run while the host copies do,
  // each with its blob's device current, and each (context, stream) is
  // waited for once after (detail::StreamWaits: handle 0 is each device's
  // own default stream). The caller's context is restored after (Note
  // [Caller's context] in tensor_cache.cpp), and on any error every queued
  // copy is waited for before the arena can be reused or unmapped.
  detail::CallerContext caller;
  detail::StreamWaits device_copies;
  for (size_t i = 0; i < req.blobs.size(); ++i) {
    const auto& b = req.blobs[i];
    if (!b.data.on_device() || b.data.nbytes == 0) continue;
    mem::cuda::Driver* drv = need_driver(b);
    caller.take(drv);
    drv->bind_context_of(reinterpret_cast<mem::cuda::DevicePtr>(b.data.ptr));
    arena.pin(drv);  // async device copies need page-locked memory (Note [Pinning context])
    drv->memcpy_dtoh_async(base + plan[i].arena_offset + b.head.size(), reinterpret_cast<mem::cuda::DevicePtr>(b.data.ptr),
                           b.data.nbytes, b.data.stream);
    device_copies.add(drv, b.data.stream);
  }
  std::vector<HostCopy> host;
  for (size_t i = 0; i < req.blobs.size(); ++i) {
    const auto& b = req.blobs[i];
    char* dst = base + plan[i].arena_offset;
    const uint64_t stored = b.stored_nbytes(), padded = align_up(stored, kBlockBytes);
    if (padded > stored) std::memset(dst + stored, 0, padded - stored);
    copy_stored(b, 0, b.head.size(), dst);  // Note [Framed blobs]
    copy_stored(b, b.head.size() + b.data.nbytes, b.tail.size(), dst + b.head.size() + b.data.nbytes);
    dst += b.head.size();
    if (!b.data.on_device()) host.push_back({dst, b.data.ptr, b.data.nbytes});
  }
  copy_host(host);
  device_copies.synchronize();
  return plan;
}

// Note [Staging buffer]
// DCP's async_save copies the state before it returns ("staging"), and the
// plugin's upload then writes from that copy through the save ring. The
// copy lands in memory the writer keeps across saves, as a native async
// save's snapshot lands in the arena: reserve_staging() maps it and faults
// every page in on a thread the caller chooses (the plugin's filler thread,
// after a first async_save that had nowhere to stage and was written
// through, Note [First DCP async save] in checkpoint/dcp_staging.py), so no
// async_save pays for fresh memory (0.3-2.6 s per GB on the 2-core VM), and
// a later one never waits for that fill: it finds the buffer ready, or
// writes through again. Views of the buffer (the staged tensors) share its
// ownership, so a larger reserve never unmaps memory a staged copy lies in.
// stage() copies as snapshot() does: device sources with cuMemcpyDtoHAsync
// on their streams into the buffer (page-locked for that once, in the
// context of the device copied from), host sources over the workers.
StagingBuffer CheckpointWriter::reserve_staging(uint64_t bytes, int device) {
  EBB_CHECK(bytes > 0, "checkpoint staging buffer: 0 bytes requested");
  auto buf = std::make_shared<mem::HostMapping>(bytes, "checkpoint staging buffer", /*populate=*/true);
  if (device >= 0) {
    mem::cuda::Driver* drv = detail::device_driver(options_.cuda_driver, "the staged state is in CUDA device memory");
    mem::cuda::DeviceScope scope(drv, device);  // Note [Pinning context] in shard_io.hpp
    buf->pin(drv);
  }
  std::lock_guard lock(impl_->staging_mu);
  impl_->staging_buf = buf;
  return buf;
}

void CheckpointWriter::Impl::stage(const std::vector<StageCopy>& copies) {
  detail::CallerContext caller;
  detail::StreamWaits device_copies;  // waited for on any error too
  std::vector<HostCopy> host;
  for (const auto& c : copies) {
    if (c.src.nbytes == 0) continue;
    if (!c.src.on_device()) {
      host.push_back({c.dst, c.src.ptr, c.src.nbytes});
      continue;
    }
    mem::cuda::Driver* drv =
        detail::device_driver(opt.cuda_driver, "a staged tensor is in CUDA device memory");
    caller.take(drv);
    drv->bind_context_of(reinterpret_cast<mem::cuda::DevicePtr>(c.src.ptr));
    {
      std::lock_guard lock(staging_mu);
      const auto* base = staging_buf ? static_cast<const char*>(staging_buf->data()) : nullptr;
      const auto* dst = static_cast<const char*>(c.dst);
      EBB_CHECK(base != nullptr && dst >= base && dst + c.src.nbytes <= base + staging_buf->size(),
                "checkpoint staging: a device copy of ", c.src.nbytes,
                " bytes must land in the writer's staging buffer (reserve_staging)");
      staging_buf->pin(drv);  // asynchronous copies need page-locked memory
    }
    drv->memcpy_dtoh_async(c.dst, reinterpret_cast<mem::cuda::DevicePtr>(c.src.ptr), c.src.nbytes, c.src.stream);
    device_copies.add(drv, c.src.stream);
  }
  copy_host(host);
  device_copies.synchronize();
}

// Note [Fresh arena]
// Registering buffers with io_uring pins them, and pinning faults in every
// page on the calling thread before the first write can start: for a fresh
// 1 GB arena on huge pages that was 2.3 s of a 2.8 s first save on the
// 2-core VM (strace). So a pipelined save from an arena no save has written
// from yet submits its arena writes unregistered: the workers' copies fault
// the pages in, chunk by chunk, beside the writes. The next save registers
// the arena, whose pages are then present (and pin in milliseconds). Saves
// that snapshot first (async ones) have touched their part of the arena
// before the write starts, so they register at once.
void CheckpointWriter::Impl::ensure_loop(unsigned depth, bool with_arena) {
  if (loop && loop_depth == depth && loop_has_arena == with_arena) return;
  loop.reset();
  std::vector<iovec> fixed;
  auto* base = static_cast<char*>(arena.data());
  if (with_arena)
    for (uint64_t i = 0; i < arena_segments(); ++i) fixed.push_back({base + i * kSegmentBytes, kSegmentBytes});
  for (const iovec& b : detail::buffers_of(*staging)) fixed.push_back(b);
  loop = std::make_unique<io::TransferLoop>(depth, fixed, opt.backend, "checkpoint");
  loop_depth = depth;
  loop_has_arena = with_arena;
}

}  // namespace ebbtide::ckpt
