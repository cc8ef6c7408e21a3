// Performance model: formulas against hand-computed values (Korthikanti et
// al. 2022 table 2 and the derivation in docs/model.md), catalogs, validation.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <utility>

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

namespace {

// A tiny Llama: the shape python/tests/test_model_vs_cache.py measures.
ModelConfig tiny_llama(int64_t p, bool flash) {
  ModelConfig c;
  c.family = Family::kLlama;
  c.layers = 2;
  c.hidden = 64;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn_hidden = 96;
  c.vocab = 256;
  c.seq = 64;
  c.batch = 2;
  c.bytes_per_element = p;
  c.flash_attn = flash;
  return c;
}

}  // namespace

TEST(PlanModel, LlamaLayerTermByTerm) {
  // Note [Layer families], with s=64, b=2, h=64, a=4, g=2, f=96.
  const double s = 64, b = 2, h = 64, a = 4, f = 96, sb = s * b, sbh = sb * h;
  for (const double p : {2.0, 4.0}) {
    const double norm = 4 * sbh + 4 * sb + p * sbh;
    const double common = 2 * norm + 2 * p * sbh + p * sbh /* o input */ + 4 * p * sb * f;
    const ActivationBytes sdpa = activation_bytes(tiny_llama(static_cast<int64_t>(p), true));
    EXPECT_DOUBLE_EQ(sdpa.self_layer, common + p * sbh * (1 + 2 * 2 / a) + 4 * a * sb) << p;
    const ActivationBytes eager = activation_bytes(tiny_llama(static_cast<int64_t>(p), false));
    const double probs = (p == 4 ? 4 : 4 + p) * a * s * s * b;
    EXPECT_DOUBLE_EQ(eager.self_layer, common + 3 * p * sbh + probs) << p;
    EXPECT_DOUBLE_EQ(eager.per_step, 2 * eager.self_layer);
    EXPECT_DOUBLE_EQ(sdpa.outside, 8 * sb + 2 * s * (h / a) * p + norm + p * sbh);
    EXPECT_DOUBLE_EQ(sdpa.logits, 4 * sb * 256 + 8 * sb + 4);
  }
  // The pack-hook count of LlamaForCausalLM at fp32 / SDPA (docs/model.md table).
  const ActivationBytes a4 = activation_bytes(tiny_llama(4, true));
  EXPECT_DOUBLE_EQ(a4.per_step + a4.outside + a4.logits, 1229316.0);
}

TEST(PlanModel, LlamaOptions) {
  ModelConfig c = tiny_llama(2, false);
  const double base_layer = activation_bytes(c).self_layer;
  const double ss = 4.0 * 64 * 64 * 2;
  c.dropout = true;  // bool mask and the dropped copy
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, base_layer + 3 * ss);
  c.flash_attn = true;  // the kernel regenerates the mask
  c.dropout = false;
  const double flash_layer = activation_bytes(c).self_layer;
  c.dropout = true;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, flash_layer);
  c.recompute = Recompute::kSelective;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, flash_layer - 4.0 * 4 * 64 * 2);
  c.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, 2.0 * 64 * 2 * 64);
  c = tiny_llama(2, true);
  c.gated_mlp = false;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, flash_layer - 2 * 2.0 * 128 * 96);
  c = tiny_llama(2, true);
  c.norm = Norm::kLayerNorm;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, flash_layer - 2 * (4.0 * 128 * 64 + 4 * 128 - 8 * 128));
  c = tiny_llama(2, true);
  c.rotary = false;
  EXPECT_DOUBLE_EQ(activation_bytes(c).outside, activation_bytes(tiny_llama(2, true)).outside - 2 * 64 * 16 * 2);
  c = tiny_llama(2, true);
  c.kv_heads = 4;  // multi-head: k and v as large as q
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, flash_layer + 2 * 2.0 * 128 * 32);
}

TEST(PlanModel, MixtureOfExperts) {
  ModelConfig c = tiny_llama(4, true);
  c.experts = 4;
  c.top_k = 2;
  const double sb = 128, r = sb * 2, h = 64, f = 96, p = 4;
  const double dense_mlp = 4 * p * sb * f;
  const double moe = 4 * sb * 4 + 32 * r + 8 * r + 4 * sb + 4 * 4 + 2 * p * r * h + 4 * p * r * f;
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, activation_bytes(tiny_llama(4, true)).self_layer - dense_mlp + moe);
  c.expert_ffn_hidden = 48;
  const Flops fl = flops(c);
  const double s = 64, b = 2;
  EXPECT_DOUBLE_EQ(fl.self_layer, 4 * b * s * h * h * 1.5 + 4 * b * s * s * h + 2 * b * s * h * 4 + 6 * r * h * 48);
}

