// Adaptive placement: from one profiled step (compute time and saved bytes per
// module, measured bandwidths) decide which modules' activations stay on the
// GPU, go to host memory or go to the SSD, so that offloading adds no stall;
// with an activation budget, also which modules are recomputed in backward,
// so that the predicted peak fits the budget at the least step time.
// The rules and their math: Note [Offload rule] in planner.cpp, Note
// [Budget plan] in planner_budget.cpp, docs/model.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ebbtide::plan {

// One module, in forward order: its forward compute time and the bytes it saves for backward.
struct ModuleProfile {
  std::string name;
  double forward_seconds = 0;
  uint64_t bytes = 0;
  // Saved bytes that stay resident under keep and offload placements (the
  // tensors too small to offload); counted in the peak, never moved.
  uint64_t fixed_bytes = 0;
  // Recompute (budget plans only): the module's forward can be re-run in
  // backward; it then saves only `recompute_bytes` (its inputs, and whatever
  // its scope saves after the recomputed part) and backward re-runs
  // `recompute_seconds` of forward (< 0: forward_seconds).
  bool recomputable = false;
  uint64_t recompute_bytes = 0;
  double recompute_seconds = -1;
};

// Bandwidths in bytes/s. A tier with zero write or read bandwidth is unused;
// host memory is used only with host_budget_bytes > 0, and is filled first.
struct PlannerOptions {
  double write_bps = 0;             // measured SSD write bandwidth
  double read_bps = 0;              // measured SSD read bandwidth
  double max_write_bps = 0;         // cap on SSD writes (0: no cap)
  uint64_t host_budget_bytes = 0;   // host-memory tier in front of the SSD
  double host_write_bps = 0;
  double host_read_bps = 0;
  int64_t keep_last_modules = 1;    // the last modules' activations always stay resident
  double backward_factor = 2.0;     // backward time = factor * forward time, per module
  int64_t prefetch_modules = 2;     // the prefetch window: this many times the largest offloaded module
  double stall_tolerance_seconds = 0;  // stall a single offload may add and still be accepted
  double replan_fraction = 0.7;     // needs_replan() below this fraction of the planned bandwidth
  // GPU offload (Note [Release points]): a module is offloaded only if its
  // write ends before the forward does, since memory comes back only then and
  // a later write would stall the compute stream at the start of backward.
  bool writes_within_forward = false;
  // The worker path (host tensors, Note [Guarded writes] in planner.cpp): a
  // tensor's memory comes back when its own write ends, and under a budget
  // the cache's saves wait while more than the budget less the plan's kept
  // bytes wait to be stored. The model then counts only the unwritten part
  // of a module's bytes and makes the forward wait rather than exceed the
  // budget.
  bool guarded_writes = false;
  // GPU (Note [Copy bound] in tensor_cache_device.cpp): the compute stream
  // waits while more than this many bytes of device copies (either tier's)
  // are queued ahead of it (the cache's device_inflight_bytes; 0: no bound). The model
  // makes the forward wait as the device does (Note [Copy bound in the plan]),
  // so a plan the bound would slow down costs its stall.
  uint64_t copy_bound_bytes = 0;
  // The walk may offload a prefix of a module's saves, by bytes in save
  // order, where the whole module would stall or miss the forward (Note
  // [Partial offload]); ModuleDecision::offload_bytes is the prefix.
  bool partial_offload = false;
  // Bound on the predicted peak of resident saved bytes (0: none; then
  // plan_budget is plan_offload). Note [Budget plan].
  uint64_t activation_budget_bytes = 0;
};

// recompute_offload_*: recomputed, and the bytes it still saves are offloaded.
enum class Placement { kKeep, kOffloadCpu, kOffloadSsd, kRecompute, kRecomputeOffloadCpu, kRecomputeOffloadSsd };
// "keep", "offload_cpu", "offload_ssd", "recompute", "recompute_offload" (both tiers).
std::string to_string(Placement placement);
// The tier a placement writes to: "cpu", "ssd", or "" (none).
std::string tier_name(Placement placement);
// Inverse of to_string, with recompute_offload spelled per tier
// ("recompute_offload_cpu", "recompute_offload_ssd"); InvalidArgument names the valid ones.
Placement parse_placement(const std::string& name);
bool is_recompute(Placement placement);
bool is_offload(Placement placement);

