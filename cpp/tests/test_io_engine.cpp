// Conformance suite of the storage engine, run for every backend (uring,
// posix); a backend this build or kernel lacks is skipped.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <map>
#include <set>
#include <thread>

#include "ebbtide/io/detail/engine_testing.hpp"
#include "ebbtide/io/engine.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/error.hpp"
#include "sim_driver.hpp"
#include "test_utils.hpp"

namespace io = ebbtide::io;
namespace mem = ebbtide::mem;
using ebbtide::test::random_bytes;
using ebbtide::test::ScopedEnv;
using ebbtide::test::TempDir;

namespace {

constexpr uint64_t kMiB = 1ull << 20;

// A buffer whose data starts `misalign` bytes past a 4 KiB boundary.
struct TestBuffer {
  explicit TestBuffer(size_t n, size_t misalign = 0) : misalign_(misalign), n_(n) {
    raw_ = static_cast<unsigned char*>(std::aligned_alloc(4096, (n + misalign + 4095) / 4096 * 4096 + 4096));
  }
  ~TestBuffer() { std::free(raw_); }
  unsigned char* data() { return raw_ + misalign_; }
  size_t size() const { return n_; }
  void fill(uint64_t seed) {
    auto v = random_bytes(n_, seed);
    std::memcpy(data(), v.data(), n_);
  }
  mem::Buffer buf() { return mem::Buffer{data(), n_}; }
  unsigned char* raw_;
  size_t misalign_, n_;
};

// A tmpfs mounted for the test's lifetime; ok() false when mounting is refused.
struct TmpfsMount {
  TmpfsMount(const std::string& dir, const char* opts) : dir_(dir) {
    ok_ = ::mount("tmpfs", dir.c_str(), "tmpfs", 0, opts) == 0;
  }
  ~TmpfsMount() {
    if (ok_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  bool ok() const { return ok_; }
  std::string dir_;
  bool ok_ = false;
};

class IoEngine : public ::testing::TestWithParam<io::BackendKind> {
 protected:
  void TearDown() override {
    io::clear_faults();
    io::detail::EngineTesting::refuse_direct(false);
    io::detail::EngineTesting::refuse_fallocate(false);
  }
  io::EngineOptions options(std::vector<std::string> dirs) {
    io::EngineOptions o;
    o.dirs = std::move(dirs);
    o.backend = GetParam();
    o.slab_grow_bytes = 16 * kMiB;
    o.staging_bytes = 8 * kMiB;
    return o;
  }
  // Engine for the suite's backend; nullptr (and the test skips) when unavailable.
  std::unique_ptr<io::Engine> make(const io::EngineOptions& o) {
    try {
      return std::make_unique<io::Engine>(o);
    } catch (const ebbtide::Unsupported& e) {
      return nullptr;
    }
  }
  void round_trip(io::Engine& e, size_t n, size_t misalign, uint64_t seed) {
    TestBuffer src(n, misalign), dst(n, misalign ? misalign + 1 : 0);
    src.fill(seed);
    auto slot = e.allocate(n);
    e.write(slot, src.buf()).wait();
    EXPECT_EQ(e.stored_bytes(slot), n);
    std::memset(dst.data(), 0, n);
    e.read(slot, dst.buf()).wait();
    ASSERT_EQ(0, std::memcmp(src.data(), dst.data(), n)) << "size " << n << " misalign " << misalign;
    e.free(slot);
  }
};

#define MAKE_OR_SKIP(var, opts)                                                  \
  auto var = make(opts);                                                         \
  if (!var) GTEST_SKIP() << "backend " << io::to_string(GetParam()) << " unavailable"

TEST_P(IoEngine, ZeroSizeIsRejected) {
  TempDir d;
  MAKE_OR_SKIP(e, options({d.path()}));
  EXPECT_EQ(e->backend(), GetParam());
  EXPECT_THROW(e->allocate(0), ebbtide::InvalidArgument);
  auto slot = e->allocate(10);
  char c = 0;
  try {
    e->write(slot, mem::Buffer{&c, 0});
    FAIL() << "zero-size write accepted";
  } catch (const ebbtide::InvalidArgument& err) {
    EXPECT_NE(std::string(err.what()).find("0 bytes"), std::string::npos) << err.what();
  }
}

TEST_P(IoEngine, RoundTripOneByte) {
  TempDir d;
  MAKE_OR_SKIP(e, options({d.path()}));
  round_trip(*e, 1, 0, 1);
  round_trip(*e, 1, 3, 2);
}

TEST_P(IoEngine, RoundTripUnalignedSizesAndBuffers) {
  TempDir d;
  auto o = options({d.path()});
  o.checksum = true;
  MAKE_OR_SKIP(e, o);
  uint64_t seed = 10;
  for (size_t n : {size_t{511}, size_t{4095}, size_t{4097}, size_t{kMiB - 1}, size_t{kMiB + 3}, size_t{3 * kMiB + 777}})
    for (size_t mis : {0, 1, 512})
      round_trip(*e, n, mis, ++seed);
}

TEST_P(IoEngine, RoundTripManyMiB) {
  TempDir d;
  MAKE_OR_SKIP(e, options({d.path()}));
  round_trip(*e, 48 * kMiB, 0, 5);      // aligned: straight from the user buffer
  round_trip(*e, 20 * kMiB + 5, 7, 6);  // unaligned: through staging
  auto s = e->stats();
  EXPECT_EQ(s.writes, 2u);
  EXPECT_EQ(s.reads, 2u);
  EXPECT_EQ(s.bytes_written, 68 * kMiB + 5);
  EXPECT_EQ(s.bytes_read, 68 * kMiB + 5);
  EXPECT_EQ(s.pending, 0u);
  EXPECT_EQ(s.slots_live, 0u);
  EXPECT_EQ(s.backend, std::string(io::to_string(GetParam())));
  EXPECT_TRUE(s.direct);  // /tmp is a disk filesystem here
  EXPECT_GE(s.alignment, 512u);
}

TEST_P(IoEngine, ConcurrentRequestsFromSeveralThreads) {
  TempDir d;
  auto o = options({d.path()});
  o.queue_depth = 4;
  o.checksum = true;
  MAKE_OR_SKIP(e, o);
  std::atomic<int> failures{0}, callbacks{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::unique_ptr<TestBuffer>> bufs;
      std::vector<io::SlotId> slots;
      std::vector<io::Request> reqs;
      for (int i = 0; i < 12; ++i) {
        size_t n = 1 + (static_cast<size_t>(t * 7919 + i * 104729) % (3 * kMiB));
        bufs.push_back(std::make_unique<TestBuffer>(n, i % 3));
        bufs.back()->fill(t * 100 + i);
        slots.push_back(e->allocate(n));
        reqs.push_back(e->write(slots.back(), bufs.back()->buf(), [&](const io::Request& r) {
          if (r.done() && r.ok()) ++callbacks;
        }));
      }
      for (auto& r : reqs) r.wait();
      for (size_t i = 0; i < slots.size(); ++i) {
        TestBuffer back(bufs[i]->size());
        e->read(slots[i], back.buf()).wait();
        if (std::memcmp(back.data(), bufs[i]->data(), back.size()) != 0) ++failures;
        e->free(slots[i]);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(callbacks.load(), 48);
  e->drain();
  EXPECT_EQ(e->stats().slots_live, 0u);
  EXPECT_EQ(e->stats().bytes_stored, 0u);
}

TEST_P(IoEngine, CancelPendingWrite) {
  TempDir d;
  auto o = options({d.path()});
  o.queue_depth = 1;
  MAKE_OR_SKIP(e, o);
  TestBuffer src(4 * kMiB);
  src.fill(3);
  std::vector<io::SlotId> slots;
  std::vector<io::Request> reqs;
  for (int i = 0; i < 24; ++i) {
    slots.push_back(e->allocate(src.size()));
    reqs.push_back(e->write(slots.back(), src.buf()));
  }
  // 96 chunks queued behind a queue depth of 1: the last write has not started.
  EXPECT_TRUE(e->cancel(reqs.back()));
  EXPECT_FALSE(e->cancel(reqs.back()));
  EXPECT_THROW(reqs.back().wait(), ebbtide::StateError);
  EXPECT_TRUE(reqs.back().cancelled());
  EXPECT_FALSE(reqs.back().ok());
  EXPECT_EQ(e->stored_bytes(slots.back()), 0u);
  // Freeing a slot whose write is queued cancels it.
  e->free(slots[22]);
  e->drain();
  EXPECT_TRUE(reqs[22].cancelled());
  EXPECT_THROW(e->stored_bytes(slots[22]), ebbtide::StateError);
  for (int i = 0; i < 22; ++i) {
    EXPECT_TRUE(reqs[i].ok());
    EXPECT_FALSE(e->cancel(reqs[i]));  // already done
  }
  auto s = e->stats();
  EXPECT_EQ(s.cancelled, 2u);
  EXPECT_EQ(s.writes, 22u);
  EXPECT_EQ(s.bytes_stored, 22 * 4 * kMiB);
  // The cancelled slot stays usable.
  TestBuffer back(src.size());
  EXPECT_THROW(e->read(slots.back(), back.buf()), ebbtide::StateError);
  e->write(slots.back(), src.buf()).wait();
  e->read(slots.back(), back.buf()).wait();
  EXPECT_EQ(0, std::memcmp(back.data(), src.data(), src.size()));
}

TEST_P(IoEngine, SlotSpaceIsReused) {
  TempDir d;
  MAKE_OR_SKIP(e, options({d.path()}));
  TestBuffer src(3 * kMiB);
  src.fill(9);
  for (int round = 0; round < 20; ++round) {
    auto a = e->allocate(3 * kMiB), b = e->allocate(5 * kMiB);
    e->write(a, src.buf()).wait();
    e->free(a);
    e->free(b);
  }
  auto s = e->stats();
  EXPECT_EQ(s.slab_bytes, 16 * kMiB);  // one growth step: freed space came back
  EXPECT_EQ(s.slots_live, 0u);
  EXPECT_EQ(s.bytes_reserved, 0u);
  EXPECT_EQ(s.bytes_stored, 0u);
}

TEST_P(IoEngine, StripesOverFourDirectories) {
  TempDir d;
  std::vector<std::string> dirs;
  for (int i = 0; i < 4; ++i) dirs.push_back(d.sub("d" + std::to_string(i)));
  auto o = options(dirs);
  o.checksum = true;
  MAKE_OR_SKIP(e, o);
  const size_t n = 16 * kMiB + 12345;
  TestBuffer src(n, 1), dst(n);
  src.fill(77);
  auto slot = e->allocate(n);
  e->write(slot, src.buf()).wait();
  e->read(slot, dst.buf()).wait();
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), n));
  std::set<std::string> seen;
  std::map<std::string, int> fds;
  for (uint64_t off = 0; off < n; off += kMiB) {
    auto loc = io::detail::EngineTesting::locate(*e, slot, off);
    seen.insert(loc.dir);
    fds[loc.dir] = loc.fd;
  }
  EXPECT_EQ(seen.size(), 4u);
  for (auto& [dir, fd] : fds) {  // every slab holds about a quarter of the data
    struct stat st {};
    ASSERT_EQ(::fstat(fd, &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), e->stats().slab_bytes / 4) << dir;
  }
  // Nothing named is left in any directory.
  for (auto& dir : dirs) EXPECT_TRUE(std::filesystem::is_empty(dir)) << dir;
}

TEST_P(IoEngine, TmpfsFallsBackToBufferedIo) {
  struct statfs sfs {};
  if (::statfs("/dev/shm", &sfs) != 0 || sfs.f_type != 0x01021994 /* TMPFS_MAGIC */)
    GTEST_SKIP() << "/dev/shm is not a tmpfs";
  TempDir d("/dev/shm");
  {
    MAKE_OR_SKIP(e, options({d.path()}));
    round_trip(*e, kMiB + 17, 3, 1);  // whatever the kernel allows, data round-trips
  }
  // Kernels before 6.6 refuse O_DIRECT on tmpfs with EINVAL; force that path.
  io::detail::EngineTesting::refuse_direct(true);
  MAKE_OR_SKIP(e, options({d.path()}));
  EXPECT_FALSE(e->stats().direct);
  EXPECT_NE(e->describe().find("buffered"), std::string::npos) << e->describe();
  round_trip(*e, 5 * kMiB + 1, 1, 2);
  round_trip(*e, 1, 0, 3);
}

TEST_P(IoEngine, MissingDirectoryIsAnIoError) {
  TempDir d;
  try {
    io::Engine e(options({d.path() + "/nope"}));
    FAIL() << "engine opened a missing directory";
  } catch (const ebbtide::IoError& err) {
    EXPECT_EQ(err.err(), ENOENT);
    EXPECT_NE(std::string(err.what()).find("nope"), std::string::npos) << err.what();
  }
}

TEST_P(IoEngine, PathThatIsAFileIsAnIoError) {
  TempDir d;
  std::string file = d.path() + "/file";
  ::close(::open(file.c_str(), O_CREAT | O_WRONLY, 0600));
  try {
    io::Engine e(options({file}));
    FAIL() << "engine opened a file as directory";
  } catch (const ebbtide::IoError& err) {
    EXPECT_EQ(err.err(), ENOTDIR);
    EXPECT_NE(std::string(err.what()).find(file), std::string::npos) << err.what();
  }
}

TEST_P(IoEngine, ReadOnlyFilesystemIsAnIoError) {
  TempDir d;
  std::string mnt = d.sub("ro");
  TmpfsMount m(mnt, "size=1m");
  if (!m.ok()) GTEST_SKIP() << "cannot mount a tmpfs here (not root?)";
  if (::mount(nullptr, mnt.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) != 0)
    GTEST_SKIP() << "cannot remount read-only";
  try {
    io::Engine e(options({mnt}));
    FAIL() << "engine opened a read-only directory";
  } catch (const ebbtide::IoError& err) {
    EXPECT_EQ(err.err(), EROFS);
    EXPECT_NE(std::string(err.what()).find("read-only"), std::string::npos) << err.what();
  }
}

TEST_P(IoEngine, UnwritableDirectoryForNonRootIsAnIoError) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to switch to an unprivileged user";
  TempDir d;
  std::string dir = d.sub("locked");
  ::chmod(d.path().c_str(), 0755);
  ::chmod(dir.c_str(), 0555);
  auto o = options({dir});
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    try {
      io::Engine e(o);
      ::_exit(1);
    } catch (const ebbtide::IoError& err) {
      ::_exit(err.err() == EACCES ? 0 : 2);
    } catch (const ebbtide::Unsupported&) {
      ::_exit(4);
    } catch (...) {
      ::_exit(5);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3) GTEST_SKIP() << "setuid refused";
  if (WEXITSTATUS(status) == 4) GTEST_SKIP() << "backend unavailable";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child exit code (1: opened, 2: wrong errno, 5: other error)";
}

// A write that hits ENOSPC mid-way is reported, counts nothing as stored, and
// leaves the engine and the slot usable.
void expect_failed_write_then_recovery(io::Engine& e, io::SlotId slot, TestBuffer& src, int err) {
  auto r = e.write(slot, src.buf());
  try {
    r.wait();
    FAIL() << "write did not fail";
  } catch (const ebbtide::IoError& x) {
    EXPECT_EQ(x.err(), err) << x.what();
    EXPECT_NE(std::string(x.what()).find("offset"), std::string::npos) << x.what();
  }
  EXPECT_TRUE(r.done());
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.cancelled());
  EXPECT_NE(r.error(), nullptr);
  auto s = e.stats();
  EXPECT_EQ(s.write_errors, 1u);
  EXPECT_EQ(s.writes, 0u);
  EXPECT_EQ(s.bytes_stored, 0u);
  EXPECT_EQ(s.bytes_written, 0u);
  EXPECT_EQ(e.stored_bytes(slot), 0u);
  TestBuffer back(src.size());
  EXPECT_THROW(e.read(slot, back.buf()), ebbtide::StateError);
}

