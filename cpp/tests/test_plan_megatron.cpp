// Megatron-core in the model: the megatron family's activation bytes (Note
// [Megatron family]) against the bytes a pack hook measured on megatron-core
// 0.16.1, and the Megatron flags plan_megatron chooses for a budget (Note
// [Megatron flags]).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ebbtide/plan/budget.hpp"
#include "ebbtide/plan/megatron.hpp"
#include "ebbtide/plan/model.hpp"
#include "ebbtide/util/error.hpp"

using namespace ebbtide::plan;

namespace {

// The tiny GPTModel the Python tests run on CPU: fp32, no dropout.
ModelConfig tiny() {
  ModelConfig c;
  c.family = Family::kMegatron;
  c.layers = 2;
  c.hidden = 64;
  c.heads = 4;
  c.seq = 32;
  c.batch = 2;
  c.vocab = 128;
  c.flash_attn = false;
  c.bytes_per_element = 4;
  return c;
}

ModelConfig gpt_1b() {
  ModelConfig c;
  c.family = Family::kMegatron;
  c.layers = 24;
  c.hidden = 2048;
  c.heads = 16;
  c.seq = 2048;
  c.batch = 4;
  c.vocab = 50304;
  c.flash_attn = false;
  return c;
}

PlanReport report_of(const ModelConfig& c) {
  return make_plan(c, find_gpu("h100-sxm"), find_ssd("d7-p5620"), PlanOptions{});
}

bool has(const std::vector<std::string>& v, const std::string& x) {
  for (const auto& e : v)
    if (e == x) return true;
  return false;
}

}  // namespace

TEST(PlanMegatron, LayerBytesAreThoseMeasured) {
  // A pack hook on the local spec (s=32, b=2, h=64, a=4, fp32, no dropout)
  // saw 295,936 bytes per layer, parameters and the shared mask excluded.
  const ActivationBytes a = activation_bytes(tiny());
  EXPECT_DOUBLE_EQ(a.self_layer, 295936.0);
  EXPECT_DOUBLE_EQ(megatron_layer_saves(tiny()).total(), 295936.0);
  // ids and positions 1024, per-sample masks 2048, final LayerNorm 33,280.
  EXPECT_DOUBLE_EQ(a.outside, 1024.0 + 2048.0 + 33280.0);
  // fp32 softmax of the logits 32,768, bool target mask 64, int64 targets 512.
  EXPECT_DOUBLE_EQ(a.logits, 32768.0 + 64.0 + 512.0);
}

TEST(PlanMegatron, WithDropoutAtFp32ItIsThePaperPlusLayerNormStatistics) {
  ModelConfig m = gpt_1b();
  m.bytes_per_element = 4;
  m.dropout = true;
  ModelConfig g = m;
  g.family = Family::kGpt2;
  g.dropout = false;
  const double sb = 2048.0 * 4;
  EXPECT_DOUBLE_EQ(activation_bytes(m).self_layer, activation_bytes(g).self_layer + 16 * sb);
}

TEST(PlanMegatron, HalfPrecisionKeepsTheFp32Softmax) {
  ModelConfig c = gpt_1b();
  const double ss = 16.0 * 2048 * 2048 * 4;
  ModelConfig sel = c;
  sel.recompute = Recompute::kSelective;
  // Without dropout: the fp32 softmax and its bf16 cast.
  EXPECT_DOUBLE_EQ(megatron_layer_saves(c).core_attn - megatron_layer_saves(sel).core_attn, 6 * ss);
  c.dropout = true;
  sel.dropout = true;
  // With dropout: the fp32 softmax, a bool mask and the dropped bf16 copy.
  EXPECT_DOUBLE_EQ(megatron_layer_saves(c).core_attn - megatron_layer_saves(sel).core_attn, 7 * ss);
}

TEST(PlanMegatron, FullRecomputeKeepsTheLayerInput) {
  ModelConfig c = gpt_1b();
  c.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, 2.0 * 2048 * 4 * 2048);
}

TEST(PlanMegatron, OffloadModulesNameTheirBytes) {
  const MegatronLayerSaves s = megatron_layer_saves(tiny());
  EXPECT_DOUBLE_EQ(s.of({"attn_norm", "mlp_norm"}), 2 * 16384.0);
  EXPECT_DOUBLE_EQ(s.of({"core_attn"}), 49152.0 + 32768.0);
  try {
    (void)s.of({"expert_fc1"});
    FAIL() << "no error for an unknown module";
  } catch (const ebbtide::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expert_fc1"), std::string::npos);
  }
}

TEST(PlanMegatron, FamilyIsADecoder) {
  ModelConfig c = tiny();
  c.arch = Arch::kEncoder;
  EXPECT_THROW(validate(c), ebbtide::InvalidArgument);
  EXPECT_EQ(parse_family("megatron"), Family::kMegatron);
  EXPECT_EQ(to_string(Family::kMegatron), "megatron");
}

