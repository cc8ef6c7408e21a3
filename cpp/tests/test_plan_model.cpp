// Performance model: formulas against hand-computed values (Korthikanti et
// al. 2022 table 2 and the derivation in docs/model.md), catalogs, validation.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "ebbtide/plan/model.hpp"
#include "ebbtide/util/error.hpp"

using namespace ebbtide::plan;

namespace {

// The brief's example: s=2048, b=4, h=8192, a=64 -> a*s/h = 16.
ModelConfig base() {
  ModelConfig c;
  c.layers = 32;
  c.hidden = 8192;
  c.heads = 64;
  c.seq = 2048;
  c.batch = 4;
  c.vocab = 50257;
  c.flash_attn = false;
  return c;
}

constexpr double kSbh = 2048.0 * 4 * 8192;  // 67,108,864

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ebbtide::InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument>";
}

}  // namespace

TEST(PlanModel, PaperFormulaWithoutFlashAttention) {
  const ActivationBytes a = activation_bytes(base());
  // sbh (34 + 5 a s / h) = sbh (34 + 80)
  EXPECT_DOUBLE_EQ(a.self_layer, kSbh * 114);
  EXPECT_DOUBLE_EQ(a.self_layer, 7650410496.0);
  EXPECT_DOUBLE_EQ(a.per_step, 32 * kSbh * 114);
  EXPECT_DOUBLE_EQ(a.last_layer, a.self_layer);
  EXPECT_DOUBLE_EQ(a.shared, 0);
  EXPECT_DOUBLE_EQ(a.logits, 2.0 * 2048 * 4 * 50257);
}

TEST(PlanModel, FlashAttentionDropsTheScoreTerm) {
  ModelConfig c = base();
  c.flash_attn = true;
  // 34 sbh plus the fp32 log-sum-exp, 4 a s b
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, 34 * kSbh + 4.0 * 64 * 2048 * 4);
}

TEST(PlanModel, TensorAndSequenceParallel) {
  ModelConfig c = base();
  c.tp = 8;
  // sbh (10 + 24/t + 5as/(ht)) = sbh (10 + 3 + 10)
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, kSbh * 23);
  c.sp = true;
  // sbh (34/t + 5as/(ht)) = sbh (4.25 + 10)
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, kSbh * 14.25);
}

TEST(PlanModel, Recompute) {
  ModelConfig c = base();
  c.recompute = Recompute::kSelective;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, kSbh * 34);
  c.tp = 8;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, kSbh * (10 + 3));
  c.sp = true;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, kSbh * 34 / 8);
  c = base();
  c.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, kSbh * 2);
  c.flash_attn = true;  // nothing inside the layer is kept either way
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, kSbh * 2);
}

TEST(PlanModel, Fp32ScalesTwoByteTermsNotMasks) {
  ModelConfig c = base();
  c.bytes_per_element = 4;
  // (16p + 2) sbh + (2p + 1) a s^2 b with p = 4: 66 sbh + 9 * 16 sbh
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, kSbh * (66 + 144));
}

TEST(PlanModel, EncoderEqualsDecoderPerLayer) {
  ModelConfig c = base();
  const double dec = activation_bytes(c).self_layer;
  c.arch = Arch::kEncoder;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, dec);
}

TEST(PlanModel, EncoderDecoderCrossAttention) {
  ModelConfig c = base();
  c.arch = Arch::kEncoderDecoder;
  c.layers = 12;
  c.decoder_layers = 6;
  const ActivationBytes a = activation_bytes(c);
  EXPECT_DOUBLE_EQ(a.self_layer, kSbh * 114);
  // + cross-attention (6p + 1) sbh + (2p + 1) a s^2 b = 13 sbh + 80 sbh
  EXPECT_DOUBLE_EQ(a.cross_layer, kSbh * (114 + 13 + 80));
  EXPECT_DOUBLE_EQ(a.shared, kSbh * 2);  // encoder output, once
  EXPECT_DOUBLE_EQ(a.per_step, 12 * a.self_layer + 6 * a.cross_layer + a.shared);
  EXPECT_DOUBLE_EQ(a.last_layer, a.cross_layer);
  c.decoder_layers = 0;  // defaults to `layers`
  EXPECT_DOUBLE_EQ(activation_bytes(c).per_step, 12 * a.self_layer + 12 * a.cross_layer + a.shared);
  c.tp = 8;
  c.sp = false;
  // cross: replicated 5 sbh, sharded 8/8, scores 80/8
  EXPECT_DOUBLE_EQ(activation_bytes(c).cross_layer, kSbh * (23 + 5 + 1 + 10));
}

