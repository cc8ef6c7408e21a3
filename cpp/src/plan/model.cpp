#include "ebbtide/plan/model.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "ebbtide/util/error.hpp"

namespace ebbtide::plan {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

template <typename Spec>
std::string names_of(const std::vector<Spec>& catalog) {
  std::string out;
  for (const auto& spec : catalog) {
    if (!out.empty()) out += ", ";
    out += spec.name;
  }
  return out;
}

template <typename Spec>
const Spec& find_in(const std::vector<Spec>& catalog, std::string_view name, const char* what) {
  const std::string key = lower(name);
  for (const auto& spec : catalog) {
    if (spec.name == key) return spec;
  }
  throw InvalidArgument(detail::concat("unknown ", what, " '", name, "' (valid: ", names_of(catalog), ")"));
}

// "1, 2, 4, 8" -- the divisors of n up to `limit`, for error messages.
std::string divisors(int64_t n, int64_t limit) {
  std::string out;
  for (int64_t d = 1; d <= n && d <= limit; ++d) {
    if (n % d != 0) continue;
    if (!out.empty()) out += ", ";
    out += std::to_string(d);
  }
  return out;
}

}  // namespace

int64_t ModelConfig::self_only_layers() const {
  return layers;
}

int64_t ModelConfig::cross_layers() const {
  if (arch != Arch::kEncoderDecoder) return 0;
  return decoder_layers > 0 ? decoder_layers : layers;
}

void validate(const ModelConfig& c) {
  auto positive = [](int64_t v, const char* name) {
    EBB_CHECK(v > 0, "model setting '", name, "' must be a positive integer, got ", v);
  };
  positive(c.layers, "layers");
  positive(c.hidden, "hidden");
  positive(c.heads, "heads");
  positive(c.seq, "seq");
  positive(c.batch, "batch");
  positive(c.vocab, "vocab");
  positive(c.tp, "tp");
  EBB_CHECK(c.ffn_hidden >= 0, "model setting 'ffn_hidden' must be positive (or 0 for 4*hidden), got ",
            c.ffn_hidden);
  EBB_CHECK(c.decoder_layers >= 0,
            "model setting 'decoder_layers' must be positive (or 0 for the same as layers), got ",
            c.decoder_layers);
  EBB_CHECK(c.decoder_layers == 0 || c.arch == Arch::kEncoderDecoder,
            "model setting 'decoder_layers' applies only to arch encoder-decoder (got arch ",
            to_string(c.arch), ")");
  EBB_CHECK(c.hidden % c.heads == 0, "model setting 'heads' (", c.heads,
            ") must divide 'hidden' (", c.hidden, "): head size hidden/heads must be an integer (valid heads up to 256: ",
            divisors(c.hidden, 256), ")");
  EBB_CHECK(c.heads % c.tp == 0, "model setting 'tp' (", c.tp, ") must divide 'heads' (", c.heads,
            "): tensor parallelism splits whole attention heads (valid tp: ", divisors(c.heads, c.heads), ")");
  EBB_CHECK(c.ffn() % c.tp == 0, "model setting 'tp' (", c.tp, ") must divide the MLP width (",
            c.ffn(), ")");
  EBB_CHECK(c.bytes_per_element == 2 || c.bytes_per_element == 4,
            "model setting 'bytes_per_element' must be 2 (bf16/fp16) or 4 (fp32), got ",
            c.bytes_per_element);
}

Arch parse_arch(std::string_view name) {
  const std::string n = lower(name);
  if (n == "decoder") return Arch::kDecoder;
  if (n == "encoder") return Arch::kEncoder;
  if (n == "encoder-decoder" || n == "encoder_decoder") return Arch::kEncoderDecoder;
  throw InvalidArgument(detail::concat("unknown arch '", name, "' (valid: decoder, encoder, encoder-decoder)"));
}

Recompute parse_recompute(std::string_view name) {
  const std::string n = lower(name);
  if (n == "none") return Recompute::kNone;
  if (n == "selective") return Recompute::kSelective;
  if (n == "full") return Recompute::kFull;
  throw InvalidArgument(detail::concat("unknown recompute '", name, "' (valid: none, selective, full)"));
}

int64_t parse_dtype_bytes(std::string_view name) {
  const std::string n = lower(name);
  if (n == "bf16" || n == "bfloat16" || n == "fp16" || n == "float16" || n == "half") return 2;
  if (n == "fp32" || n == "float32" || n == "float") return 4;
  throw InvalidArgument(detail::concat("unknown dtype '", name, "' (valid: bf16, fp16, fp32)"));
}