struct ModuleDecision {
  std::string name;
  Placement placement = Placement::kKeep;
  uint64_t bytes = 0;                // all the module saves when kept
  uint64_t saved_bytes = 0;          // what it saves under its placement (bytes, or recompute_bytes)
  uint64_t fixed_bytes = 0;          // resident whatever happens (not under recompute)
  double recompute_seconds = 0;      // forward re-run in its backward (recompute placements)
  double forward_end_seconds = 0;    // from the start of the step (after the module's guard waits)
  double write_done_seconds = 0;     // offloaded only
  double read_start_seconds = 0;     // offloaded only
  double backward_start_seconds = 0; // including the stalls before it
  // Offloaded placements: the bytes moved, the first offload_bytes of the
  // module's saves in save order (Note [Partial offload]); saved_bytes when
  // the whole module moves, less for a partial one, whose rest stays
  // resident. 0 for placements that move nothing.
  uint64_t offload_bytes = 0;
  bool partial() const { return offload_bytes < saved_bytes && offload_bytes > 0; }
};

struct Plan {
  std::vector<ModuleDecision> modules;
  double forward_seconds = 0;
  double backward_seconds = 0;        // without stalls
  double predicted_stall_seconds = 0; // includes forward_wait_seconds
  double forward_wait_seconds = 0;    // saves waiting for writes (guarded_writes)
  uint64_t all_resident_bytes = 0;    // peak when nothing is offloaded
  uint64_t peak_resident_bytes = 0;   // predicted peak with this plan
  uint64_t bytes_keep = 0;
  uint64_t bytes_cpu = 0;
  uint64_t bytes_ssd = 0;
  uint64_t bytes_recomputed = 0;      // saved bytes recompute avoids (bytes - saved_bytes)
  int64_t modules_recomputed = 0;
  double recompute_seconds = 0;       // forward re-run in backward, in all
  // A budget plan (Note [Budget plan]): the budget, whether the plan meets it,
  // and, when it does not, the smallest peak the planner reached (the
  // smallest budget it can meet).
  uint64_t activation_budget_bytes = 0;
  bool feasible = true;
  uint64_t min_budget_bytes = 0;
  double planned_write_bps = 0;       // SSD write bandwidth the plan assumed (after the cap)
  double planned_read_bps = 0;
  double replan_fraction = 0.7;

  // forward + backward + recompute + stall.
  double predicted_step_seconds() const {
    return forward_seconds + backward_seconds + recompute_seconds + predicted_stall_seconds;
  }
  double peak_resident_fraction() const {
    return all_resident_bytes ? static_cast<double>(peak_resident_bytes) / static_cast<double>(all_resident_bytes) : 1.0;
  }
  // True when the plan offloads to the SSD and `measured_write_bps` fell below
  // replan_fraction * planned_write_bps. Throws InvalidArgument for a negative rate.
  bool needs_replan(double measured_write_bps) const;
  // True when the plan offloads to the SSD and `measured_write_bps` rose above
  // planned_write_bps / replan_fraction: the profiling step's writes go to
  // fresh files and run slower than later steps' (2.4x on the CI VM), so a
  // plan made from them may recompute or keep what the link can carry.
  bool link_faster(double measured_write_bps) const;
};

// Throws InvalidArgument for negative times or bandwidths, a bad fraction or
// factor, or keep_last_modules < 0 (each message names the setting or module).
Plan plan_offload(const std::vector<ModuleProfile>& modules, const PlannerOptions& options);

// With options.activation_budget_bytes > 0: keep, offload or recompute per
// module so that the predicted peak fits the budget at the least predicted
// step time (Note [Budget plan]); a budget no mix meets gives the plan with
// the smallest peak found, feasible = false and min_budget_bytes set. Without
// a budget, plan_offload.
Plan plan_budget(const std::vector<ModuleProfile>& modules, const PlannerOptions& options);

// Replays `placements` (one per module) with the same timing model; the plan's
// decisions are those given. Used by plan_offload and by tests.
Plan simulate_plan(const std::vector<ModuleProfile>& modules, const PlannerOptions& options,
                   const std::vector<Placement>& placements);
// The same with a byte limit per module (Note [Partial offload]): an
// offloaded module moves min(limit, its saved bytes), the first bytes of its
// saves; kWholeModule moves all of them. InvalidArgument for a limit of 0 on
// an offloaded module (keep it instead) or a size mismatch.
inline constexpr uint64_t kWholeModule = ~uint64_t{0};
Plan simulate_plan(const std::vector<ModuleProfile>& modules, const PlannerOptions& options,
                   const std::vector<Placement>& placements, const std::vector<uint64_t>& offload_limits);

}  // namespace ebbtide::plan