TEST(PlanModel, Flops) {
  ModelConfig c = base();
  const Flops f = flops(c);
  const double b = 4, s = 2048, h = 8192;
  EXPECT_DOUBLE_EQ(f.self_layer, 24 * b * s * h * h + 4 * b * s * s * h);
  EXPECT_DOUBLE_EQ(f.logits, 2 * b * s * h * 50257);
  EXPECT_DOUBLE_EQ(f.forward, 32 * f.self_layer + f.logits);
  EXPECT_DOUBLE_EQ(f.step, 3 * f.forward);
  c.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(flops(c).step, 3 * f.forward + 32 * f.self_layer);
  c.recompute = Recompute::kSelective;
  EXPECT_DOUBLE_EQ(flops(c).step, 3 * f.forward + 32 * 4 * b * s * s * h);
}

TEST(PlanModel, ParameterCountGpt2Small) {
  // GPT-2 small: 124,439,808 parameters (wte, wpe of 1024 positions, 12 layers).
  ModelConfig c;
  c.layers = 12;
  c.hidden = 768;
  c.heads = 12;
  c.seq = 1024;
  c.vocab = 50257;
  EXPECT_DOUBLE_EQ(parameter_count(c), 124439808.0);
}

TEST(PlanModel, PlanReportNumbers) {
  // 26B parameters need 412 GB of model state: split over tp = 8 with SP.
  ModelConfig c = base();
  c.tp = 8;
  c.sp = true;
  const GpuSpec& gpu = find_gpu("h100-sxm");
  const SsdSpec& ssd = find_ssd("d7-p5620");
  PlanOptions o;
  o.ssds = 4;
  o.mfu = 0.5;
  const PlanReport r = make_plan(c, gpu, ssd, o);
  const double rate = 989e12 * 0.5;
  EXPECT_DOUBLE_EQ(r.forward_seconds, r.flops.forward / 8 / rate);
  EXPECT_DOUBLE_EQ(r.step_seconds, 3 * r.forward_seconds);
  EXPECT_DOUBLE_EQ(r.offloaded_bytes_per_step, 31 * kSbh * 14.25);
  EXPECT_DOUBLE_EQ(r.required_write_gbps, r.offloaded_bytes_per_step / (r.step_seconds / 2) / 1e9);
  EXPECT_DOUBLE_EQ(r.ssd_write_gbps, 4 * 4.2);
  EXPECT_DOUBLE_EQ(r.write_gbps_available, 4 * 4.2);
  const double written = r.offloaded_bytes_per_step / r.step_seconds_with_offload;
  EXPECT_NEAR(r.ssd_lifetime_years, 4 * 35.04e15 / written / (365.25 * 86400), 1e-9);
  EXPECT_GE(r.step_seconds_with_offload, r.step_seconds);
  // Memory: 80 GB minus 16 bytes/param / tp; offloading keeps one layer + logits per sample.
  const double free_gpu = 80e9 - 16 * parameter_count(c) / 8;
  ASSERT_GT(free_gpu, 0);
  ModelConfig one = c;
  one.batch = 1;
  const ActivationBytes a1 = activation_bytes(one);
  EXPECT_EQ(r.max_micro_batch_without_offload,
            static_cast<int64_t>(std::floor(free_gpu / (a1.per_step + a1.logits))));
  EXPECT_EQ(r.max_micro_batch,
            std::min(static_cast<int64_t>(std::floor(free_gpu / (a1.last_layer + a1.logits))),
                     static_cast<int64_t>(std::floor(4 * 6.4e12 / (31 * a1.self_layer)))));
  EXPECT_GT(r.max_micro_batch, r.max_micro_batch_without_offload);
  EXPECT_GT(r.max_micro_batch_without_offload, 0);

  // Without tensor parallelism the model state alone exceeds the GPU: nothing fits.
  const PlanReport r1 = make_plan(base(), gpu, ssd, o);
  EXPECT_EQ(r1.max_micro_batch, 0);
  EXPECT_EQ(r1.max_micro_batch_without_offload, 0);
}