TEST(PlanMegatron, AmpleBudgetNeedsNoFlags) {
  const PlanReport r = report_of(gpt_1b());
  const MegatronPlan p = plan_megatron(r, 1ULL << 50, 1ULL << 40);
  EXPECT_TRUE(p.plan.feasible);
  EXPECT_TRUE(p.flags.empty());
  EXPECT_EQ(p.recompute_num_layers, 0);
}

TEST(PlanMegatron, WithoutHostMemoryItRecomputesTheFewestLayersThatFit) {
  const PlanReport r = report_of(gpt_1b());
  const auto all = static_cast<uint64_t>(r.activations.per_step + r.activations.logits + r.activations.outside);
  const MegatronPlan p = plan_megatron(r, all / 2, 0);
  ASSERT_TRUE(p.plan.feasible);
  EXPECT_TRUE(p.offload_modules.empty());
  EXPECT_GT(p.recompute_num_layers, 0);
  EXPECT_LE(p.plan.peak_resident_bytes, all / 2);
  // One layer fewer does not fit.
  const MegatronPlan tighter = plan_megatron(r, p.plan.peak_resident_bytes - 1, 0);
  EXPECT_GT(tighter.recompute_num_layers, p.recompute_num_layers);
  EXPECT_TRUE(has(p.flags, "--recompute-granularity full"));
  EXPECT_TRUE(has(p.flags, "--recompute-num-layers " + std::to_string(p.recompute_num_layers)));
}

TEST(PlanMegatron, HostMemoryOffloadsModulesBeforeRecomputing) {
  // Wide layers with fused attention: the PCIe link carries a layer's
  // module inputs within its forward, so offloading is free where recompute
  // costs a forward. (With the unfused attention of gpt_1b() the s x s
  // scores take 27 ms a layer over PCIe against a 2 ms forward.)
  ModelConfig c = gpt_1b();
  c.hidden = 8192;
  c.heads = 64;
  c.batch = 1;
  c.flash_attn = true;
  const PlanReport r = report_of(c);
  const auto all = static_cast<uint64_t>(r.activations.per_step + r.activations.logits + r.activations.outside);
  const MegatronPlan p = plan_megatron(r, all * 4 / 5, 1ULL << 40);
  ASSERT_TRUE(p.plan.feasible);
  EXPECT_FALSE(p.offload_modules.empty());
  EXPECT_EQ(p.recompute_num_layers, 0);
  EXPECT_TRUE(has(p.flags, "--fine-grained-activation-offloading"));
  EXPECT_GT(p.offloaded_bytes, 0u);
  // The last layer is Megatron's offload margin: kept.
  EXPECT_EQ(p.plan.modules[r.config.layers - 1].placement, Placement::kKeep);
  double saved = 0;
  for (const auto& m : p.plan.modules) saved += static_cast<double>(m.bytes);
  EXPECT_EQ(static_cast<double>(p.resident_bytes + p.offloaded_bytes), saved);
  // A budget the offload modules alone cannot meet adds recompute; Megatron's
  // margin then falls on a recomputed layer, so the last layer is offloaded.
  const MegatronPlan both = plan_megatron(r, all * 2 / 5, 1ULL << 40);
  ASSERT_TRUE(both.plan.feasible);
  EXPECT_GT(both.recompute_num_layers, 0);
  ASSERT_FALSE(both.offload_modules.empty());
  EXPECT_EQ(both.plan.modules[r.config.layers - 1].placement, Placement::kOffloadCpu);
  EXPECT_EQ(both.plan.modules[0].placement, Placement::kRecompute);
}

TEST(PlanMegatron, RecomputeNeverPairsWithAttnNorm) {
  const PlanReport r = report_of(gpt_1b());
  for (uint64_t budget : {1ULL << 30, 4ULL << 30, 8ULL << 30, 16ULL << 30}) {
    const MegatronPlan p = plan_megatron(r, budget, 1ULL << 40);
    if (p.recompute_num_layers > 0) EXPECT_FALSE(has(p.offload_modules, "attn_norm")) << budget;
  }
}

TEST(PlanMegatron, InfeasibleBudgetNamesTheSmallest) {
  const PlanReport r = report_of(gpt_1b());
  const MegatronPlan p = plan_megatron(r, 1024, 0);
  EXPECT_FALSE(p.plan.feasible);
  EXPECT_EQ(p.recompute_num_layers, r.config.layers);
  EXPECT_EQ(p.plan.min_budget_bytes, p.plan.peak_resident_bytes);
}

TEST(PlanMegatron, OtherFamiliesAreRefused) {
  ModelConfig c = gpt_1b();
  c.family = Family::kGpt2;
  EXPECT_THROW(plan_megatron(report_of(c), 1ULL << 30, 0), ebbtide::InvalidArgument);
  EXPECT_THROW(megatron_layer_saves(c), ebbtide::InvalidArgument);
}
