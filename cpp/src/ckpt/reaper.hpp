// Internal: background removal of replaced checkpoints (Note [Deferred removal]
// in writer.cpp) and replaced files (Note [Replaced files] in safetensors.cpp).
// Thread-safe.
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

// Removes directories, and closes descriptors of files that were renamed
// over, one after another on its own thread, so that neither the save that
// replaced them nor the next save waits for the filesystem to free their
// extents (unlinking GBs takes ~0.15 s per GB on a discard mount).
class Reaper {
 public:
  Reaper() = default;
  ~Reaper();  // finishes the queue
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;
  void remove(std::string dir);  // queues `dir`; failures are logged, never thrown
  // Queues closing `fd`, this process's last reference to a file unlinked or
  // renamed over: the kernel frees the file's blocks at that close. Takes
  // ownership of `fd`.
  void close_later(int fd);
  void drain();  // waits until the queue is empty and nothing runs
  // Tests: while paused the thread starts no job (drain() then waits).
  void pause(bool paused);

 private:
  struct Job {
    std::string dir;  // a directory to remove, or
    int fd = -1;      // a descriptor to close
  };
  void push(Job job);
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool busy_ = false, stop_ = false, paused_ = false;
  std::thread thread_;
};

}  // namespace ebbtide::ckpt::detail
