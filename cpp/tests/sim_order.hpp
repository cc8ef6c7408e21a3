// The happens-before bookkeeping of the simulated GPU (Note [Simulated GPU]
// in sim_driver.hpp): vector clocks over (device, stream), the copies that
// touched host memory, checked for unordered conflicting accesses, and the
// state the simulator keeps per capture, stream, event and block.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::test::sim {

using SKey = std::pair<int, mem::cuda::Stream>;  // (device, handle)
using VC = std::map<SKey, uint64_t>;             // per stream: operations that happened before

inline void join(VC& into, const VC& from) {
  for (const auto& [k, v] : from) {
    uint64_t& x = into[k];
    x = std::max(x, v);
  }
}
inline bool covers(const VC& have, const VC& need) {
  for (const auto& [k, v] : need) {
    auto it = have.find(k);
    if (it == have.end() || it->second < v) return false;
  }
  return true;
}
inline std::string name(const SKey& k) {
  return k.second == 0 ? detail::concat("the default stream of device ", k.first)
                       : detail::concat("stream ", k.second, " of device ", k.first);
}

// An operation of a stream: its place in the stream's order, and what it was.
struct Access {
  SKey stream;
  uint64_t seq = 0;
  std::string what;
};

// Copies touching host memory, kept until the host's point (which every
// later operation follows) is known to come after them.
class HostAccesses {
 public:
  // A copy `by` at stream point `point` touched [p, p + n), writing it or
  // not: a race for each earlier copy touching it, one of the two writing,
  // not ordered before `point`.
  void check(const unsigned char* p, size_t n, bool write, const Access& by, const VC& point, const VC& host,
             std::vector<std::string>& races) {
    std::erase_if(list_, [&](const Entry& a) {
      auto it = host.find(a.by.stream);
      return it != host.end() && it->second >= a.by.seq;
    });
    for (const Entry& a : list_) {
      if (!(a.write || write) || a.p >= p + n || p >= a.p + a.n) continue;
      auto it = point.find(a.by.stream);
      if (it != point.end() && it->second >= a.by.seq) continue;
      races.push_back(detail::concat("host memory at ", static_cast<const void*>(p), " (", n, " bytes) ",
                                     write ? "written" : "read", " by ", by.what, " while ", a.by.what,
                                     " touching it is not ordered before that"));
    }
    list_.push_back(Entry{p, n, write, by});
  }

 private:
  struct Entry {
    const unsigned char* p = nullptr;
    size_t n = 0;
    bool write = false;
    Access by;
  };
  std::vector<Entry> list_;
};

// The simulator's state (SimDriver's, under its lock).
struct Capture {
  SKey origin;
  std::thread::id thread;
  size_t errors_at_begin = 0;
  std::map<SKey, uint64_t> ops;       // captured operations per stream
  std::map<SKey, uint64_t> rejoined;  // the origin waited for them up to here
};
struct StreamState {
  double tail = 0;
  VC vc;
  uint64_t waits = 0;
};
struct EventState {
  int device = 0;
  bool timed = false;  // event_create_timed
  VC vc;
  double time = 0;
  bool recorded = false;
  std::shared_ptr<Capture> capture;  // recorded inside this capture
  SKey capture_stream{};
  uint64_t capture_ops = 0;
};
struct Block {
  std::unique_ptr<unsigned char[]> mem;
  mem::cuda::DevicePtr ptr = 0;
  size_t size = 0;
  int device = 0;
  SKey stream;
  bool in_use = false;
  bool mapped = true;
  std::string label;
  VC free_point;
  std::vector<SKey> uses;
  VC use_points;
  std::vector<Access> accessors;
};

}  // namespace ebbtide::test::sim