std::string to_string(Arch arch) {
  switch (arch) {
    case Arch::kDecoder: return "decoder";
    case Arch::kEncoder: return "encoder";
    case Arch::kEncoderDecoder: return "encoder-decoder";
  }
  return "?";
}

std::string to_string(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

// Note [Activation bytes]
// Korthikanti et al. 2022 (arXiv 2205.05198, section 4) count, per layer at
// 16-bit with 1-byte dropout masks, s*b*h*(34 + 5*a*s/h). Split by who holds
// the tensor (p = bytes_per_element, f = MLP width, t = tensor parallel):
//   replicated on every TP rank (sharded only with sequence parallel):
//     2 layernorm inputs 2p, QKV-projection input p, MLP input p, 2 masks 1+1
//     -> (4p + 2) sbh                                   (p=2: 10 sbh)
//   sharded by TP: Q, K, V 3p, output-projection input p, GELU input and
//     second-linear input 2p*f/h -> (4p + 2p f/h) sbh / t   (p=2, f=4h: 24 sbh / t)
//   attention scores, sharded by heads: softmax output p, softmax-dropout mask 1,
//     dropout output p -> (2p + 1) a s^2 b / t           (p=2: 5 a s^2 b / t)
// FlashAttention and selective recompute drop the score term; FlashAttention
// keeps the softmax log-sum-exp instead (fp32, 4 a s b / t). Full recompute
// keeps only the layer input, p sbh (/t with SP). An encoder-decoder decoder
// layer adds cross-attention: replicated (2p + 1) sbh (layernorm input, query
// input, mask), sharded 4p sbh / t (Q, K, V, output input; K and V span the
// encoder sequence, taken equal to s) and a score term (2p + 1) a s^2 b / t;
// the encoder output (p sbh) feeds every cross-attention and is counted once
// per step. Derivation and the paper's table in docs/model.md.
ActivationBytes activation_bytes(const ModelConfig& c) {
  validate(c);
  const double s = static_cast<double>(c.seq);
  const double b = static_cast<double>(c.batch);
  const double h = static_cast<double>(c.hidden);
  const double a = static_cast<double>(c.heads);
  const double f = static_cast<double>(c.ffn());
  const double t = static_cast<double>(c.tp);
  const double p = static_cast<double>(c.bytes_per_element);
  const double sbh = s * b * h;
  const double sp_div = c.sp ? t : 1.0;
  const double kMask = 1.0;  // dropout masks are bool/uint8
  const double kLse = 4.0;   // FlashAttention's log-sum-exp is fp32

  auto attention_core = [&]() {
    if (c.recompute == Recompute::kSelective) return 0.0;
    if (c.flash_attn) return kLse * a * s * b / t;
    return (2 * p + kMask) * a * s * s * b / t;
  };

  ActivationBytes out;
  if (c.recompute == Recompute::kFull) {
    out.self_layer = p * sbh / sp_div;
    out.cross_layer = c.cross_layers() > 0 ? p * sbh / sp_div : 0.0;
  } else {
    const double replicated = (4 * p + 2 * kMask) * sbh;
    const double sharded = (4 * p + 2 * p * f / h) * sbh;
    out.self_layer = replicated / sp_div + sharded / t + attention_core();
    if (c.cross_layers() > 0) {
      const double x_replicated = (2 * p + kMask) * sbh;
      const double x_sharded = 4 * p * sbh;
      out.cross_layer = out.self_layer + x_replicated / sp_div + x_sharded / t + attention_core();
    }
  }
  out.shared = c.cross_layers() > 0 ? p * sbh / sp_div : 0.0;
  const double n_self = static_cast<double>(c.self_only_layers());
  const double n_cross = static_cast<double>(c.cross_layers());
  out.per_step = n_self * out.self_layer + n_cross * out.cross_layer + out.shared;
  out.last_layer = n_cross > 0 ? out.cross_layer : out.self_layer;
  out.logits = p * s * b * static_cast<double>(c.vocab) / t;
  return out;
}

// FLOPs count multiply-adds as 2 (Narayanan et al. 2021, appendix): per layer
// 24 b s h^2 + 4 b s^2 h with f = 4h, written here for any f as
// 8 b s h^2 (QKV + output) + 4 b s h f (MLP) + 4 b s^2 h (scores and context).
Flops flops(const ModelConfig& c) {
  validate(c);
  const double s = static_cast<double>(c.seq);
  const double b = static_cast<double>(c.batch);
  const double h = static_cast<double>(c.hidden);
  const double f = static_cast<double>(c.ffn());
  const double attn_core = 4 * b * s * s * h;
  Flops out;
  out.self_layer = 8 * b * s * h * h + 4 * b * s * h * f + attn_core;
  // Cross-attention: Q and output projections over s, K and V over the
  // encoder sequence (= s), scores and context s x s.
  const double cross = 8 * b * s * h * h + attn_core;
  out.cross_layer = c.cross_layers() > 0 ? out.self_layer + cross : 0.0;
  out.logits = 2 * b * s * h * static_cast<double>(c.vocab);
  const double layers = static_cast<double>(c.self_only_layers()) * out.self_layer +
                        static_cast<double>(c.cross_layers()) * out.cross_layer;
  out.forward = layers + out.logits;
  switch (c.recompute) {
    case Recompute::kNone: out.recompute = 0; break;
    case Recompute::kSelective:
      out.recompute = static_cast<double>(c.self_only_layers() + 2 * c.cross_layers()) * attn_core;
      break;
    case Recompute::kFull: out.recompute = layers; break;
  }
  out.step = 3 * out.forward + out.recompute;
  return out;
}

double parameter_count(const ModelConfig& c) {
  validate(c);
  const double h = static_cast<double>(c.hidden);
  const double f = static_cast<double>(c.ffn());
  // attention 4h^2 + 4h, MLP 2hf + f + h, two layernorms 4h
  const double self_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h;
  const double cross = 4 * h * h + 4 * h + 2 * h;  // cross-attention + its layernorm
  const double embeddings = static_cast<double>(c.vocab) * h + static_cast<double>(c.seq) * h;
  const double final_norms = (c.cross_layers() > 0 ? 2.0 : 1.0) * 2 * h;
  return static_cast<double>(c.self_only_layers()) * self_layer +
         static_cast<double>(c.cross_layers()) * (self_layer + cross) + embeddings + final_norms;
}

// Note [Catalog sources]: peak dense (non-sparse) tensor-core rates and memory
// from NVIDIA's A100, H100 and H200 datasheets; PCIe one direction (the
// datasheets quote both directions: 64 GB/s Gen4, 128 GB/s Gen5). SSD numbers
// from the vendors' product briefs; docs/model.md lists each one.
const std::vector<GpuSpec>& gpu_catalog() {
  static const std::vector<GpuSpec> kGpus = {
      {"a100-pcie", "NVIDIA A100 80GB PCIe", 312.0, 156.0, 80.0, 32.0},
      {"a100-sxm", "NVIDIA A100 80GB SXM4", 312.0, 156.0, 80.0, 32.0},
      {"h100-pcie", "NVIDIA H100 80GB PCIe", 756.0, 378.0, 80.0, 64.0},
      {"h100-sxm", "NVIDIA H100 80GB SXM5", 989.0, 494.5, 80.0, 64.0},
      {"h200", "NVIDIA H200 141GB SXM", 989.0, 494.5, 141.0, 64.0},
  };
  return kGpus;
}

const std::vector<SsdSpec>& ssd_catalog() {
  static const std::vector<SsdSpec> kSsds = {
      // Sources and the issue-4 re-check of each figure: docs/model.md, "Catalogs".
      {"d7-p5620", "Solidigm D7-P5620 6.4TB (TLC, mixed use)", 6.4, 3.0, 5.0, 35.04, 4.2, 7.1},
      {"d7-p5810", "Solidigm D7-P5810 800GB (SLC, write intensive)", 0.8, 50.0, 5.0, 73.0, 4.0, 6.4},
      {"fl6", "Kioxia FL6 1.6TB (XL-FLASH SLC)", 1.6, 60.0, 5.0, 175.2, 5.8, 6.2},
      {"p5800x", "Intel Optane SSD DC P5800X 1.6TB", 1.6, 100.0, 5.0, 292.0, 6.2, 7.2},
      {"pm1743", "Samsung PM1743 15.36TB (PCIe 5.0 TLC)", 15.36, 1.0, 5.0, 28.03, 6.6, 13.0},
      {"980-pro", "Samsung 980 PRO 2TB (client TLC)", 2.0, 0.33, 5.0, 1.2, 5.1, 7.0},
  };
  return kSsds;
}

const GpuSpec& find_gpu(std::string_view name) { return find_in(gpu_catalog(), name, "gpu"); }
const SsdSpec& find_ssd(std::string_view name) { return find_in(ssd_catalog(), name, "ssd"); }

namespace {

// Largest b with b * per_sample <= budget (0 when nothing fits).
int64_t fit(double budget, double per_sample) {
  if (budget <= 0 || per_sample <= 0) return 0;
  const double n = std::floor(budget / per_sample);
  return n > 1e15 ? static_cast<int64_t>(1e15) : static_cast<int64_t>(n);
}

}  // namespace

PlanReport make_plan(const ModelConfig& config, const GpuSpec& gpu, const SsdSpec& ssd,
                     const PlanOptions& options) {
  validate(config);
  EBB_CHECK(options.mfu > 0 && options.mfu <= 1, "plan setting 'mfu' must be in (0, 1], got ",
            options.mfu);
  EBB_CHECK(options.ssds > 0, "plan setting 'ssds' must be a positive integer, got ", options.ssds);
  EBB_CHECK(options.write_amplification >= 1.0,
            "plan setting 'write_amplification' must be >= 1.0, got ", options.write_amplification);

  PlanReport r;
  r.config = config;
  r.gpu = gpu;
  r.ssd = ssd;
  r.options = options;
  const double t = static_cast<double>(config.tp);
  r.params = parameter_count(config);
  r.model_state_bytes = 16.0 * r.params / t;
  r.activations = activation_bytes(config);
  r.offloaded_bytes_per_step =
      std::max(0.0, r.activations.per_step - r.activations.last_layer - r.activations.shared);
  r.resident_bytes_offloaded = r.activations.last_layer + r.activations.shared + r.activations.logits;
  r.flops = flops(config);

  const double peak = (config.bytes_per_element == 4 ? gpu.peak_tf32_tflops : gpu.peak_bf16_tflops) * 1e12;
  const double rate = peak * options.mfu;
  r.forward_seconds = r.flops.forward / t / rate;
  r.step_seconds = r.flops.step / t / rate;

  const double ssds = static_cast<double>(options.ssds);
  r.required_write_gbps = r.offloaded_bytes_per_step / (r.step_seconds / 2) / 1e9;
  r.ssd_write_gbps = ssd.seq_write_gbps * ssds;
  r.ssd_read_gbps = ssd.seq_read_gbps * ssds;
  r.write_gbps_available = std::min(r.ssd_write_gbps, gpu.pcie_gbps);
  r.bandwidth_sufficient = r.required_write_gbps <= r.write_gbps_available;
  const double write_seconds = r.offloaded_bytes_per_step / (r.write_gbps_available * 1e9);
  r.step_seconds_with_offload = std::max(r.step_seconds, 2 * write_seconds);
  r.bytes_written_per_second =
      r.offloaded_bytes_per_step * options.write_amplification / r.step_seconds_with_offload;
  const double endurance = ssd.pbw * 1e15 * ssds;
  constexpr double kSecondsPerYear = 365.25 * 86400.0;
  r.ssd_lifetime_years = r.bytes_written_per_second > 0
                             ? endurance / r.bytes_written_per_second / kSecondsPerYear
                             : std::numeric_limits<double>::infinity();
  r.ssd_capacity_bytes = ssd.capacity_tb * 1e12 * ssds;
  r.gpu_memory_bytes = gpu.memory_gb * 1e9;

  // Every activation term is linear in the micro-batch: size one sample and divide.
  ModelConfig one = config;
  one.batch = 1;
  const ActivationBytes a1 = activation_bytes(one);
  const double free_gpu = r.gpu_memory_bytes - r.model_state_bytes;
  const double resident1 = a1.last_layer + a1.shared + a1.logits;
  const double offloaded1 = std::max(0.0, a1.per_step - a1.last_layer - a1.shared);
  const int64_t by_gpu = fit(free_gpu, resident1);
  const int64_t by_ssd = offloaded1 > 0 ? fit(r.ssd_capacity_bytes, offloaded1) : by_gpu;
  r.max_micro_batch = std::min(by_gpu, by_ssd);
  r.max_micro_batch_without_offload = fit(free_gpu, a1.per_step + a1.logits);
  return r;
}

}  // namespace ebbtide::plan
