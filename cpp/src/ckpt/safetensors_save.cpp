// safetensors writes: save() (Note [Safetensors save]) and the closes of
// the files it replaces (Note [Replaced files]).
#include "safetensors_impl.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <system_error>
#include <thread>
#include <unordered_set>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/mem/pinned_pool.hpp"
#include "ebbtide/mem/stream_copy.hpp"
#include "ebbtide/util/error.hpp"
#include "workers.hpp"

namespace ebbtide::ckpt::safetensors {

namespace {

// Note [Replaced files]
// A save over an existing file renames the new one over it. When the old
// file's last name goes, the kernel frees its extents, and on a
// discard-mounted ext4 that is ~0.15 s per GB in the rename and in the
// directory fsync after it (the journal commit issues the discards): a 1 GB
// save over its predecessor took 0.55 s against 0.41 s for a new name. So
// the save holds the old file open across the rename (an open file is freed
// at its last close) and closes it on a thread of its own after the save,
// as the directory checkpoints hand theirs to a Reaper (Note [Deferred
// removal] in writer.cpp). Nothing is left on disk by a crash: the kernel
// closes the descriptor at exit, and ext4's orphan list frees an unlinked
// inode after a power cut. Each save first waits for the closes queued
// before it, so back-to-back saves on a nearly full disk never hold more
// than one old file.
// Fork: a child (a DataLoader worker, a multiprocessing pool) inherits the
// count of closes in flight but not the threads doing them, so the state
// belongs to the process that made it and a child starts afresh (its copies
// of the parent's held descriptors stay open until it exits). Hence no
// mutex or long-lived thread here: an atomic count, waited on by futex.
class ReplacedFiles {
 public:
  void close_later(int fd) {
    adopt();
    in_flight_.fetch_add(1);
    try {
      std::thread([this, fd] {
        for (bool p = paused_.load(); p; p = paused_.load()) paused_.wait(true);
        close_counted(fd);
      }).detach();
    } catch (const std::system_error&) {  // no thread to be had: close here
      close_counted(fd);
    }
  }
  void drain() {
    adopt();
    for (int n = in_flight_.load(); n != 0; n = in_flight_.load()) in_flight_.wait(n);
  }
  void pause(bool paused) {
    adopt();
    paused_ = paused;
    paused_.notify_all();
  }

 private:
  void close_counted(int fd) {
    ::close(fd);
    if (in_flight_.fetch_sub(1) == 1) in_flight_.notify_all();
  }
  void adopt() {  // a forked child starts afresh (see the Note)
    if (owner_.load() == ::getpid()) return;
    in_flight_ = 0;
    paused_ = false;
    owner_ = ::getpid();
  }
  std::atomic<pid_t> owner_{::getpid()};
  std::atomic<int> in_flight_{0};
  std::atomic<bool> paused_{false};  // tests: closes wait while set
};

// Never destroyed: a close may still run while the process exits.
ReplacedFiles& replaced_files() {
  static auto* files = new ReplacedFiles;
  return *files;
}

// The open file at `path` if it is a regular file, else -1 (nothing there, a
// link, a FIFO: nothing of size to free).
int hold_replaced(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return -1;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

void finish_replaced_files() { replaced_files().drain(); }
void pause_replaced_files(bool paused) { replaced_files().pause(paused); }

// Note [Safetensors save]
// The file is streamed through a ring of pinned buffers: worker threads copy
// the file image (length, header, then each tensor's bytes, host memcpy or
// device-to-host copy) into buffer k % N for the 4 MiB piece k while the
// ring writes the earlier pieces (O_DIRECT where allowed, into the file
// preallocated to its whole size; the last piece is padded to a whole block
// and the file truncated to its size after). The
// data section of a safetensors file starts at 8 + N, which is not block
// aligned, so tensors cannot be written from their own memory. The file is
// written under a temporary name beside `path`, fdatasync'd, renamed over
// `path` and the directory fsync'd: a crash leaves the old file or the new
// one, never a torn one.
SaveResult save(const std::string& path, const std::vector<SaveTensor>& tensors, const Metadata& metadata,
                const IoOptions& opt) {
  EBB_CHECK(!path.empty(), "safetensors: the file path is empty");
  auto bad = [&](const std::string& name, auto&&... what) {
    return InvalidArgument(ebbtide::detail::concat(path, ": cannot save tensor ", quoted(name), ": ", what...));
  };
  std::unordered_set<std::string_view> names;
  std::vector<TensorInfo> infos(tensors.size());
  std::vector<uint32_t> bits(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.name == "__metadata__") throw bad(t.name, "the name is reserved for the metadata");
    if (!valid_utf8(t.name)) throw bad(t.name, "the name is not valid UTF-8");
    if (!names.insert(t.name).second) throw bad(t.name, "the name appears twice");
    bits[i] = dtype_bits(t.dtype);
    if (bits[i] == 0) throw bad(t.name, "unknown safetensors dtype ", quoted(t.dtype));
    if (t.shape.size() > kMaxDims) throw bad(t.name, t.shape.size(), " dimensions (at most ", kMaxDims, ")");
    uint64_t n = 0;
    if (!tensor_bytes(t.shape, bits[i], &n)) throw bad(t.name, "its size is not a whole number of bytes below 2^64");
    if (t.src.nbytes != n) throw bad(t.name, "its ", t.dtype, " shape has ", n, " bytes, its data ", t.src.nbytes);
    if (n > 0 && t.src.ptr == nullptr) throw bad(t.name, "null data pointer");
    infos[i] = {t.name, t.dtype, t.shape, 0, n};
  }
  std::unordered_set<std::string_view> keys;
  for (const auto& [k, v] : metadata) {
    EBB_CHECK(valid_utf8(k) && valid_utf8(v), path, ": safetensors metadata ", quoted(k), " is not valid UTF-8");
    EBB_CHECK(keys.insert(k).second, path, ": safetensors metadata key ", quoted(k), " appears twice");
  }
  // Largest elements first, then by name: every tensor starts at a multiple of its element size.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return bits[a] != bits[b] ? bits[a] > bits[b] : tensors[a].name < tensors[b].name;
  });
  std::vector<TensorInfo> sorted;
  uint64_t data = 0;
  for (size_t i : order) {
    TensorInfo t = infos[i];
    uint64_t n = t.end;
    EBB_CHECK(n <= UINT64_MAX / 2 - data, path, ": the tensors add up to more than 2^63 bytes");
    t.begin = data;
    t.end = data + n;
    data += n;
    sorted.push_back(std::move(t));
  }
  const std::string json = encode_header(sorted, metadata);
  EBB_CHECK(json.size() <= kMaxHeaderBytes, path, ": the safetensors header would have ", json.size(),
            " bytes, above the ", kMaxHeaderBytes, "-byte limit readers accept");
  std::string prefix(8, '\0');
  uint64_t n = json.size();
  std::memcpy(prefix.data(), &n, 8);
  prefix += json;
  const uint64_t total = prefix.size() + data;

