// A budget plan for a model of the performance model (ebbtide plan
// --activation-budget): the per-layer profile the planner of planner.hpp
// would measure, predicted from the model's FLOPs and activation bytes, and
// the link of the report's hardware. Note [Budget from the model] in budget.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "ebbtide/plan/model.hpp"
#include "ebbtide/plan/planner.hpp"

namespace ebbtide::plan {

// One module per transformer layer (encoder, then decoder layers), then
// "head" (logits, what lies outside the layers, the encoder output shared
// by cross-attention), which is never recomputed. Throws InvalidArgument
// when the report's config already recomputes (--recompute).
std::vector<ModuleProfile> model_modules(const PlanReport& report);

// The report's SSDs behind its GPU's link (writes within forward, as on a
// GPU), and a host tier of host_budget_bytes over the link when > 0.
PlannerOptions model_planner_options(const PlanReport& report, uint64_t activation_budget_bytes,
                                     uint64_t host_budget_bytes = 0);

// The largest micro-batch whose budget plan fits what the GPU's memory
// leaves after the model state (options.sharding included), with what it
// offloads to the SSDs within their capacity: keep, offload or recompute
// per layer as plan_budget chooses. 0 when one sample does not fit.
// InvalidArgument when config recomputes already (--recompute).
int64_t max_micro_batch_budget(const ModelConfig& config, const GpuSpec& gpu, const SsdSpec& ssd,
                               const PlanOptions& options, uint64_t host_budget_bytes = 0);

}  // namespace ebbtide::plan