TEST_P(IoEngine, InjectedDiskFullMidWrite) {
  TempDir d;
  MAKE_OR_SKIP(e, options({d.path()}));
  TestBuffer src(8 * kMiB, 1);
  src.fill(4);
  auto slot = e->allocate(src.size());
  io::inject_write_fault(d.path(), 3 * kMiB, ENOSPC);
  expect_failed_write_then_recovery(*e, slot, src, ENOSPC);
  e->write(slot, src.buf()).wait();  // the fault was consumed: the retry succeeds
  TestBuffer back(src.size());
  e->read(slot, back.buf()).wait();
  EXPECT_EQ(0, std::memcmp(back.data(), src.data(), src.size()));
  EXPECT_EQ(e->stats().bytes_stored, src.size());
}

// Note [Slab growth]: less free space than one growth step still takes what fits.
TEST_P(IoEngine, SlabGrowsByWhatFitsWhenAStepDoesNot) {
  TempDir d;
  std::string mnt = d.sub("small");
  TmpfsMount m(mnt, "size=8m");
  if (!m.ok()) GTEST_SKIP() << "cannot mount a small tmpfs here";
  auto o = options({mnt});
  o.slab_grow_bytes = 64 * kMiB;  // far more than the filesystem holds
  MAKE_OR_SKIP(e, o);
  std::vector<io::SlotId> slots;
  for (int i = 0; i < 3; ++i) slots.push_back(e->allocate(2 * kMiB));
  TestBuffer src(2 * kMiB), back(2 * kMiB);
  src.fill(7);
  e->write(slots[2], src.buf()).wait();
  e->read(slots[2], back.buf()).wait();
  EXPECT_EQ(0, std::memcmp(back.data(), src.data(), src.size()));
  EXPECT_THROW(e->allocate(8 * kMiB), ebbtide::IoError);  // and a clean ENOSPC past it
}

