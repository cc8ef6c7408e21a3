// Adaptive placement: from one profiled step (compute time and saved bytes per
// module, measured bandwidths) decide which modules' activations stay on the
// GPU, go to host memory or go to the SSD, so that offloading adds no stall;
// with an activation budget, also which modules are recomputed in backward,
// so that the predicted peak fits the budget at the least step time.
// The rules and their math: Note [Step model] in step_model.cpp (the step as
// the device runs it), Note [Offload rule] in planner.cpp, Note [Budget plan]
// in planner_budget.cpp, docs/model.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ebbtide::plan {

// One save of a module's forward, in save order (ModuleProfile::saves).
struct Save {
  uint64_t bytes = 0;
  // >= 0: a storage several modules save (HF Llama's rotary tables), with
  // the same id in each; its bytes belong to the first module that saves it
  // and the later ones hold it (Note [Shared storages] in step_model.cpp).
  // -1: the module's own.
  int64_t shared = -1;
};

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
  // The rest of the step as the allocator sees it (Note [Step model]):
  // the module's backward time measured without offloading (< 0:
  // backward_factor * forward_seconds); the gradient bytes its backward
  // allocates and holds to the step's end; the transient bytes above its
  // saves at its forward's end, and above its saves and gradients during its
  // backward (the allocator's peak inside it less its level there).
  double backward_seconds = -1;
  uint64_t grad_bytes = 0;
  uint64_t forward_temp_bytes = 0;
  uint64_t backward_temp_bytes = 0;
  // Its saves of `bytes` in save order (a trace's); empty: `bytes` saved
  // evenly through the forward. The own saves' bytes must sum to `bytes`.
  std::vector<Save> saves;
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
  // GPU: page-locked bytes that hold SSD-tier saves between their copy off
  // the device and the end of their SSD write (the cache's staging_bytes,
  // Note [SSD below the link]); a save that finds them full stays resident
  // (0: no bound).
  uint64_t staging_bytes = 1ull << 30;
  // The walk may offload a prefix of a module's saves, by bytes in save
  // order, where the whole module would stall or miss the forward (Note
  // [Partial offload]); ModuleDecision::offload_bytes is the prefix.
  bool partial_offload = false;
  // Bound on the predicted peak of resident saved bytes (0: none; then
  // plan_budget is plan_offload). Note [Budget plan].
  uint64_t activation_budget_bytes = 0;
  // Bound on the predicted allocator peak above the step's start: saved
  // bytes, reload buffers, gradients and temporaries (the figure
  // torch.cuda.max_memory_allocated() shows; 0: none). Note [Budget plan].
  uint64_t peak_budget_bytes = 0;
  // The cache's reload rules (Note [Reload lead] in step_model.cpp).
  // lead_per_module: the planner chooses each offloaded module's reload
  // lead, the shortest that hides its reload (ModuleDecision::lead_bytes),
  // and the window bounds nothing unless window_bytes is set; otherwise
  // every module's lead is the window: window_bytes, or when 0
  // prefetch_modules times the largest offloaded module (the glue's rule
  // before 2026-11-29, kept for replays).
  uint64_t window_bytes = 0;
  bool lead_per_module = true;
  // Kept saves count in the prefetch distance (the cache counts them).
  bool kept_in_distance = true;
  // A storage several modules save is reloaded in the order of its last
  // offloading saver's save, a prefetch skips it only while a kept holder
  // holds it, and a load made on demand runs on the priority stream (the
  // cache's rules); false: the rules before 2026-11-29 (its first saver's
  // place, offered to no later prefetch once found held; on demand behind
  // every queued load). Note [Shared storages] in step_model.cpp.
  bool shared_at_last_user = true;
  bool priority_loads = true;
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
  // Offloaded placements: how far ahead of the point backward has reached
  // its reloads may start, in bytes of saves in between (Note [Reload
  // lead]); the window's size unless the planner chose it per module.
  uint64_t lead_bytes = 0;
  double wait_seconds = 0;           // the device's waits in its backward (reloads not done)
  // GPU: the release point after its forward (Note [Release by bytes] in
  // step_model.cpp): the copies released through it, as offloaded bytes of
  // the step in save order.
  uint64_t release_bytes = 0;
  // Offloaded bytes backward used from the live tensor: their write had not
  // ended, or had not started when backward began (Note [Late stores]).
  uint64_t forwarded_bytes = 0;
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
  // Predicted allocator peak above the step's start: resident saved bytes,
  // reload buffers, recomputed activations, gradients and temporaries.
  uint64_t peak_allocated_bytes = 0;
  double peak_seconds = 0;            // when the allocator peak comes, from the step's start
  double backward_wait_seconds = 0;   // part of the stall: reloads not done when backward needs them
  uint64_t window_bytes = 0;          // the prefetch window the plan assumes
  uint64_t bytes_keep = 0;
  uint64_t bytes_cpu = 0;
  uint64_t bytes_ssd = 0;
  uint64_t bytes_recomputed = 0;      // saved bytes recompute avoids (bytes - saved_bytes)
  int64_t modules_recomputed = 0;
  double recompute_seconds = 0;       // forward re-run in backward, in all
  // A budget plan (Note [Budget plan]): the budgets, whether the plan meets
  // them, and, when it does not, the smallest peak the planner reached (the
  // smallest budget it can meet: of saved bytes, and of the allocator).
  uint64_t activation_budget_bytes = 0;
  uint64_t peak_budget_bytes = 0;
  bool feasible = true;
  uint64_t min_budget_bytes = 0;
  uint64_t min_peak_budget_bytes = 0;
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

// A step as it ran (the replay of a recorded run, Note [Step model]): the
// placements, offload limits, reload leads (0: the window) and, on a GPU, the
// release points the glue used (release_after[b]: the last module released
// after module b's forward, -1 none; empty: derived as the glue does).
struct RanPlan {
  std::vector<Placement> placements;
  std::vector<uint64_t> offload_limits;  // empty: whole modules
  std::vector<uint64_t> lead_bytes;      // empty: the window for all
  std::vector<int64_t> release_after;    // empty: derived
};
Plan simulate_ran(const std::vector<ModuleProfile>& modules, const PlannerOptions& options, const RanPlan& ran);

}  // namespace ebbtide::plan
