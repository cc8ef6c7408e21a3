// Note [Fault injection]
// Tests arm faults that the transfer loop (transfer.cpp) consumes just before
// it would issue a write: the write completes with the armed errno exactly as
// if the device had returned it, so every error path above the backend runs,
// in the engine and in the checkpoint writer alike. A fault targets either
// the anonymous slab of one directory (writes starting at or after an offset,
// `count` of them) or any named file (the next write reaching past an offset;
// one at a time, re-arming replaces it). A parking fault stops the writing
// thread for good, so a crash test can kill a process with a save half done.
// A hold (hold_file_writes) stops writes into named files until the test
// releases it: a save then stays in flight for as long as the test needs.
#include "ebbtide/io/faults.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "ebbtide/io/direct_file.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io {
namespace {

struct Fault {
  bool named_files;  // any named file; else the anonymous file in `dir`
  std::string dir;
  uint64_t after;
  int err;  // < 0: park
  int count;

  bool hits(const DirectFile& f, uint64_t offset, uint64_t len) const {
    if (named_files) return !f.anonymous() && offset + len > after;
    return f.anonymous() && f.dir() == dir && offset >= after;
  }
};
std::mutex g_mu;
std::vector<Fault> g_faults;
std::atomic<bool> g_armed{false};
std::condition_variable g_release;  // with g_mu
std::atomic<bool> g_holding{false};  // written under g_mu, so a waiter cannot miss the release
int g_held = 0;                      // under g_mu

void drop_named_locked() {
  std::erase_if(g_faults, [](const Fault& f) { return f.named_files; });
  g_armed = !g_faults.empty();
}

}  // namespace

void inject_write_fault(const std::string& dir, uint64_t after_bytes, int err, int count) {
  EBB_CHECK(err > 0 && count > 0, "inject_write_fault: errno and count must be positive");
  std::error_code ec;
  auto canon = std::filesystem::canonical(dir, ec);
  std::lock_guard lock(g_mu);
  g_faults.push_back({false, ec ? dir : canon.string(), after_bytes, err, count});
  g_armed = true;
}

void inject_file_write_fault(uint64_t after_bytes, int err) {
  std::lock_guard lock(g_mu);
  drop_named_locked();
  if (err == 0) return;
  g_faults.push_back({true, "", after_bytes, err, 1});
  g_armed = true;
}

void hold_file_writes(bool hold) {
  {
    std::lock_guard lock(g_mu);
    g_holding = hold;
  }
  if (!hold) g_release.notify_all();
}

int held_file_writes() {
  std::lock_guard lock(g_mu);
  return g_held;
}

void clear_faults() {
  {
    std::lock_guard lock(g_mu);
    g_faults.clear();
    g_armed = false;
    g_holding = false;
  }
  g_release.notify_all();
}

int detail::take_write_fault(const DirectFile& file, uint64_t offset, uint64_t len) {
  if (g_holding.load(std::memory_order_relaxed) && !file.anonymous()) {
    std::unique_lock lock(g_mu);
    ++g_held;
    g_release.wait(lock, [] { return !g_holding.load(); });
    --g_held;
  }
  if (!g_armed.load(std::memory_order_relaxed)) return 0;
  int err = 0;
  {
    std::lock_guard lock(g_mu);
    for (auto it = g_faults.begin(); it != g_faults.end(); ++it) {
      if (it->count <= 0 || !it->hits(file, offset, len)) continue;
      err = it->err;
      if (err > 0 && --it->count == 0) g_faults.erase(it);
      g_armed = !g_faults.empty();
      break;
    }
  }
  if (err < 0) {
    log::warn("io: write of ", file.label(), " at ", offset, " parked by the test hook");
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  return err;
}

}  // namespace ebbtide::io
