// Megatron-core in the planner's terms: what each of Megatron's
// --offload-modules takes per layer (Note [Megatron family] in
// model_activations.cpp), and the Megatron flags (full recompute of the first
// layers, fine-grained activation offloading) that fit an activation budget
// at the least predicted step time, judged by the same model and timing as
// every budget plan (Note [Megatron flags] in megatron.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ebbtide/plan/model.hpp"
#include "ebbtide/plan/planner.hpp"

namespace ebbtide::plan {

// Bytes one layer of a family megatron config saves inside each module whose
// input Megatron's fine-grained offloading can move, per TP rank; `rest` is
// what no offload module takes. total() is the layer's activation bytes.
// InvalidArgument for another family.
struct MegatronLayerSaves {
  double attn_norm = 0;
  double qkv_linear = 0;
  double core_attn = 0;
  double attn_proj = 0;
  double mlp_norm = 0;
  double rest = 0;
  double total() const { return attn_norm + qkv_linear + core_attn + attn_proj + mlp_norm + rest; }
  // The bytes the named modules take ("attn_norm", ..., "mlp_norm"); InvalidArgument names an unknown one.
  double of(const std::vector<std::string>& modules) const;
};
MegatronLayerSaves megatron_layer_saves(const ModelConfig& config);

// Megatron's settings for one rank's layers and what they give in the model.
struct MegatronPlan {
  int64_t recompute_num_layers = 0;          // --recompute-granularity full --recompute-method block
  std::vector<std::string> offload_modules;  // --fine-grained-activation-offloading --offload-modules
  std::vector<std::string> flags;            // the command-line flags, one setting per element
  Plan plan;                                 // simulate_plan of these settings (placements per layer, head)
  uint64_t resident_bytes = 0;               // saved bytes left in device memory after the forward
  uint64_t offloaded_bytes = 0;              // saved bytes Megatron copies to host memory
};

// The Megatron settings for `report`'s config (family megatron, recompute
// none) whose simulated peak fits `activation_budget_bytes` at the least
// predicted step time (ties: fewer bytes moved, then fewer layers
// recomputed); the lowest peak with plan.feasible false when none fits.
// Offload modules are tried only with host_budget_bytes > 0 (Megatron
// offloads to host memory) and only those whose offloaded bytes fit it.
// InvalidArgument for another family or a config that recomputes.
MegatronPlan plan_megatron(const PlanReport& report, uint64_t activation_budget_bytes,
                           uint64_t host_budget_bytes = 0);

}  // namespace ebbtide::plan
