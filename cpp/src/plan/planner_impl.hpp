// Internal: what the offload planner (planner.cpp: the timing model, the
// greedy walk) and the budget search (planner_budget.cpp) share.
#pragma once

#include <cstdint>
#include <vector>

#include "ebbtide/plan/planner.hpp"

namespace ebbtide::plan::detail {

// Throws InvalidArgument naming the module or setting that is out of range.
void validate(const std::vector<ModuleProfile>& modules, const PlannerOptions& o);

// The SSD tier's planned write rate: the measured one, capped by max_write_bps.
double ssd_write_rate(const PlannerOptions& o);

// The step model of Note [Step model] (step_model.cpp). Inputs already
// validated. `area`, when given, receives the sum of the resident saved
// bytes at each module's forward end and backward start (Note [Budget
// plan]'s tie-break). `limits` (null: every module whole): Note [Partial
// offload]. `leads` (null or empty: the window, or with lead_per_module the
// lead that spans enough backward time): Note [Reload lead]. `release_after`
// (null or empty: the glue's rule on the model's own times): Note [Release
// points]. `with_peak` is kept for callers; the model always counts memory.
Plan simulate(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
              const std::vector<Placement>& placements, bool with_peak, double* area = nullptr,
              const std::vector<uint64_t>* limits = nullptr, const std::vector<uint64_t>* leads = nullptr,
              const std::vector<int64_t>* release_after = nullptr, bool asap = false);

// With lead_per_module: `plan`'s reload leads made explicit (the latest
// start that hides each reload, Note [Reload lead]), lengthened, at module
// boundaries, where a reload still waits; returns the plan simulated with them.
Plan refine_leads(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
                  const std::vector<Placement>& placements, const std::vector<uint64_t>& limits, Plan plan);

}  // namespace ebbtide::plan::detail
