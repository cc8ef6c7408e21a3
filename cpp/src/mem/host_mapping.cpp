#include "ebbtide/mem/host_mapping.hpp"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/fork_origin.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::mem {

// Note [Pinned staging memory]
// Staging and snapshot memory is anonymous private mappings, not
// cudaHostAlloc memory: io_uring buffer registration (IORING_REGISTER_BUFFERS)
// pins pages itself and refuses driver-allocated pinned memory on some
// kernels, while an ordinary mapping that is then cuMemHostRegister'ed works
// for both. Registration is a separate step (pin()), taken only by callers
// that copy to or from a device, so CPU-only work never initialises CUDA.
//
// Note [Huge-page buffers]
// A block device may hold fewer requests at once when each request's memory
// is many physically separate pieces: virtio-blk without indirect descriptors
// spends one ring descriptor per piece, so 4 MiB from 4 KiB pages takes up to
// 1024 and the device runs near queue depth 1 (Note [Bench buffers] in
// io/bench.cpp). I/O buffers (`huge`) of 2 MiB and more are therefore
// aligned to 2 MiB and advised MADV_HUGEPAGE: the checkpoint writer's arena,
// every PinnedPool (the writers' staging rings, the readers' staging) and the
// I/O benchmark's buffers then reach the device in 2 MiB pieces. The host
// store's blobs (HostBufferPool) stay on small pages: they are sized to
// activations and come and go with them. Measured on the 2-core VM
// (docs/benchmarks-journal.md, 2026-11-24): steady safetensors saves 1.35x faster,
// ebbtide.checkpoint saves 1.15x, DCP plugin saves 1.07x. The price is on the
// first touch: a fresh huge page costs that VM's hypervisor more than 512
// small ones, and pinning a fresh 1 GB arena for io_uring (which faults it
// all in on one thread) made a process's first save 2.5-3.1 s instead of
// 0.9-1.3 s, until Note [Fresh arena] in ckpt/writer_arena.cpp. MADV_POPULATE_WRITE
// stands in for MAP_POPULATE, which would fault in small pages before the
// advice is given.
//
// Note [Registration context]
// cuMemHostRegister works in the calling thread's current context (PORTABLE
// then makes the memory usable from every context), and a context costs
// hundreds of MiB of device memory. The shim never makes one up: pinning on
// a thread with no current context is an error (CUDA_ERROR_INVALID_CONTEXT),
// so a rank on cuda:k never grows a context on GPU 0 because it pinned
// memory on a thread that had not bound its device. Callers bind the device
// the memory serves first: the tensor cache on the training thread and on
// its workers, the host store's copies, a PinnedPool in the context current
// when it is made, at ensure_registered(), or of the device it is given. A
// mapping remembers its context and unregisters in it, bound for that call
// only (cuda::ContextScope), so memory released on any thread (a pool
// destroyed from Python, a worker that never used CUDA) neither fails for
// want of a context nor touches another device.
//
// Note [Pinned memory across fork]
// fork() shares private pages with the child copy-on-write. On kernels that
// do not copy DMA-pinned pages at fork, the parent's next write to a page of
// a registered range moves it to a new page, while the registration (and
// every device copy) still points at the old one: copies then miss what the
// parent wrote, or write where it no longer reads. Pinned ranges are
// therefore advised MADV_DONTFORK, and a child (a DataLoader worker) does not
// get their pages at all. It does get the objects that describe them (the
// process-wide HostBufferPool::shared(), the pools of caches and checkpoint
// writers), so the child handler of pthread_atfork (installed once) maps
// fresh anonymous memory over each such range, and every mapping pinned
// before the fork reads as unpinned in the child (its fork generation is
// older than the child's): the child may write, reuse and free them, and
// never calls the driver for them (CUDA is unusable in a forked child
// anyway). Pinned memory's contents are not inherited; unpinned mappings are,
// copy-on-write as usual. The set of ranges kept from children changes under
// a mutex that the fork's prepare handler takes, so the child never sees a
// range advised and not recorded; the pools whose state a child may use
// (HostBufferPool, PinnedPool, the idle pool cache) have their mutexes held
// across fork too (LockedAcrossFork): a mutex copied while held by a thread
// the child does not have stays held there forever. Order at fork: the list
// of those mutexes, each of them, the ranges' mutex (a pool may pin under
// its own mutex).