  // The file image as extents in file order: the prefix, then each tensor.
  struct Extent {
    uint64_t off, len;
    const char* src;
    bool device;
    uintptr_t stream;
    const std::string* name;
  };
  std::vector<Extent> extents{{0, prefix.size(), prefix.data(), false, 0, nullptr}};
  mem::cuda::Driver* drv = nullptr;
  for (size_t k = 0; k < order.size(); ++k) {
    const auto& t = tensors[order[k]];
    if (sorted[k].end == sorted[k].begin) continue;
    if (t.src.on_device() && drv == nullptr) drv = need_driver(t.name, opt);
    extents.push_back({prefix.size() + sorted[k].begin, sorted[k].end - sorted[k].begin,
                       static_cast<const char*>(t.src.ptr), t.src.on_device(), t.src.stream, &t.name});
  }

  std::string tmp;
  {
    std::random_device rd;
    char suffix[24];
    std::snprintf(suffix, sizeof suffix, ".tmp-%08x%08x", rd(), rd());
    tmp = path + suffix;
  }
  struct RemoveTemp {
    const std::string& tmp;
    bool keep = false;
    ~RemoveTemp() {
      if (!keep) ::unlink(tmp.c_str());
    }
  } remove_tmp{tmp};
  {  // fail before writing a byte, not at the rename
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      throw IoError(EISDIR, path, -1, "cannot save a safetensors file there: the path is a directory");
  }
  finish_replaced_files();  // Note [Replaced files]: at most one old file held
  const auto file_ptr = detail::open_shard(tmp, true, opt.direct, "safetensors file");
  // Note [Preallocated saves] in writer.cpp: no write extends the file.
  file_ptr->grow_to(align_up(total, kBlockBytes));
  const io::DirectFile& file = *file_ptr;
  const bool direct = file.direct();
  const uint64_t npieces = (total + kPieceBytes - 1) / kPieceBytes;
  const unsigned depth = std::max(1u, opt.queue_depth);
  mem::PinnedPoolOptions host_only;
  host_only.cuda_register = false;
  // Note [Reused staging]: periodic saves of one model borrow the same ring.
  const auto ring_owner = mem::borrow_pinned_pool(kPieceBytes, std::min<uint64_t>(npieces, depth + 2), host_only);
  mem::PinnedPool& ring = *ring_owner;
  const void* served = nullptr;  // a device tensor copied into the ring
  for (const auto& e : extents)
    if (e.device) {
      served = e.src;
      break;
    }
  detail::lock_staging(ring, drv, opt.cuda_driver, served);
  const size_t nbuf = ring.count();
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> filled(nbuf, 0);      // 1: piece in the buffer is ready, -1: its copy failed
  std::vector<int> writing(nbuf, 0);     // 1 while a write from the buffer is in flight
  std::exception_ptr fill_error;
  detail::CallerContext caller;
  if (drv != nullptr) caller.take(drv);

