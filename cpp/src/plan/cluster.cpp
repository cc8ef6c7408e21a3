#include "ebbtide/plan/cluster.hpp"


#include "ebbtide/util/error.hpp"

namespace ebbtide::plan {

int64_t ShardingOptions::shard_over() const {
  if (zero_stage == 0) return 1;
  return shard_group > 0 ? shard_group : dp;
}

void validate_sharding(const ShardingOptions& o) {
  EBB_CHECK(o.dp >= 1, "plan setting 'dp' must be a positive integer, got ", o.dp);
  EBB_CHECK(o.zero_stage >= 0 && o.zero_stage <= 3, "plan setting 'zero' must be 0, 1, 2 or 3, got ",
            o.zero_stage);
  EBB_CHECK(o.shard_group >= 0, "plan setting 'shard_group' must be >= 0 (0: all of dp), got ", o.shard_group);
  EBB_CHECK(o.shard_group == 0 || o.zero_stage > 0,
            "plan setting 'shard_group' (", o.shard_group, ") needs zero stage 1, 2 or 3 (got 0)");
  EBB_CHECK(o.shard_group == 0 || o.dp % o.shard_group == 0, "plan setting 'shard_group' (", o.shard_group,
            ") must divide 'dp' (", o.dp, "): hybrid sharding replicates whole groups");
  EBB_CHECK(o.param_bytes > 0, "plan setting 'param_bytes' must be > 0, got ", o.param_bytes);
  EBB_CHECK(o.grad_bytes > 0, "plan setting 'grad_bytes' must be > 0, got ", o.grad_bytes);
  EBB_CHECK(o.optimizer_bytes >= 0, "plan setting 'optimizer_bytes' must be >= 0, got ", o.optimizer_bytes);
}

// Note [Optimizer bytes]: K per parameter with bf16 parameters and gradients
// (mixed precision) keeps an fp32 master copy (4) beside the optimizer's own
// state: Adam two fp32 moments (8), bitsandbytes 8-bit Adam two 1-byte
// moments (2), SGD with momentum one (4), plain SGD none. fp32 training has
// no master copy: Adam's K is 8 with 4-byte parameters and gradients.
const std::vector<OptimizerPreset>& optimizer_presets() {
  static const std::vector<OptimizerPreset> kPresets = {
      {"adam", "Adam/AdamW, mixed precision: fp32 master + two fp32 moments", 12},
      {"adam-8bit", "8-bit Adam (bitsandbytes), mixed precision: fp32 master + two 1-byte moments", 6},
      {"sgd-momentum", "SGD with momentum, mixed precision: fp32 master + fp32 momentum", 8},
      {"sgd", "SGD without momentum, mixed precision: fp32 master", 4},
      {"adam-fp32", "Adam/AdamW in fp32 (use with 4-byte params and grads): two fp32 moments", 8},
  };
  return kPresets;
}

// Note [ZeRO model state]: with P, G, K bytes per parameter and Φ parameters
// per tensor-parallel rank, sharded over N GPUs, stage 0 holds (P+G+K)Φ,
// stage 1 (P+G)Φ + KΦ/N, stage 2 PΦ + (G+K)Φ/N, stage 3 (P+G+K)Φ/N (the
// ZeRO paper's figure 1 with P = G = 2, K = 12). Stage 3 gathers a unit's
// full parameters to run it and prefetches the next (FSDP2's default
// forward and backward prefetch of one unit); FSDP2 does not reshard the
// root unit after forward, so its gathered copy lives through backward.
ModelStateBytes model_state_bytes(const ParameterUnits& units, const ShardingOptions& o) {
  validate_sharding(o);
  EBB_CHECK(units.total > 0 && units.largest_layer >= 0 && units.root >= 0,
            "parameter units must be non-negative with a positive total, got total ", units.total,
            ", largest layer ", units.largest_layer, ", root ", units.root);
  ModelStateBytes m;
  m.shard_over = o.shard_over();
  const double n = static_cast<double>(m.shard_over);
  const double phi = units.total;
  m.params = o.param_bytes * phi / (o.zero_stage >= 3 ? n : 1.0);
  m.grads = o.grad_bytes * phi / (o.zero_stage >= 2 ? n : 1.0);
  m.optimizer = o.optimizer_bytes * phi / (o.zero_stage >= 1 ? n : 1.0);
  if (o.zero_stage == 3 && m.shard_over > 1) {
    m.gathered_unit = o.param_bytes * units.largest_layer;
    m.prefetch_unit = m.gathered_unit;
    m.root_unit = o.param_bytes * units.root;
  }
  m.total = m.params + m.grads + m.optimizer + m.gathered_unit + m.prefetch_unit + m.root_unit;
  return m;
}

}  // namespace ebbtide::plan

namespace ebbtide::plan {

// Note [Network catalog]: per-GPU one-direction rates, nominal (line rates
// from the vendors' datasheets, sources in docs/model.md "Network catalog").
// NVLink 3 (A100) 300 GB/s and NVLink 4 (H100) 450 GB/s of the 600 / 900 GB/s
// both directions; DGX A100 8 x 200 Gb/s HDR and DGX H100 8 x 400 Gb/s NDR
// InfiniBand, one NIC per GPU; Ethernet nodes with their links shared by 8
// GPUs; the FSDP seed's IBM Cloud nodes (2 x 100 Gb/s, 120 Gb/s usable over
// TCP, and the quarter of it the seed saw used). Latency per ring step: an
// assumption, a few microseconds on InfiniBand, 30 over TCP.
const std::vector<NetworkSpec>& network_catalog() {
  static const std::vector<NetworkSpec> kNetworks = {
      {"dgx-h100", "8 x H100 NVLink 4, 8 x 400 Gb/s InfiniBand per node", 8, 450.0, 50.0, 5.0},
      {"dgx-a100", "8 x A100 NVLink 3, 8 x 200 Gb/s InfiniBand per node", 8, 300.0, 25.0, 5.0},
      {"a100-eth100", "8 x A100 NVLink 3, one 100 Gb/s Ethernet link per node", 8, 300.0, 12.5 / 8, 30.0},
      {"h100-eth400", "8 x H100 NVLink 4, 4 x 100 Gb/s Ethernet per node", 8, 450.0, 50.0 / 8, 30.0},
      {"a100-eth2x100", "8 x A100 NVLink 3, 2 x 100 Gb/s Ethernet per node, 120 Gb/s usable over TCP (FSDP seed)",
       8, 300.0, 15.0 / 8, 30.0},
      {"a100-eth2x100-seen", "a100-eth2x100 at the FSDP seed's measured peak use, 1/4 of 120 Gb/s", 8, 300.0,
       3.75 / 8, 30.0},
  };
  return kNetworks;
}

}  // namespace ebbtide::plan
