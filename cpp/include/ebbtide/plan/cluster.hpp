// Model state per GPU under data parallelism: parameters, gradients and
// optimizer state sharded per ZeRO stage (Rajbhandari et al. 2020) or FSDP,
// plus the parameters FSDP gathers for the unit it runs and the one it
// prefetches. Pure arithmetic; docs/model.md, "Model state under ZeRO and FSDP".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ebbtide::plan {

// How model state is held across `dp` data-parallel GPUs. zero_stage 0 keeps
// a full replica per GPU; 1 shards the optimizer state, 2 also the gradients,
// 3 (FSDP) also the parameters, each over `shard_group` GPUs (0: all of dp;
// a divisor of dp for hybrid sharding, replicated across dp / shard_group
// groups). Bytes per parameter: param_bytes for the training copy (2: bf16,
// 4: fp32), grad_bytes for its gradient, optimizer_bytes (K) for everything
// the optimizer keeps (12: fp32 master weights and Adam's two moments).
struct ShardingOptions {
  int64_t dp = 1;
  int64_t zero_stage = 0;
  int64_t shard_group = 0;
  double param_bytes = 2;
  double grad_bytes = 2;
  double optimizer_bytes = 12;

  int64_t shard_over() const;  // N: the GPUs each tensor is sharded over (1 for stage 0)
};

// Throws InvalidArgument naming the setting: dp >= 1, stage 0..3, shard_group
// 0 or a divisor of dp (and only with stage >= 1), byte sizes > 0 (K >= 0).
void validate_sharding(const ShardingOptions& options);

// A named optimizer's K (bytes per parameter beyond the parameter and its
// gradient); optimizer_presets() lists them for the CLI and docs.
struct OptimizerPreset {
  std::string name;
  std::string description;
  double optimizer_bytes;
};
const std::vector<OptimizerPreset>& optimizer_presets();
const OptimizerPreset& find_optimizer(std::string_view name);  // InvalidArgument lists the names

// The parameters FSDP moves as units: each layer is a unit; everything else
// (embeddings, LM head, final norm) is the root unit. Counts per tensor-
// parallel rank.
struct ParameterUnits {
  double total = 0;        // Φ
  double largest_layer = 0;
  double root = 0;         // total - all layers
  double self_layer = 0;   // a self-attention layer (an encoder layer of an encoder-decoder)
  double cross_layer = 0;  // an encoder-decoder's decoder layer (0 without one)
};

// Per-GPU model state in bytes; total = params + grads + optimizer +
// gathered_unit + prefetch_unit + root_unit.
struct ModelStateBytes {
  int64_t shard_over = 1;
  double params = 0;         // the (sharded) training copy
  double grads = 0;
  double optimizer = 0;
  double gathered_unit = 0;  // stage 3: the largest layer's parameters, all-gathered
  double prefetch_unit = 0;  // stage 3: the next layer, gathered ahead
  double root_unit = 0;      // stage 3: the root unit, kept gathered from forward to backward
  double total = 0;
};
ModelStateBytes model_state_bytes(const ParameterUnits& units, const ShardingOptions& options);

// A cluster's interconnect per GPU, one direction, 1e9 bytes/s: inside a node
// (NVLink) and across nodes (the node's NICs shared by its GPUs: a ring that
// all of a node's GPUs join runs at gpus_per_node x inter_gbps, Note
// [Collective time]), and the latency of one step of a ring collective.
struct NetworkSpec {
  std::string name;  // catalog key, e.g. "dgx-h100"
  std::string description;
  int64_t gpus_per_node;
  double intra_gbps;
  double inter_gbps;
  double latency_us;
};
const std::vector<NetworkSpec>& network_catalog();
const NetworkSpec& find_network(std::string_view name);  // InvalidArgument lists the names

// Seconds per step (per GPU) of the data-parallel collectives.
struct CommTimes {
  double gather_seconds = 0;       // stage 3: the largest layer's all-gather
  double reduce_seconds = 0;       // stage 3: the largest layer's reduce-scatter (+ HSDP all-reduce)
  double unit_forward_seconds = 0; // the largest layer's forward compute
  double unit_backward_seconds = 0;
  double comm_seconds = 0;         // all collectives of a step
  double exposed_seconds = 0;      // the part compute does not hide
  double step_seconds = 0;         // compute + exposed
  double scaling_efficiency = 1;   // compute / step
};

}  // namespace ebbtide::plan