TEST_P(IoEngine, SmallFilesystemFullMidWrite) {
  TempDir d;
  std::string mnt = d.sub("small");
  TmpfsMount m(mnt, "size=8m");
  if (!m.ok()) GTEST_SKIP() << "cannot mount a small tmpfs here";
  auto o = options({mnt});
  o.slab_grow_bytes = 2 * kMiB;
  {
    // With fallocate, space runs out at allocate(): a clean IoError(ENOSPC).
    MAKE_OR_SKIP(e, o);
    std::vector<io::SlotId> slots;
    try {
      for (int i = 0; i < 16; ++i) slots.push_back(e->allocate(2 * kMiB));
      FAIL() << "8 MiB filesystem held 32 MiB";
    } catch (const ebbtide::IoError& x) {
      EXPECT_EQ(x.err(), ENOSPC);
      EXPECT_NE(std::string(x.what()).find(mnt), std::string::npos) << x.what();
    }
    ASSERT_FALSE(slots.empty());
    e->free(slots.back());
    auto again = e->allocate(2 * kMiB);  // usable afterwards
    TestBuffer src(2 * kMiB);
    src.fill(1);
    e->write(again, src.buf()).wait();
  }
  // Without fallocate the slab is sparse and the device fills mid-write.
  io::detail::EngineTesting::refuse_fallocate(true);
  o.slab_grow_bytes = 64 * kMiB;
  // One chunk in flight: the chunks land in order, so the space the device
  // holds when it fills is the slot's start, which the recovery write below
  // reuses. With several in flight, whichever chunks came first took it.
  o.queue_depth = 1;
  MAKE_OR_SKIP(e, o);
  TestBuffer src(16 * kMiB, 1);
  src.fill(2);
  auto slot = e->allocate(src.size());
  expect_failed_write_then_recovery(*e, slot, src, ENOSPC);
  // The slot stays usable: a smaller write into space the device already holds.
  TestBuffer s2(kMiB), back(kMiB);
  s2.fill(3);
  e->write(slot, s2.buf()).wait();
  e->read(slot, back.buf()).wait();
  EXPECT_EQ(0, std::memcmp(back.data(), s2.data(), kMiB));
}

