// Internal: background removal of replaced checkpoints (Note [Deferred removal]
// in writer.cpp). Thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

namespace ebbtide::ckpt::detail {

// True while some Reaper of this process has `dir` queued or is removing it;
// remove_stale_temps() leaves such directories alone.
bool being_removed(const std::string& dir);

// Removes directories one after another on its own thread, so that neither
// the save that replaced them nor the next save waits for the filesystem to
// free their extents (unlinking GBs takes ~0.15 s per GB on a discard mount).
class Reaper {
 public:
  Reaper() = default;
  ~Reaper();  // finishes the queue
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;
  void remove(std::string dir);  // queues `dir`; failures are logged, never thrown
  void drain();                  // waits until the queue is empty and nothing runs

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> queue_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;
};

}  // namespace ebbtide::ckpt::detail