namespace {

struct ForkState {
  std::mutex locks_mu;                       // guards `locks`
  std::vector<std::mutex*> locks;            // LockedAcrossFork's, held across fork
  std::mutex ranges_mu;                      // guards `ranges`
  std::unordered_map<void*, size_t> ranges;  // advised MADV_DONTFORK
  std::atomic<uint64_t> generation{0};       // forks between the first process and this one
};

ForkState& fork_state() {
  static auto* state = new ForkState;  // leaked: mappings may die during static destruction
  return *state;
}

void lock_for_fork() {
  ForkState& s = fork_state();
  s.locks_mu.lock();
  for (std::mutex* m : s.locks) m->lock();
  s.ranges_mu.lock();
}

void unlock_after_fork(ForkState& s) {
  s.ranges_mu.unlock();
  for (auto it = s.locks.rbegin(); it != s.locks.rend(); ++it) (*it)->unlock();
  s.locks_mu.unlock();
}

void parent_after_fork() { unlock_after_fork(fork_state()); }

// The only thread of the child; nothing here may wait for another thread.
void child_after_fork() {
  ForkState& s = fork_state();
  s.generation.fetch_add(1, std::memory_order_relaxed);
  for (const auto& [p, n] : s.ranges) {
    if (::mmap(p, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) {
      static constexpr char kMsg[] = "ebbtide: a forked child could not map memory over a pinned range\n";
      (void)!::write(2, kMsg, sizeof kMsg - 1);  // touching it will fault
    }
  }
  s.ranges.clear();  // ordinary memory now: the child's own children inherit it
  unlock_after_fork(s);
}

void install_fork_handlers() {
  static const int rc = ::pthread_atfork(lock_for_fork, parent_after_fork, child_after_fork);
  if (rc != 0) throw IoError(rc, "host memory", -1, "pthread_atfork failed");
}

// Advises [p, p + n) MADV_DONTFORK and records it for the child handler.
bool keep_from_children(void* p, size_t n) {
  install_fork_handlers();
  ForkState& s = fork_state();
  std::lock_guard<std::mutex> lock(s.ranges_mu);
  if (::madvise(p, n, MADV_DONTFORK) != 0) {
    log::warn_once("host.dontfork", detail::concat("host memory: MADV_DONTFORK refused (", std::strerror(errno),
                                                   "): a forked child shares pinned pages"));
    return false;
  }
  s.ranges.emplace(p, n);
  return true;
}

void let_children_inherit(void* p, size_t n) {
  ForkState& s = fork_state();
  std::lock_guard<std::mutex> lock(s.ranges_mu);
  (void)::madvise(p, n, MADV_DOFORK);
  s.ranges.erase(p);
}

}  // namespace

uint64_t fork_generation() {
  install_fork_handlers();
  return fork_state().generation.load(std::memory_order_relaxed);
}

LockedAcrossFork::LockedAcrossFork(std::mutex& mu) : mu_(&mu) {
  install_fork_handlers();
  ForkState& s = fork_state();
  std::lock_guard<std::mutex> lock(s.locks_mu);
  s.locks.push_back(mu_);
}

LockedAcrossFork::~LockedAcrossFork() {
  ForkState& s = fork_state();
  std::lock_guard<std::mutex> lock(s.locks_mu);
  auto it = std::find(s.locks.begin(), s.locks.end(), mu_);
  if (it != s.locks.end()) s.locks.erase(it);
}

size_t HostMapping::page_size() {
  static const size_t kPage = [] {
    long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return kPage;
}

HostMapping::HostMapping(size_t bytes, std::string_view owner, bool populate, bool huge_io) {
  const size_t page = page_size();
  EBB_CHECK(bytes > 0, owner, ": cannot map 0 bytes");
  EBB_CHECK(bytes <= std::numeric_limits<size_t>::max() - (page - 1), owner, ": ", bytes,
            " bytes is too large to map");
  const size_t size = (bytes + page - 1) / page * page;
  const bool huge = huge_io && size >= kHugePage && size <= std::numeric_limits<size_t>::max() - kHugePage;
  const size_t span = huge ? size + kHugePage : size;
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (populate && !huge) flags |= MAP_POPULATE;
  void* p = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw IoError(err, "host memory", -1, detail::concat(owner, ": mmap of ", size, " bytes failed"));
  }
  if (huge) {
    auto* base = static_cast<char*>(p);
    const auto addr = reinterpret_cast<uintptr_t>(base);
    char* aligned = base + ((addr + kHugePage - 1) / kHugePage * kHugePage - addr);
    if (aligned > base) ::munmap(base, static_cast<size_t>(aligned - base));
    if (base + span > aligned + size) ::munmap(aligned + size, static_cast<size_t>(base + span - (aligned + size)));
    p = aligned;
    // Advice only: without THP (or before Linux 5.14 for the populate) the pages come as they are touched.
    (void)::madvise(p, size, MADV_HUGEPAGE);
    if (populate) (void)::madvise(p, size, MADV_POPULATE_WRITE);
  }
  data_ = p;
  size_ = size;
}

HostMapping::~HostMapping() { release(); }

HostMapping::HostMapping(HostMapping&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      pinned_by_(std::exchange(o.pinned_by_, nullptr)),
      context_(std::exchange(o.context_, 0)),
      generation_(std::exchange(o.generation_, 0)),
      pin_tried_(std::exchange(o.pin_tried_, false)),
      dontfork_(std::exchange(o.dontfork_, false)) {}

HostMapping& HostMapping::operator=(HostMapping&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    pinned_by_ = std::exchange(o.pinned_by_, nullptr);
    context_ = std::exchange(o.context_, 0);
    generation_ = std::exchange(o.generation_, 0);
    pin_tried_ = std::exchange(o.pin_tried_, false);
    dontfork_ = std::exchange(o.dontfork_, false);
  }
  return *this;
}

bool HostMapping::pinned() const {
  return pinned_by_ != nullptr && generation_ == fork_state().generation.load(std::memory_order_relaxed);
}

// Note [Registration context], Note [Pinned memory across fork]: the range is
// kept from children before it is registered, so no fork ever shares a
// registered page.
bool HostMapping::pin(cuda::Driver* driver) {
  if (driver == nullptr || data_ == nullptr || pin_tried_) return pinned();
  const cuda::Context context = driver->current_context();
  const bool dontfork = keep_from_children(data_, size_);
  bool ok = false;
  try {
    ok = driver->host_register(data_, size_);
  } catch (...) {
    if (dontfork) let_children_inherit(data_, size_);
    throw;
  }
  pin_tried_ = true;
  if (!ok) {
    if (dontfork) let_children_inherit(data_, size_);
    return false;
  }
  pinned_by_ = driver;
  context_ = context;
  generation_ = fork_state().generation.load(std::memory_order_relaxed);
  dontfork_ = dontfork;
  return true;
}

void HostMapping::release() noexcept {
  if (data_ == nullptr) return;
  if (pinned()) {
    try {
      std::optional<cuda::ContextScope> scope;  // Note [Registration context]
      if (context_ != 0) scope.emplace(pinned_by_, context_);
      pinned_by_->host_unregister(data_);
    } catch (const std::exception& e) {
      log::warn("host memory: unregistering ", size_, " bytes from CUDA failed: ", e.what());
    }
  }
  {
    // Forgotten and unmapped under one lock: a fork in between would give
    // the child a hole where its copy of this mapping points.
    std::unique_lock<std::mutex> lock;
    if (dontfork_) {
      lock = std::unique_lock<std::mutex>(fork_state().ranges_mu);
      fork_state().ranges.erase(data_);
    }
    if (::munmap(data_, size_) != 0) log::warn("host memory: munmap of ", size_, " bytes failed (errno ", errno, ")");
  }
  data_ = nullptr;
  size_ = 0;
  pinned_by_ = nullptr;
  context_ = 0;
  generation_ = 0;
  pin_tried_ = false;
  dontfork_ = false;
}

}  // namespace ebbtide::mem