TEST(PlanModel, LlamaFlopsAndParameters) {
  ModelConfig c = tiny_llama(2, true);
  const double b = 2, s = 64, h = 64, f = 96;
  // q, o: 2 h^2 each per token; k, v at 2 of 4 heads; three MLP matrices.
  EXPECT_DOUBLE_EQ(flops(c).self_layer, 2 * b * s * (2 * h * h + 2 * h * 32) + 4 * b * s * s * h + 6 * b * s * h * f);
  // Published totals (Note [Model catalog]).
  const std::pair<const char*, double> published[] = {{"llama3-8b", 8030261248.0},
                                                     {"llama3-70b", 70553706496.0},
                                                     {"qwen2.5-7b", 7615616512.0},
                                                     {"qwen2.5-72b", 72706203648.0},
                                                     {"mixtral-8x7b", 46702792704.0}};
  for (const auto& [name, params] : published) {
    ModelConfig m = find_model(name).config;
    m.seq = 8192;
    EXPECT_DOUBLE_EQ(parameter_count(m), params) << name;
  }
  EXPECT_EQ(find_model("Llama3-8B").config.kv_heads, 8);
  const std::string e = error_of([] { find_model("llama2-7b"); });
  EXPECT_NE(e.find("llama3-8b, llama3-70b, qwen2.5-7b, qwen2.5-72b, mixtral-8x7b"), std::string::npos) << e;
}

TEST(PlanModel, LlamaValidation) {
  ModelConfig c = tiny_llama(2, true);
  c.kv_heads = 3;
  std::string e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("'kv_heads' (3) must divide 'heads' (4)"), std::string::npos) << e;
  c = tiny_llama(2, true);
  c.experts = 4;
  c.top_k = 5;
  e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("'top_k' must be in 1..experts (4), got 5"), std::string::npos) << e;
  c = tiny_llama(2, true);
  c.top_k = 2;
  e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("need 'experts' > 0"), std::string::npos) << e;
  c = tiny_llama(2, true);
  c.arch = Arch::kEncoder;
  e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("family llama is a decoder"), std::string::npos) << e;
  c = base();
  c.kv_heads = 8;
  e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("'kv_heads' applies only to family llama"), std::string::npos) << e;
  e = error_of([] { parse_family("bloom"); });
  EXPECT_NE(e.find("valid: gpt2, llama"), std::string::npos) << e;
}

TEST(PlanModel, NormalizedWritesOutTheDefaultsAndComputesTheSame) {
  ModelConfig enc_dec = base();
  enc_dec.arch = Arch::kEncoderDecoder;
  enc_dec.layers = 12;
  ModelConfig moe = tiny_llama(2, true);
  moe.kv_heads = 0;
  moe.experts = 4;
  moe.top_k = 2;
  for (const ModelConfig& c : {base(), enc_dec, tiny_llama(2, true), moe}) {
    const ModelConfig n = normalized(c);
    validate(n);
    EXPECT_EQ(n.ffn_hidden, c.ffn());
    EXPECT_EQ(n.decoder_layers, c.cross_layers());
    EXPECT_DOUBLE_EQ(activation_bytes(n).per_step, activation_bytes(c).per_step);
    EXPECT_DOUBLE_EQ(flops(n).step, flops(c).step);
    EXPECT_DOUBLE_EQ(parameter_count(n), parameter_count(c));
  }
  EXPECT_EQ(normalized(enc_dec).decoder_layers, 12);
  EXPECT_EQ(normalized(base()).kv_heads, 0);  // a gpt2 setting it is not
  EXPECT_EQ(normalized(moe).kv_heads, 4);
  EXPECT_EQ(normalized(moe).expert_ffn_hidden, 96);
}

namespace {

// A T5 small enough to count by hand: s=4, b=2, d_model h=8, 2 heads of
// d_kv 6 (w = 12 != h), d_ff f=16, vocab 10, bf16, 2 + 2 layers, dropout.
ModelConfig tiny_t5() {
  ModelConfig c;
  c.family = Family::kT5;
  c.arch = Arch::kEncoderDecoder;
  c.layers = 2;
  c.decoder_layers = 2;
  c.hidden = 8;
  c.heads = 2;
  c.head_dim = 6;
  c.ffn_hidden = 16;
  c.vocab = 10;
  c.seq = 4;
  c.batch = 2;
  c.gated_mlp = false;
  c.tied_embeddings = true;
  c.dropout = true;
  c.flash_attn = false;
  return c;
}

}  // namespace

