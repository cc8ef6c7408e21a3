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
