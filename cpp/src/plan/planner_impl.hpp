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

// The timing model of Note [Offload rule]; the O(n^2) peak-memory scan only
// when with_peak. Inputs already validated. `area`, when given, receives the
// sum of the resident bytes at every point the peak scan looks at (Note
// [Budget plan]'s tie-break). `limits` (may be null: every module whole):
// Note [Partial offload].
Plan simulate(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
              const std::vector<Placement>& placements, bool with_peak, double* area = nullptr,
              const std::vector<uint64_t>* limits = nullptr);

}  // namespace ebbtide::plan::detail