TEST(PlanModelT5, ParametersOfThePublishedModels) {
  // Counted from the config.json shapes (docs/model.md "T5"): Hugging Face's
  // num_parameters() gives the same (python/tests/test_model.py checks it).
  for (auto [name, params] : {std::pair{"t5-3b", 2851598336.0}, std::pair{"t5-11b", 11307321344.0}}) {
    ModelConfig c = find_model(name).config;
    c.seq = 512;  // T5's relative positions: the count does not depend on it
    EXPECT_DOUBLE_EQ(parameter_count(c), params) << name;
  }
  // By hand for the tiny shape: attention 4*h*w = 384, MLP 2*h*f = 256, a
  // norm per sublayer (8 each): encoder layer 656, decoder layer 656 + 384 +
  // 8 = 1048; one tied embedding 80, two final norms 16, two 32 x 2
  // relative-position tables 128.
  const ModelConfig c = tiny_t5();
  EXPECT_DOUBLE_EQ(parameter_count(c), 2 * 656 + 2 * 1048 + 80 + 16 + 128);
  const ParameterUnits u = parameter_units(c);
  EXPECT_DOUBLE_EQ(u.self_layer, 656);
  EXPECT_DOUBLE_EQ(u.cross_layer, 1048);
  EXPECT_DOUBLE_EQ(u.largest_layer, 1048);
  EXPECT_DOUBLE_EQ(u.root, 80 + 16 + 128);
  ModelConfig untied = c;
  untied.tied_embeddings = false;  // T5 v1.1: a separate LM head
  EXPECT_DOUBLE_EQ(parameter_count(untied), parameter_count(c) + 80);
  ModelConfig gated = c;
  gated.gated_mlp = true;  // wi_0, wi_1, wo
  EXPECT_DOUBLE_EQ(parameter_count(gated), parameter_count(c) + 4 * 8 * 16);
}

TEST(PlanModelT5, ActivationBytesByHand) {
  // sb = 8, sbh = 64, sbw = 96, sbf = 128, a s^2 b = 64, p = 2, bool masks.
  //   norm: input + fp32 copy + normalised (2p + 4) sbh, rsqrt 4 sb, output p sbh = 672
  //   attention: replicated norm + residual mask 64 = 736; sharded q, k, v, o input
  //     4p sbw = 768, softmax p ss 128, mask + dropped (1 + p) ss 192 = 1088
  //   MLP: norm + mask = 736; ReLU output, mask, dropped (2p + 1) sbf = 640
  ActivationBytes a = activation_bytes(tiny_t5());
  EXPECT_DOUBLE_EQ(a.self_layer, 736 + 1088 + 736 + 640);          // 3200
  EXPECT_DOUBLE_EQ(a.cross_layer, 3200 + 736 + 1088);              // + cross-attention
  EXPECT_DOUBLE_EQ(a.shared, 128);                                 // encoder output p sbh
  EXPECT_DOUBLE_EQ(a.per_step, 2 * 3200 + 2 * 5024 + 128);
  // Per stack: ids 8 sb, buckets 8 s^2, two dropout masks, the final norm
  // (544); and the LM-head input p sbh.
  EXPECT_DOUBLE_EQ(a.outside, 2 * (64 + 128 + 2 * 64 + 544) + 128);
  EXPECT_DOUBLE_EQ(a.logits, 2 * 8 * 10 + 8 * 8 + 2);             // p sbV, int64 targets, scalar
  EXPECT_DOUBLE_EQ(a.recompute_layer, 0);
  // Checkpointing each block keeps its input and holds the three (1, a, s, s)
  // position biases; the decoder layer is rebuilt whole during its backward.
  ModelConfig full = tiny_t5();
  full.recompute = Recompute::kFull;
  a = activation_bytes(full);
  EXPECT_DOUBLE_EQ(a.self_layer, 128);
  EXPECT_DOUBLE_EQ(a.cross_layer, 128);
  EXPECT_DOUBLE_EQ(a.outside, 1856 + 3 * 2 * 32);  // a s^2 = 32, whatever the batch
  EXPECT_DOUBLE_EQ(a.recompute_layer, 5024);
  // Without dropout the ReLU output is the wo input: p sbf; no masks.
  ModelConfig dry = tiny_t5();
  dry.dropout = false;
  EXPECT_DOUBLE_EQ(activation_bytes(dry).self_layer, 672 + (768 + 128) + 672 + 2 * 128);
  // Gated GELU: gelu_new's four tensors, the product's two inputs, the wo input.
  ModelConfig gated = dry;
  gated.gated_mlp = true;
  EXPECT_DOUBLE_EQ(activation_bytes(gated).self_layer, 672 + (768 + 128) + 672 + 7 * 2 * 128);
}

