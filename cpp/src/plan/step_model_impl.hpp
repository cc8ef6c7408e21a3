// Internal: the step model's simulation (Note [Step model] in
// step_model.cpp), its forward and memory in step_model.cpp, its backward
// and reloads in step_model_backward.cpp.
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <queue>
#include <set>
#include <utility>
#include <vector>

#include "ebbtide/plan/planner.hpp"
#include "planner_impl.hpp"

namespace ebbtide::plan::detail {

constexpr size_t kChunks = 8;
constexpr size_t kNone = std::numeric_limits<size_t>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();

// One allocation a save makes (Note [Shared storages]).
struct Storage {
  uint64_t bytes = 0;
  size_t owner = 0;
  bool entry = false;     // offloaded: an entry of the cache
  int tier = 0;           // 0 cpu, 1 ssd
  bool fixed = false;     // too small to move (fixed_bytes)
  double made = 0;        // when its save was made
  double copy_end = 0;    // GPU: device-to-host copy; worker: the write
  double write_end = 0;   // the SSD write (GPU SSD tier), else copy_end
  double write_start = 0;
  bool released = false;  // GPU: its copy was waited for; worker: written
  bool cancelled = false; // worker path: store cancelled when backward began (resident)
  int kept_holders = 0;   // kept handles alive
  bool alive = true;      // the original allocation is held
  size_t order_pos = kNone;
  size_t lead_module = 0; // whose lead applies (the module at its order position)
  std::vector<size_t> core_users;  // modules holding the entry, ascending
  int core_left = 0;      // core users whose backward has not used it
  bool loading = false, consumed = false;
  bool consumed_walks = false;  // offered to no more prefetch walks (rules before 2026-11-29)
  double load_issue = 0, load_end = 0;
};

// A save in a module's forward.
struct SaveEvent {
  size_t storage = 0;
  double frac = 1;  // of the module's forward when it is made (production)
  enum Role : uint8_t { kNewOffload, kNewKept, kCoreRef, kKeptRef } role = kNewKept;
  double at = 1;    // its place in the module's saves, by bytes: backward uses it at 1 - at of its time
};

struct Position {
  uint64_t bytes = 0;
  size_t storage = kNone;  // loadable entries only
};

// bytes / rate in seconds (infinite for a rate of 0, 0 for no bytes).
double rate_time(uint64_t bytes, double rate);
// The earliest t' >= t at which the queues, each busy until w[k] draining at
// rate[k], hold at most `slack` bytes. Piecewise linear: solve on the tiers
// still busy, dropping the one that empties first when the root lies beyond it.
double drained_by(const double w[2], const double rate[2], double t, double slack);

// One step played (Note [Step model]); run() once.
class StepSim {
 public:
  StepSim(const std::vector<ModuleProfile>& modules, const PlannerOptions& o, const std::vector<Placement>& placements,
          const std::vector<uint64_t>* limits, const std::vector<uint64_t>* leads,
          const std::vector<int64_t>* release_after, bool asap)
      : m_(modules), o_(o), pl_(placements), limits_(limits), leads_(leads), release_after_(release_after),
        n_(modules.size()), device_(o.writes_within_forward), asap_(asap) {
    write_rate_[0] = o.host_write_bps;
    write_rate_[1] = ssd_write_rate(o);
    read_rate_[0] = o.host_read_bps;
    read_rate_[1] = o.read_bps;
  }

  Plan run(double* area);

 private:
  // ------------------------------------------------------------ the saves
  double backward_of(size_t i) const;

  size_t new_storage(uint64_t bytes, size_t owner);

  // Each module's saves in order, with the roles the hooks give them
  // (python/src/torch/hooks.cpp: pack), and the plan's byte counts.
  void build();

  static int tier_of(Placement p);

  // ---------------------------------------------------------------- memory
  // The allocator's level, changed in the compute stream's order; frees that
  // complete elsewhere (worker writes) apply when the stream passes them.
  void alloc(uint64_t bytes, bool saved = true);
  void release_memory(uint64_t bytes, bool saved = true);
  void note_peak(uint64_t temp);
  void at(double t);
  // The original allocation goes once no kept handle holds it and its
  // entry (if any) no longer does.
  void maybe_free(size_t s);
  void free_original(size_t s);

  // --------------------------------------------------------------- forward
  void enqueue_copy(size_t s, double made);

  // The compute stream waits for every held copy up to `s` (inclusive, in
  // copy order) and the glue drops those saves.
  double release_through(size_t count, double t);
  void drop_released();

  void forward();

  // Note [Release points]: after module i, the compute stream waits for the
  // copies up to the last module the rule names, and their saves are dropped.
  void release_after_module(size_t i, double& t);

  // Whether the staging bytes have room for `bytes` more at `t`: SSD-tier
  // saves hold their room from their copy until their SSD write ends.
  bool staging_room(uint64_t bytes, double t);

  // The forward order the prefetch walks (Note [Prefetch distance]).
  void push_position(const SaveEvent& e);
  void move_position(size_t s);

  // -------------------------------------------------------------- backward
  double lead_of(const Storage& x) const;

  bool loadable_now(const Storage& x, double now) const;

  // Issues the load of entry s at `now`, on the priority stream when asked.
  void issue_load(size_t s, double now, bool priority);

  // The cache's prefetch from the point backward has reached (`end`, a
  // position in the order) at `now`.
  void walk(size_t end, double now, size_t module);

  void backward();

  // Note [Reload lead]: each offloaded module's reload as late as its
  // backward allows, on the queue it shares: from the last module backward
  // reaches (the first saved) up, the reload ends by its module's backward
  // start or by the start of the reload served after it, whichever is
  // earlier; its lead reaches the last module boundary before that start.
  // Backward starts are the nominal ones (no waits), from the forward's end.
  void compute_auto_leads();
  double rec_of(size_t i) const;

  void finish();

  const std::vector<ModuleProfile>& m_;
  const PlannerOptions& o_;
  const std::vector<Placement>& pl_;
  const std::vector<uint64_t>* limits_;
  const std::vector<uint64_t>* leads_;
  const std::vector<int64_t>* release_after_;
  size_t n_;
  bool device_;
  bool asap_;
  double write_rate_[2] = {0, 0};
  double read_rate_[2] = {0, 0};
  Plan plan_;
  std::vector<Storage> st_;
  std::vector<std::vector<SaveEvent>> saves_;
  std::vector<Position> positions_;
  std::vector<double> cum_;
  std::vector<double> auto_leads_;
  std::set<size_t> pending_;  // order positions of entries no walk has loaded yet
  double window_ = 0, window_used_ = 0, max_lead_ = 0;
  // Queues.
  double link_free_ = 0, load_free_ = 0, priority_free_ = 0;
  double tier_free_[2] = {0, 0};
  double read_free_[2] = {0, 0};
  std::deque<size_t> backlog_;
  std::deque<size_t> staging_;  // SSD-tier saves holding staging room
  uint64_t backlog_bytes_ = 0;
  uint64_t released_bytes_ = 0;  // copies released so far, in copy order
  std::vector<size_t> released_now_, pending_writes_;
  std::priority_queue<std::pair<double, size_t>, std::vector<std::pair<double, size_t>>, std::greater<>> frees_;
  // Memory.
  double alloc_ = 0, saved_ = 0, peak_alloc_ = 0, peak_saved_ = 0, area_ = 0;
  double t_ = 0, compute_forward_ = 0, now_ = 0;
  std::vector<size_t> module_begin_, module_end_;  // each module's saves in the order
};

}  // namespace ebbtide::plan::detail
