// Model state under ZeRO / FSDP: the ZeRO paper's table (figure 1), the
// transient FSDP units, validation, and the plan's micro-batch using it.
#include <gtest/gtest.h>

#include <string>

#include "ebbtide/plan/cluster.hpp"
#include "ebbtide/plan/model.hpp"
#include "ebbtide/util/error.hpp"

using namespace ebbtide::plan;

namespace {

ShardingOptions zero(int64_t stage, int64_t dp) {
  ShardingOptions o;
  o.dp = dp;
  o.zero_stage = stage;
  return o;
}

std::string error_of(const ShardingOptions& o) {
  try {
    validate_sharding(o);
  } catch (const ebbtide::InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument>";
}

}  // namespace

// Rajbhandari et al. 2020, figure 1: Φ = 7.5B, K = 12, N = 64 ->
// 120 GB, 31.4 GB, 16.6 GB, 1.9 GB (1e9 bytes).
TEST(PlanCluster, ZeroPaperTable) {
  const ParameterUnits units{7.5e9, 0, 0};
  EXPECT_DOUBLE_EQ(model_state_bytes(units, zero(0, 64)).total, 120e9);
  EXPECT_DOUBLE_EQ(model_state_bytes(units, zero(1, 64)).total, 4 * 7.5e9 + 12 * 7.5e9 / 64);
  EXPECT_DOUBLE_EQ(model_state_bytes(units, zero(2, 64)).total, 2 * 7.5e9 + 14 * 7.5e9 / 64);
  EXPECT_DOUBLE_EQ(model_state_bytes(units, zero(3, 64)).total, 120e9 / 64);
  EXPECT_NEAR(model_state_bytes(units, zero(1, 64)).total / 1e9, 31.4, 0.05);
  EXPECT_NEAR(model_state_bytes(units, zero(2, 64)).total / 1e9, 16.6, 0.05);
  EXPECT_NEAR(model_state_bytes(units, zero(3, 64)).total / 1e9, 1.9, 0.05);
  const ModelStateBytes s2 = model_state_bytes(units, zero(2, 64));
  EXPECT_DOUBLE_EQ(s2.params, 15e9);
  EXPECT_DOUBLE_EQ(s2.grads, 2 * 7.5e9 / 64);
  EXPECT_DOUBLE_EQ(s2.optimizer, 12 * 7.5e9 / 64);
  EXPECT_EQ(s2.shard_over, 64);
}

TEST(PlanCluster, FsdpGathersAUnitItsPrefetchAndTheRoot) {
  const ParameterUnits units{1000, 100, 200};
  const ModelStateBytes m = model_state_bytes(units, zero(3, 4));
  EXPECT_DOUBLE_EQ(m.params, 2 * 1000 / 4.0);
  EXPECT_DOUBLE_EQ(m.gathered_unit, 200);
  EXPECT_DOUBLE_EQ(m.prefetch_unit, 200);
  EXPECT_DOUBLE_EQ(m.root_unit, 400);
  EXPECT_DOUBLE_EQ(m.total, 16 * 1000 / 4.0 + 800);
  // Nothing to gather without sharding, nor below stage 3.
  EXPECT_DOUBLE_EQ(model_state_bytes(units, zero(3, 1)).gathered_unit, 0);
  EXPECT_DOUBLE_EQ(model_state_bytes(units, zero(2, 4)).gathered_unit, 0);
}

TEST(PlanCluster, HybridShardsWithinAGroup) {
  ShardingOptions o = zero(3, 64);
  o.shard_group = 8;
  EXPECT_EQ(o.shard_over(), 8);
  EXPECT_DOUBLE_EQ(model_state_bytes({8e9, 0, 0}, o).total, 16 * 8e9 / 8);
  EXPECT_EQ(zero(0, 64).shard_over(), 1);
}

TEST(PlanCluster, BytesPerParameterAreSettable) {
  ShardingOptions o = zero(3, 2);  // fp32 Adam: 4 + 4 + 8
  o.param_bytes = 4;
  o.grad_bytes = 4;
  o.optimizer_bytes = find_optimizer("adam-fp32").optimizer_bytes;
  const ModelStateBytes m = model_state_bytes({1000, 0, 0}, o);
  EXPECT_DOUBLE_EQ(m.params, 2000);
  EXPECT_DOUBLE_EQ(m.grads, 2000);
  EXPECT_DOUBLE_EQ(m.optimizer, 4000);
  EXPECT_DOUBLE_EQ(find_optimizer("ADAM").optimizer_bytes, 12);
  EXPECT_DOUBLE_EQ(find_optimizer("adam-8bit").optimizer_bytes, 6);
  EXPECT_THROW(find_optimizer("lion"), ebbtide::InvalidArgument);
}

TEST(PlanCluster, ValidationNamesTheSetting) {
  EXPECT_NE(error_of(zero(4, 8)).find("'zero'"), std::string::npos);
  EXPECT_NE(error_of(zero(0, 0)).find("'dp'"), std::string::npos);
  ShardingOptions o = zero(3, 64);
  o.shard_group = 6;
  EXPECT_NE(error_of(o).find("must divide 'dp' (64)"), std::string::npos);
  o = zero(0, 64);
  o.shard_group = 8;
  EXPECT_NE(error_of(o).find("'shard_group'"), std::string::npos);
  o = zero(1, 8);
  o.param_bytes = 0;
  EXPECT_NE(error_of(o).find("'param_bytes'"), std::string::npos);
}

TEST(PlanCluster, UnitsOfACatalogModel) {
  ModelConfig c = find_model("llama3-8b").config;
  c.seq = 8192;
  const ParameterUnits u = parameter_units(c);
  EXPECT_DOUBLE_EQ(u.total, parameter_count(c));
  // A Llama 3 8B layer: 2h^2 + 2h*h/4 (GQA 8/32) + 3hf + 2h.
  const double h = 4096;
  EXPECT_DOUBLE_EQ(u.largest_layer, 2 * h * h + 2 * h * h / 4 + 3 * h * 14336 + 2 * h);
  EXPECT_DOUBLE_EQ(u.root, 2 * 128256 * h + h);  // embedding, LM head, final norm
  c.tp = 2;
  EXPECT_DOUBLE_EQ(parameter_units(c).total, parameter_count(c) / 2);
}

TEST(PlanCluster, FsdpLetsLlama8bFitAndSetsTheMicroBatch) {
  ModelConfig c = find_model("llama3-8b").config;
  c.seq = 8192;
  const GpuSpec& gpu = find_gpu("h100-sxm");
  const SsdSpec& ssd = find_ssd("d7-p5620");
  const PlanReport alone = make_plan(c, gpu, ssd, PlanOptions{});
  EXPECT_DOUBLE_EQ(alone.model_state_bytes, 16 * alone.params);  // no sharding: as before
  EXPECT_EQ(alone.max_micro_batch, 0);
  PlanOptions o;
  o.sharding = zero(3, 8);
  const PlanReport fsdp = make_plan(c, gpu, ssd, o);
  EXPECT_DOUBLE_EQ(fsdp.model_state_bytes, fsdp.model_state.total);
  EXPECT_DOUBLE_EQ(fsdp.model_state.params, 2 * fsdp.params / 8);
  EXPECT_GT(fsdp.max_micro_batch, fsdp.max_micro_batch_without_offload);
  EXPECT_GT(fsdp.max_micro_batch_without_offload, 0);
  o.sharding.dp = 64;
  const PlanReport wide = make_plan(c, gpu, ssd, o);
  EXPECT_GE(wide.max_micro_batch_without_offload, fsdp.max_micro_batch_without_offload);
}

namespace {

PlanReport llama8b_plan(int64_t batch, ShardingOptions sharding) {
  ModelConfig c = find_model("llama3-8b").config;
  c.seq = 4096;
  c.batch = batch;
  PlanOptions o;
  o.sharding = sharding;
  return make_plan(c, find_gpu("h100-sxm"), find_ssd("d7-p5620"), o);
}

}  // namespace

TEST(PlanCluster, RingCollectivesAcrossNodesAndWithinOne) {
  const NetworkSpec& eth = find_network("a100-eth100");
  const PlanReport r = llama8b_plan(1, zero(3, 64));
  const CommTimes c = communication(r, eth);
  const double layer = r.units.largest_layer;
  // All 8 GPUs of a node are in the ring: it runs at the node's 100 Gb/s, not at an eighth of it.
  EXPECT_DOUBLE_EQ(c.gather_seconds, 63.0 / 64 * 2 * layer / 12.5e9 + 63 * 30e-6);
  EXPECT_DOUBLE_EQ(c.reduce_seconds, c.gather_seconds);  // bf16 gradients: the same bytes
  EXPECT_DOUBLE_EQ(c.step_seconds, r.step_seconds + c.exposed_seconds);
  EXPECT_NEAR(c.unit_forward_seconds * 32, r.forward_seconds, 0.1 * r.forward_seconds);  // + the LM head
  // Inside one node the collectives ride NVLink.
  const CommTimes node = communication(llama8b_plan(1, zero(3, 8)), eth);
  EXPECT_DOUBLE_EQ(node.gather_seconds, 7.0 / 8 * 2 * layer / 300e9 + 7 * 30e-6);
  EXPECT_GT(node.scaling_efficiency, c.scaling_efficiency);
  // HSDP: shards inside a node over NVLink, then 8 replica all-reduces at once, one GPU per node in
  // each, so each gets an eighth of the node's link.
  ShardingOptions hsdp = zero(3, 64);
  hsdp.shard_group = 8;
  const CommTimes h = communication(llama8b_plan(1, hsdp), eth);
  EXPECT_DOUBLE_EQ(h.gather_seconds, 7.0 / 8 * 2 * layer / 300e9 + 7 * 30e-6);
  EXPECT_DOUBLE_EQ(h.reduce_seconds,
                   h.gather_seconds + 2 * (7.0 / 8 * 2 * layer / 8 / (12.5e9 / 8) + 7 * 30e-6));
  // One GPU communicates nothing.
  const CommTimes one = communication(llama8b_plan(1, zero(3, 1)), eth);
  EXPECT_DOUBLE_EQ(one.comm_seconds, 0);
  EXPECT_DOUBLE_EQ(one.scaling_efficiency, 1);
}

TEST(PlanCluster, LargerMicroBatchHidesTheGather) {
  const NetworkSpec& eth = find_network("a100-eth100");
  double last = 0;
  for (int64_t b : {1, 2, 4, 8}) {
    const CommTimes c = communication(llama8b_plan(b, zero(3, 64)), eth);
    EXPECT_GT(c.scaling_efficiency, last) << "batch " << b;
    last = c.scaling_efficiency;
  }
  EXPECT_LT(communication(llama8b_plan(1, zero(3, 64)), eth).scaling_efficiency, 0.5);
  // InfiniBand: a layer's 436 MB gather at the node's 400 GB/s (1.1 ms) hides behind its forward at
  // 4096 tokens (4.2 ms) already.
  EXPECT_GT(communication(llama8b_plan(1, zero(3, 64)), find_network("dgx-h100")).scaling_efficiency, 0.9);
  // DDP all-reduces the gradients during backward.
  const PlanReport ddp = llama8b_plan(1, zero(0, 16));
  const CommTimes d = communication(ddp, find_network("dgx-h100"));
  EXPECT_DOUBLE_EQ(d.comm_seconds, 2 * (15.0 / 16 * 2 * ddp.params / 400e9 + 15 * 5e-6));
  EXPECT_THROW(find_network("ethernet"), ebbtide::InvalidArgument);
}

namespace {

// The FSDP seed's runs (docs/model.md "The FSDP seed on paper"): HF T5,
// s = 512 in and out, bf16, every block checkpointed, eager attention, FSDP
// over 8 A100 80GB per node.
PlanReport seed_plan(const char* name, int64_t batch, int64_t nodes) {
  ModelConfig c = find_model(name).config;
  c.seq = 512;
  c.batch = batch;
  c.recompute = Recompute::kFull;
  c.flash_attn = false;
  PlanOptions o;
  o.sharding = zero(3, 8 * nodes);
  return make_plan(c, find_gpu("a100-sxm"), find_ssd("d7-p5620"), o);
}

// The seed's scaling: time per sample on one node over time per sample on N.
double seed_scaling(const char* name, int64_t batch, int64_t nodes, const char* network) {
  const NetworkSpec& net = find_network(network);
  return communication(seed_plan(name, batch, 1), net).step_seconds /
         communication(seed_plan(name, batch, nodes), net).step_seconds;
}

}  // namespace

TEST(PlanCluster, FsdpSeedT5ScalingRisesWithTheMicroBatch) {
  // At the network use the seed measured (a quarter of 120 Gb/s), T5-11B on
  // 32 nodes scales poorly at 20 samples per GPU and well at 50: a decoder
  // layer's 537 MB gather (150 ms) outlasts its forward at 20 (40 ms) and
  // nearly hides behind its backward at 50. The seed: ~20 % -> > 75 %.
  double last = 0;
  for (int64_t b : {10, 20, 30, 40, 50}) {
    const double scaling = seed_scaling("t5-11b", b, 32, "a100-eth2x100-seen");
    EXPECT_GT(scaling, last) << "batch " << b;
    last = scaling;
  }
  EXPECT_LT(seed_scaling("t5-11b", 20, 32, "a100-eth2x100-seen"), 0.4);
  EXPECT_GT(seed_scaling("t5-11b", 50, 32, "a100-eth2x100-seen"), 0.8);
  // At the usable 120 Gb/s bandwidth alone does not explain the seed's 20 %
  // (as the seed found: its peak use was a quarter of the link).
  EXPECT_GT(seed_scaling("t5-11b", 20, 32, "a100-eth2x100"), 0.9);
  // T5-3B scales from 1 to 64 nodes at a large batch (the seed: 95 %).
  EXPECT_GT(seed_scaling("t5-3b", 50, 64, "a100-eth2x100"), 0.95);
  // Both batches fit the memory the model leaves: checkpointed T5-11B at
  // s = 512 fits 74 samples per GPU on one node (the rebuilt decoder layer,
  // 0.65 GB a sample, is most of it) and 79 with the checkpoints offloaded.
  const PlanReport one = seed_plan("t5-11b", 1, 1);
  EXPECT_EQ(one.max_micro_batch_without_offload, 74);
  EXPECT_EQ(one.max_micro_batch, 79);
}