// Note [Slot phase]: a slot laid out after a misaligned buffer moves that
// buffer's aligned middle in place; only head and tail blocks are staged, for
// any buffer alignment at read time, and checksums still line up.
TEST_P(IoEngine, SlotLaidOutAfterAMisalignedBufferMovesItInPlace) {
  TempDir d;
  auto o = options({d.path()});
  o.checksum = true;
  MAKE_OR_SKIP(e, o);
  const uint64_t a = e->io_alignment();
  if (a <= 1) GTEST_SKIP() << "no O_DIRECT here";
  uint64_t seed = 40;
  for (size_t n : {size_t{100}, size_t{a - 64}, size_t{5000}, size_t{3 * kMiB + 777}}) {
    for (size_t mis : {size_t{64}, size_t{448}, size_t{0}}) {
      TestBuffer src(n, mis), same(n, mis), other(n, mis + 1);
      src.fill(++seed);
      auto before = e->stats().bytes_staged;
      auto slot = e->allocate(n, src.data());
      EXPECT_GE(e->slot_capacity(slot), n);
      e->write(slot, src.buf()).wait();
      const uint64_t head = mis % a ? std::min<uint64_t>(n, a - mis % a) : 0;
      const uint64_t tail = (n - head) % a;
      EXPECT_EQ(e->stats().bytes_staged - before, head + tail) << "write n " << n << " misalign " << mis;
      before = e->stats().bytes_staged;
      e->read(slot, same.buf()).wait();
      EXPECT_EQ(e->stats().bytes_staged - before, head + tail) << "read n " << n << " misalign " << mis;
      ASSERT_EQ(0, std::memcmp(src.data(), same.data(), n)) << "n " << n << " misalign " << mis;
      before = e->stats().bytes_staged;
      e->read(slot, other.buf()).wait();  // another alignment: all staged, same bytes
      EXPECT_EQ(e->stats().bytes_staged - before, n);
      ASSERT_EQ(0, std::memcmp(src.data(), other.data(), n)) << "n " << n << " misalign " << mis + 1;
      e->free(slot);
    }
  }
}