TEST(PlanModelT5, FlopsUseTheAttentionWidth) {
  // bsh = 64: q, k, v, o 8 bsh w = 6144; MLP 4 bsh f = 4096; scores and
  // context 4 b s^2 w = 1536. Cross-attention adds 6144 + 1536.
  const Flops f = flops(tiny_t5());
  EXPECT_DOUBLE_EQ(f.self_layer, 6144 + 4096 + 1536);
  EXPECT_DOUBLE_EQ(f.cross_layer, 11776 + 6144 + 1536);
  EXPECT_DOUBLE_EQ(f.logits, 2 * 64 * 10);
  EXPECT_DOUBLE_EQ(f.forward, 2 * 11776 + 2 * 19456 + 1280);
  ModelConfig full = tiny_t5();
  full.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(flops(full).step, 4 * f.forward - f.logits);  // layers run twice forward
}

TEST(PlanModelT5, HeadDimDefaultsToHiddenOverHeads) {
  ModelConfig c = base();
  const double params = parameter_count(c);
  const Flops f = flops(c);
  const ActivationBytes a = activation_bytes(c);
  c.head_dim = c.hidden / c.heads;  // the default written out: nothing changes
  EXPECT_DOUBLE_EQ(parameter_count(c), params);
  EXPECT_DOUBLE_EQ(flops(c).forward, f.forward);
  EXPECT_DOUBLE_EQ(activation_bytes(c).per_step, a.per_step);
  EXPECT_EQ(normalized(base()).head_dim, 128);
  c.head_dim = 256;  // twice as wide: q/k/v/o bytes and FLOPs grow by the added width
  const double s = 2048, b = 4, h = 8192, added = 64 * 128;
  EXPECT_DOUBLE_EQ(flops(c).self_layer, f.self_layer + 8 * b * s * h * added + 4 * b * s * s * added);
  EXPECT_DOUBLE_EQ(activation_bytes(c).self_layer, a.self_layer + 4 * 2 * s * b * added);
  EXPECT_DOUBLE_EQ(parameter_count(c) - params, 32 * (4 * h * added + 3 * added));
  // heads need not divide hidden once head_dim is given (T5-11B: 128 x 128 over 1024).
  c.heads = 48;
  EXPECT_NO_THROW(validate(c));
}

TEST(PlanModelT5, Validation) {
  ModelConfig c = tiny_t5();
  c.arch = Arch::kDecoder;
  c.decoder_layers = 0;
  EXPECT_NE(error_of([&] { validate(c); }).find("family t5 is an encoder-decoder"), std::string::npos);
  c = tiny_t5();
  c.kv_heads = 1;
  EXPECT_NE(error_of([&] { validate(c); }).find("'kv_heads' applies only to family llama"), std::string::npos);
  c = tiny_t5();
  c.head_dim = -1;
  EXPECT_NE(error_of([&] { validate(c); }).find("'head_dim'"), std::string::npos);
  c = tiny_t5();
  c.head_dim = 0;
  c.heads = 3;  // 3 does not divide 8 and no head_dim
  EXPECT_NE(error_of([&] { validate(c); }).find("or set 'head_dim'"), std::string::npos);
  EXPECT_EQ(parse_family("T5"), Family::kT5);
  EXPECT_EQ(to_string(Family::kT5), "t5");
}

TEST(PlanModelT5, FullRecomputeCountsTheRebuiltLayer) {
  ModelConfig c = find_model("t5-11b").config;
  c.seq = 512;
  c.recompute = Recompute::kFull;
  PlanOptions o;
  o.sharding.dp = 8;
  o.sharding.zero_stage = 3;
  const PlanReport r = make_plan(c, find_gpu("a100-sxm"), find_ssd("d7-p5620"), o);
  ModelConfig one = c;
  one.batch = 1;
  const ActivationBytes a = activation_bytes(one);
  ModelConfig two = one;
  two.batch = 2;
  const ActivationBytes a2 = activation_bytes(two);
  const double at1 = a.per_step + a.logits + a.outside + a.recompute_layer;
  const double per_sample = a2.per_step + a2.logits + a2.outside + a2.recompute_layer - at1;
  const double fixed = at1 - per_sample;  // the position biases and bucket indices
  EXPECT_GT(fixed, 3 * 2 * 128 * 512.0 * 512);
  const double free = r.gpu_memory_bytes - r.model_state_bytes;
  EXPECT_EQ(r.max_micro_batch_without_offload, static_cast<int64_t>(std::floor((free - fixed) / per_sample)));
  EXPECT_GT(a.recompute_layer, a.per_step);  // one rebuilt decoder layer outweighs all 48 checkpoints
}