TEST(PlanModel, WriteAmplificationShortensLifetime) {
  PlanOptions o;
  const PlanReport r1 = make_plan(base(), find_gpu("a100-sxm"), find_ssd("pm1743"), o);
  o.write_amplification = 2.0;
  const PlanReport r2 = make_plan(base(), find_gpu("a100-sxm"), find_ssd("pm1743"), o);
  EXPECT_NEAR(r2.ssd_lifetime_years, r1.ssd_lifetime_years / 2, 1e-9 * r1.ssd_lifetime_years);
}

TEST(PlanModel, CatalogLookupListsValidNames) {
  EXPECT_EQ(find_gpu("H100-SXM").name, "h100-sxm");
  EXPECT_EQ(find_ssd("p5800x").pbw, 292.0);
  for (const char* n : {"a100-pcie", "a100-sxm", "h100-pcie", "h100-sxm", "h200"}) EXPECT_NO_THROW(find_gpu(n));
  for (const char* n : {"d7-p5620", "d7-p5810", "fl6", "p5800x", "pm1743", "980-pro"}) EXPECT_NO_THROW(find_ssd(n));
  const std::string g = error_of([] { find_gpu("v100"); });
  EXPECT_NE(g.find("unknown gpu 'v100'"), std::string::npos) << g;
  EXPECT_NE(g.find("a100-pcie, a100-sxm, h100-pcie, h100-sxm, h200"), std::string::npos) << g;
  const std::string s = error_of([] { find_ssd("990-pro"); });
  EXPECT_NE(s.find("d7-p5620"), std::string::npos) << s;
  EXPECT_NE(s.find("980-pro"), std::string::npos) << s;
  // Endurance figures agree with DWPD x capacity x warranty (within rounding).
  for (const SsdSpec& d : ssd_catalog()) {
    EXPECT_NEAR(d.pbw, d.dwpd * d.capacity_tb * 365 * d.warranty_years / 1000, 0.02 * d.pbw) << d.name;
  }
}

TEST(PlanModel, ValidationNamesTheSetting) {
  ModelConfig c = base();
  c.heads = 60;
  std::string e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("'heads' (60) must divide 'hidden' (8192)"), std::string::npos) << e;
  c = base();
  c.tp = 3;
  e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("'tp' (3) must divide 'heads' (64)"), std::string::npos) << e;
  c = base();
  c.seq = -5;
  e = error_of([&] { activation_bytes(c); });
  EXPECT_NE(e.find("'seq' must be a positive integer, got -5"), std::string::npos) << e;
  c = base();
  c.bytes_per_element = 3;
  e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("2 (bf16/fp16) or 4 (fp32)"), std::string::npos) << e;
  c = base();
  c.decoder_layers = 4;
  e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("only to arch encoder-decoder"), std::string::npos) << e;
  e = error_of([] { parse_recompute("some"); });
  EXPECT_NE(e.find("valid: none, selective, full"), std::string::npos) << e;
  e = error_of([] { parse_arch("seq2seq"); });
  EXPECT_NE(e.find("valid: decoder, encoder, encoder-decoder"), std::string::npos) << e;
  e = error_of([] { parse_dtype_bytes("int8"); });
  EXPECT_NE(e.find("valid: bf16, fp16, fp32"), std::string::npos) << e;
  PlanOptions o;
  o.mfu = 1.5;
  e = error_of([&] { make_plan(base(), find_gpu("h200"), find_ssd("fl6"), o); });
  EXPECT_NE(e.find("'mfu' must be in (0, 1]"), std::string::npos) << e;
  EXPECT_EQ(parse_arch("encoder_decoder"), Arch::kEncoderDecoder);
  EXPECT_EQ(parse_dtype_bytes("FP32"), 4);
}