TEST_P(IoEngine, PhasedSlotsStripeAndDetectCorruption) {
  TempDir d1, d2;
  auto o = options({d1.path(), d2.path()});
  o.checksum = true;
  MAKE_OR_SKIP(e, o);
  if (e->io_alignment() <= 1) GTEST_SKIP() << "no O_DIRECT here";
  const size_t n = 3 * kMiB + 100;
  TestBuffer src(n, 64), dst(n, 64);
  src.fill(77);
  auto neighbour = e->allocate(4096);  // phased slots must not touch their neighbours
  std::vector<unsigned char> nb(4096, 0xab);
  TestBuffer nbuf(4096);
  std::memcpy(nbuf.data(), nb.data(), 4096);
  e->write(neighbour, nbuf.buf()).wait();
  auto slot = e->allocate(n, src.data());
  e->write(slot, src.buf()).wait();
  e->read(slot, dst.buf()).wait();
  ASSERT_EQ(0, std::memcmp(src.data(), dst.data(), n));
  e->read(neighbour, nbuf.buf()).wait();
  ASSERT_EQ(0, std::memcmp(nb.data(), nbuf.data(), 4096));
  // Corrupt one byte of the head block and one of the middle: both caught.
  for (uint64_t byte : {uint64_t{10}, uint64_t{kMiB + 5000}}) {
    auto loc = io::detail::EngineTesting::locate(*e, slot, byte);
    int fd = ::open(("/proc/self/fd/" + std::to_string(loc.fd)).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    unsigned char bad = src.data()[byte] ^ 0x5a;
    ASSERT_EQ(::pwrite(fd, &bad, 1, static_cast<off_t>(loc.file_offset)), 1);
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
    EXPECT_THROW(e->read(slot, dst.buf()).wait(), ebbtide::ChecksumError) << "byte " << byte;
    bad ^= 0x5a;  // restore
    fd = ::open(("/proc/self/fd/" + std::to_string(loc.fd)).c_str(), O_RDWR);
    ASSERT_EQ(::pwrite(fd, &bad, 1, static_cast<off_t>(loc.file_offset)), 1);
    ::close(fd);
  }
  e->read(slot, dst.buf()).wait();
  ASSERT_EQ(0, std::memcmp(src.data(), dst.data(), n));
}

TEST_P(IoEngine, CorruptedChunkFailsTheChecksum) {
  TempDir d;
  auto o = options({d.path()});
  o.checksum = true;
  MAKE_OR_SKIP(e, o);
  const size_t n = 3 * kMiB;
  TestBuffer src(n), dst(n);
  src.fill(8);
  auto slot = e->allocate(n);
  e->write(slot, src.buf()).wait();
  auto loc = io::detail::EngineTesting::locate(*e, slot, kMiB + 1000);
  int fd = ::open(("/proc/self/fd/" + std::to_string(loc.fd)).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char byte = src.data()[kMiB + 1000] ^ 0x5a;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(loc.file_offset)), 1);
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
  auto r = e->read(slot, dst.buf());
  EXPECT_THROW(r.wait(), ebbtide::ChecksumError);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(e->stats().read_errors, 1u);
  // Without the checksum the bad byte would have come back unflagged.
}