  // Copies file bytes [off, off + len) into `out` (a worker thread). Device
  // copies are all queued, then each (context, stream) waited for once.
  auto fill = [&](uint64_t off, uint64_t len, char* out) {
    detail::StreamWaits copies;
    auto it = std::upper_bound(extents.begin(), extents.end(), off,
                               [](uint64_t o, const Extent& e) { return o < e.off; });
    for (--it; it != extents.end() && it->off < off + len; ++it) {
      uint64_t lo = std::max(it->off, off), hi = std::min(it->off + it->len, off + len);
      if (lo >= hi) continue;
      if (!it->device) {
        mem::stream_copy(out + (lo - off), it->src + (lo - it->off), hi - lo);  // read back only by the disk
        continue;
      }
      auto src = reinterpret_cast<mem::cuda::DevicePtr>(it->src) + (lo - it->off);
      drv->bind_context_of(src);
      drv->memcpy_dtoh_async(out + (lo - off), src, hi - lo, it->stream);
      copies.add(drv, it->stream);
    }
    copies.synchronize();
  };
  std::string backend;
  {
    detail::Workers workers(detail::default_threads());
    struct Join {  // worker tasks reference this frame: every exit waits for them
      std::mutex& mu;
      std::condition_variable& cv;
      size_t posted = 0, finished = 0;
      ~Join() {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return finished == posted; });
      }
    } join{mu, cv};
    io::TransferLoop loop(depth, detail::buffers_of(ring), opt.backend, "checkpoint");
    uint64_t next_fill = 0;
    for (uint64_t k = 0; k < npieces; ++k) {
      // Keep the copies ahead of the writes: piece j uses buffer j % nbuf once its last write is done.
      while (next_fill < npieces && next_fill < k + nbuf) {
        size_t slot = next_fill % nbuf;
        if (writing[slot]) {
          loop.poll(true);
          continue;
        }
        uint64_t off = next_fill * kPieceBytes, len = std::min(kPieceBytes, total - off);
        char* out = static_cast<char*>(ring.buffer(slot));
        {
          std::lock_guard lock(mu);
          filled[slot] = 0;
          ++join.posted;
        }
        workers.post([&, off, len, out, slot] {
          int state = 1;
          try {
            fill(off, len, out);
          } catch (...) {
            state = -1;
            std::lock_guard lock(mu);
            if (!fill_error) fill_error = std::current_exception();
          }
          std::lock_guard lock(mu);
          filled[slot] = state;
          ++join.finished;
          cv.notify_all();
        });
        ++next_fill;
      }
      const size_t slot = k % nbuf;
      {
        std::unique_lock lock(mu);
        if (filled[slot] == 0) {
          lock.unlock();
          loop.poll(false);  // frees buffers while the copy runs
          lock.lock();
          cv.wait(lock, [&] { return filled[slot] != 0; });
        }
        if (fill_error) std::rethrow_exception(fill_error);
      }
      const uint64_t off = k * kPieceBytes, len = std::min(kPieceBytes, total - off);
      uint64_t wlen = len;
      char* buf = static_cast<char*>(ring.buffer(slot));
      if (direct && len % kBlockBytes != 0) {  // the last piece: whole blocks, truncated below
        wlen = align_up(len, kBlockBytes);
        std::memset(buf + len, 0, wlen - len);
      }
      writing[slot] = 1;
      loop.submit(file, true, buf, wlen, off, static_cast<int>(slot), [&writing, slot] { writing[slot] = 0; });
    }
    loop.drain();
    backend = loop.describe() + (direct ? " O_DIRECT" : " buffered");
  }
  EBB_SYSCALL(::ftruncate(file.fd(), static_cast<off_t>(total)), tmp, static_cast<int64_t>(total));
  file.sync();
  struct Replaced {  // Note [Replaced files]
    int fd;
    bool renamed = false;
    ~Replaced() {
      if (fd < 0) return;
      if (renamed)
        replaced_files().close_later(fd);
      else
        ::close(fd);
    }
  } replaced{hold_replaced(path)};
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw_io_error(errno, path, -1, "rename");
  replaced.renamed = true;
  remove_tmp.keep = true;
  auto slash = path.rfind('/');
  fsync_directory(slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash));
  SaveResult r;
  r.file_bytes = total;
  r.data_bytes = data;
  r.backend = backend;
  return r;
}

}  // namespace ebbtide::ckpt::safetensors