TEST_P(IoEngine, KilledWriterLeavesNoFile) {
  TempDir d;
  auto o = options({d.path()});
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(pipefd[0]);
    try {
      io::Engine e(o);
      std::vector<unsigned char> buf(4 * kMiB, 0xab);
      bool told = false;
      for (;;) {
        auto slot = e.allocate(buf.size());
        auto r = e.write(slot, mem::Buffer{buf.data(), buf.size()});
        if (!told) {
          char c = 'w';
          if (::write(pipefd[1], &c, 1) != 1) ::_exit(2);
          told = true;
        }
        r.wait();
        e.free(slot);
      }
    } catch (...) {
      ::_exit(1);
    }
  }
  ::close(pipefd[1]);
  char c = 0;
  ASSERT_EQ(::read(pipefd[0], &c, 1), 1) << "child never started writing";
  ::close(pipefd[0]);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ::kill(pid, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(d.entries(), 0u) << "slab file left behind";
}

TEST_P(IoEngine, BadInputGivesClearErrors) {
  TempDir d;
  MAKE_OR_SKIP(e, options({d.path()}));
  TestBuffer b(8192, 1);
  b.fill(1);
  auto slot = e->allocate(4096);
  EXPECT_EQ(e->slot_capacity(slot), 4096u);
  try {
    e->write(slot, b.buf());
    FAIL() << "oversized write accepted";
  } catch (const ebbtide::InvalidArgument& x) {
    std::string w = x.what();
    EXPECT_NE(w.find("slot " + std::to_string(slot)), std::string::npos) << w;
    EXPECT_NE(w.find("8192"), std::string::npos) << w;
    EXPECT_NE(w.find("4096"), std::string::npos) << w;
  }
  EXPECT_THROW(e->write(slot, mem::Buffer{nullptr, 10}), ebbtide::InvalidArgument);
  EXPECT_THROW(e->read(slot, mem::Buffer{b.data(), 10}), ebbtide::StateError);  // never written
  e->write(slot, mem::Buffer{b.data(), 100}).wait();
  EXPECT_THROW(e->read(slot, mem::Buffer{b.data(), 99}), ebbtide::InvalidArgument);  // wrong length
  e->free(slot);
  EXPECT_THROW(e->free(slot), ebbtide::StateError);  // freed twice
  EXPECT_THROW(e->free(12345), ebbtide::StateError);
  EXPECT_THROW(e->write(slot, mem::Buffer{b.data(), 10}), ebbtide::StateError);  // use after free
  EXPECT_THROW(e->allocate(1ull << 62), ebbtide::IoError);  // no disk that large
  auto s2 = e->allocate(10);  // still usable after the failed allocation
  e->close();
  e->close();  // idempotent
  EXPECT_TRUE(e->closed());
  EXPECT_THROW(e->allocate(10), ebbtide::StateError);
  EXPECT_THROW(e->write(s2, mem::Buffer{b.data(), 10}), ebbtide::StateError);
}

TEST_P(IoEngine, CapacityLimitIsEnospc) {
  TempDir d;
  auto o = options({d.path()});
  o.capacity_bytes = 4 * kMiB;
  o.slab_grow_bytes = 2 * kMiB;
  MAKE_OR_SKIP(e, o);
  auto a = e->allocate(3 * kMiB);
  try {
    e->allocate(2 * kMiB);
    FAIL() << "capacity_bytes not enforced";
  } catch (const ebbtide::IoError& x) {
    EXPECT_EQ(x.err(), ENOSPC);
  }
  auto b = e->allocate(kMiB);
  e->free(a);
  e->free(b);
  EXPECT_EQ(e->stats().slab_bytes, 4 * kMiB);
}

TEST_P(IoEngine, EnvironmentOverrides) {
  io::EngineOptions o;
  {
    ScopedEnv b("EBBTIDE_IO_BACKEND", "posix"), c("EBBTIDE_IO_CHUNK_BYTES", "2MiB"),
        q("EBBTIDE_IO_QUEUE_DEPTH", "8"), k("EBBTIDE_IO_CHECKSUM", "1"), x("EBBTIDE_IO_DIRECT", "off");
    auto w = o.with_env();
    EXPECT_EQ(w.backend, io::BackendKind::kPosix);
    EXPECT_EQ(w.chunk_bytes, 2 * kMiB);
    EXPECT_EQ(w.queue_depth, 8u);
    EXPECT_TRUE(w.checksum);
    EXPECT_FALSE(w.direct);
  }
  {
    ScopedEnv q("EBBTIDE_IO_QUEUE_DEPTH", "0");
    EXPECT_THROW(o.with_env(), ebbtide::InvalidArgument);
  }
  {
    ScopedEnv b("EBBTIDE_IO_BACKEND", "spdk");
    EXPECT_THROW(o.with_env(), ebbtide::InvalidArgument);
  }
  EXPECT_EQ(io::parse_backend("URING"), io::BackendKind::kUring);
  EXPECT_THROW(io::parse_backend("x"), ebbtide::InvalidArgument);
}

TEST_P(IoEngine, DeviceBuffersRoundTripOrAreUnsupported) {
  TempDir d;
  auto o = options({d.path()});
  o.checksum = true;
  MAKE_OR_SKIP(e, o);
  auto* drv = ebbtide::mem::cuda::driver();
  const size_t n = 3 * kMiB + 4097;
  auto slot = e->allocate(n);
  if (drv == nullptr) {
    char host = 0;
    EXPECT_THROW(e->write(slot, mem::Buffer{&host, 1, 0}), ebbtide::Unsupported);
    return;
  }
  drv->bind_device(0);
  auto dev = drv->mem_alloc(n), dev2 = drv->mem_alloc(n);
  TestBuffer src(n), back(n);
  src.fill(21);
  drv->memcpy_htod_async(dev, src.data(), n, 0);
  drv->stream_synchronize(0);
  e->write(slot, mem::Buffer{reinterpret_cast<void*>(dev), n, 0}).wait();
  e->read(slot, mem::Buffer{reinterpret_cast<void*>(dev2), n, 0}).wait();
  drv->memcpy_dtoh_async(back.data(), dev2, n, 0);
  drv->stream_synchronize(0);
  EXPECT_EQ(0, std::memcmp(src.data(), back.data(), n));
  drv->mem_free(dev);
  drv->mem_free(dev2);
}

// The staged device path on the simulated GPU (Note [Simulated GPU]): each
// chunk's copy runs on the caller's stream after the kernels queued there
// (a write reads what the kernel produced, a read lands before the kernel
// that consumes it), the staging is page-locked in the buffer's device's
// context on the engine's worker, and no context is made on another device.
TEST_P(IoEngine, DeviceBuffersOnTheSimulatedGpuFollowTheCallersStream) {
  TempDir d;
  ebbtide::test::SimDriver::Options so;
  so.devices = 2;
  so.d2h_bps = so.h2d_bps = 4e9;
  ebbtide::test::SimDriver drv(so);
  auto o = options({d.path()});
  o.checksum = true;
  o.try_cufile = false;
  o.cuda_driver = &drv;
  MAKE_OR_SKIP(e, o);
  const mem::cuda::Stream s = 7;
  drv.declare_stream(s, 1);
  const size_t n = 3 * kMiB + 4097;
  auto want = std::make_shared<TestBuffer>(n);
  want->fill(23);
  const auto src = drv.alloc(n, s, "written tensor", 1);
  const auto dst = drv.alloc(n, s, "read tensor", 1);
  drv.launch(s, 5e-3, [src, want, n] { std::memcpy(reinterpret_cast<void*>(src), want->data(), n); }, 1);
  auto slot = e->allocate(n);
  e->write(slot, mem::Buffer{reinterpret_cast<void*>(src), n, 1, s}).wait();
  e->read(slot, mem::Buffer{reinterpret_cast<void*>(dst), n, 1, s}).wait();
  bool ok = false;
  drv.launch(s, 1e-6, [dst, want, n, &ok] { ok = std::memcmp(reinterpret_cast<void*>(dst), want->data(), n) == 0; }, 1);
  drv.synchronize_all();
  EXPECT_TRUE(ok);
  EXPECT_TRUE(drv.races().empty()) << ebbtide::test::SimDriver::join_lines(drv.races());
  EXPECT_TRUE(drv.errors().empty()) << ebbtide::test::SimDriver::join_lines(drv.errors());
  EXPECT_EQ(drv.contexts(), std::set<int>{1});
  EXPECT_GE(drv.registers(), 1) << "the staging was page-locked for the device copies";
  for (const auto& c : drv.copies()) EXPECT_EQ(c.stream, s);
  e.reset();
}

INSTANTIATE_TEST_SUITE_P(Backends, IoEngine,
                         ::testing::Values(io::BackendKind::kUring, io::BackendKind::kPosix),
                         [](const auto& info) { return std::string(io::to_string(info.param)); });

}  // namespace
