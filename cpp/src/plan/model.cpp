// The performance model's configuration (normalized, validate, the parsers
// and names), its FLOPs and parameter counts. Activation bytes are in
// model_activations.cpp, the catalogs in model_catalog.cpp, make_plan and
// communication in model_plan.cpp.
#include "ebbtide/plan/model.hpp"

#include <algorithm>
#include <utility>

#include "ebbtide/util/error.hpp"
#include "model_impl.hpp"

namespace ebbtide::plan {

namespace {

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

ModelConfig normalized(const ModelConfig& config) {
  ModelConfig c = config;
  c.ffn_hidden = config.ffn();
  c.decoder_layers = config.cross_layers();
  c.head_dim = config.head_size();
  if (config.family == Family::kLlama) {  // the others are llama settings (validate())
    c.kv_heads = config.kv();
    c.expert_ffn_hidden = config.experts > 0 ? config.expert_ffn() : 0;
  }
  return c;
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
  EBB_CHECK(c.head_dim >= 0, "model setting 'head_dim' must be positive (or 0 for hidden/heads), got ", c.head_dim);
  EBB_CHECK(c.head_dim > 0 || c.hidden % c.heads == 0, "model setting 'heads' (", c.heads,
            ") must divide 'hidden' (", c.hidden, "): head size hidden/heads must be an integer (valid heads up to 256: ",
            divisors(c.hidden, 256), "), or set 'head_dim'");
  EBB_CHECK(c.heads % c.tp == 0, "model setting 'tp' (", c.tp, ") must divide 'heads' (", c.heads,
            "): tensor parallelism splits whole attention heads (valid tp: ", divisors(c.heads, c.heads), ")");
  EBB_CHECK(c.ffn() % c.tp == 0, "model setting 'tp' (", c.tp, ") must divide the MLP width (",
            c.ffn(), ")");
  EBB_CHECK(c.bytes_per_element == 2 || c.bytes_per_element == 4,
            "model setting 'bytes_per_element' must be 2 (bf16/fp16) or 4 (fp32), got ",
            c.bytes_per_element);
  EBB_CHECK(c.kv_heads >= 0, "model setting 'kv_heads' must be positive (or 0 for heads), got ", c.kv_heads);
  EBB_CHECK(c.experts >= 0, "model setting 'experts' must be >= 0 (0: a dense MLP), got ", c.experts);
  EBB_CHECK(c.expert_ffn_hidden >= 0,
            "model setting 'expert_ffn_hidden' must be positive (or 0 for ffn_hidden), got ", c.expert_ffn_hidden);
  if (c.family != Family::kLlama) {
    for (auto [v, name] : {std::pair{c.kv_heads, "kv_heads"}, std::pair{c.experts, "experts"},
                           std::pair{c.top_k, "top_k"}, std::pair{c.expert_ffn_hidden, "expert_ffn_hidden"},
                           std::pair{c.shared_expert_ffn_hidden, "shared_expert_ffn_hidden"}}) {
      EBB_CHECK(v == 0, "model setting '", name, "' applies only to family llama (got family ", to_string(c.family),
                ")");
    }
  }
  if (c.family == Family::kGpt2) return;
  if (c.family == Family::kMegatron) {
    EBB_CHECK(c.arch == Arch::kDecoder, "model family megatron is a decoder (Megatron-core's GPTModel; got arch ",
              to_string(c.arch), ")");
    return;
  }
  if (c.family == Family::kT5) {
    EBB_CHECK(c.arch == Arch::kEncoderDecoder, "model family t5 is an encoder-decoder (got arch ",
              to_string(c.arch), ")");
    EBB_CHECK(c.norm == Norm::kRmsNorm, "model family t5 uses rmsnorm (got norm ", to_string(c.norm), ")");
    EBB_CHECK(!c.bias && !c.qkv_bias, "model settings 'bias' and 'qkv_bias' do not apply to family t5 (no biases)");
    return;
  }
  EBB_CHECK(c.arch == Arch::kDecoder, "model family llama is a decoder (got arch ", to_string(c.arch), ")");
  EBB_CHECK(c.heads % c.kv() == 0, "model setting 'kv_heads' (", c.kv(), ") must divide 'heads' (", c.heads,
            "): each key/value head serves a whole group of query heads (valid: ", divisors(c.heads, c.heads), ")");
  EBB_CHECK(c.kv() % c.tp == 0, "model setting 'tp' (", c.tp, ") must divide 'kv_heads' (", c.kv(), ")");
  if (c.experts == 0) {
    EBB_CHECK(c.top_k == 0 && c.expert_ffn_hidden == 0 && c.shared_expert_ffn_hidden == 0,
              "model settings 'top_k', 'expert_ffn_hidden' and 'shared_expert_ffn_hidden' need 'experts' > 0 "
              "(got top_k ", c.top_k, ", expert_ffn_hidden ", c.expert_ffn_hidden, ", shared_expert_ffn_hidden ",
              c.shared_expert_ffn_hidden, ")");
  } else {
    EBB_CHECK(c.top_k >= 1 && c.top_k <= c.experts, "model setting 'top_k' must be in 1..experts (",
              c.experts, "), got ", c.top_k);
    EBB_CHECK(c.shared_expert_ffn_hidden >= 0,
              "model setting 'shared_expert_ffn_hidden' must be >= 0 (0: none), got ", c.shared_expert_ffn_hidden);
    EBB_CHECK(c.expert_ffn() % c.tp == 0, "model setting 'tp' (", c.tp, ") must divide the expert MLP width (",
              c.expert_ffn(), ")");
  }
}

Arch parse_arch(std::string_view name) {
  const std::string n = lower(name);
  if (n == "decoder") return Arch::kDecoder;
  if (n == "encoder") return Arch::kEncoder;
  if (n == "encoder-decoder" || n == "encoder_decoder") return Arch::kEncoderDecoder;
  throw InvalidArgument(detail::concat("unknown arch '", name, "' (valid: decoder, encoder, encoder-decoder)"));
}

Family parse_family(std::string_view name) {
  const std::string n = lower(name);
  if (n == "gpt2") return Family::kGpt2;
  if (n == "llama") return Family::kLlama;
  if (n == "t5") return Family::kT5;
  if (n == "megatron") return Family::kMegatron;
  throw InvalidArgument(detail::concat("unknown family '", name, "' (valid: gpt2, llama, t5, megatron)"));
}

Norm parse_norm(std::string_view name) {
  const std::string n = lower(name);
  if (n == "layernorm" || n == "layer-norm" || n == "layer_norm") return Norm::kLayerNorm;
  if (n == "rmsnorm" || n == "rms-norm" || n == "rms_norm") return Norm::kRmsNorm;
  throw InvalidArgument(detail::concat("unknown norm '", name, "' (valid: layernorm, rmsnorm)"));
}

std::string to_string(Family family) {
  switch (family) {
    case Family::kGpt2: return "gpt2";
    case Family::kLlama: return "llama";
    case Family::kT5: return "t5";
    case Family::kMegatron: return "megatron";
  }
  return "?";
}
std::string to_string(Norm norm) { return norm == Norm::kRmsNorm ? "rmsnorm" : "layernorm"; }

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

// FLOPs count multiply-adds as 2 (Narayanan et al. 2021, appendix): per layer
// 24 b s h^2 + 4 b s^2 h with f = 4h and w = h, written here for any f and
// attention width w = heads x head_dim as 8 b s h w (QKV + output) + 4 b s h f
// (MLP; a gated t5 MLP 6 b s h f) + 4 b s^2 w (scores and context).
// Family llama: q and o projections 4 b s h w, k and v 4 b s h w g/a, a gated
// MLP three matrices 6 b s h f (plain: 4 b s h f); with experts the router
// 2 b s h E and the top_k experts per token 6 b s k h fe. Causal masking is
// not subtracted from the s^2 terms (as in the paper's count).
Flops flops(const ModelConfig& c) {
  validate(c);
  const double s = static_cast<double>(c.seq);
  const double b = static_cast<double>(c.batch);
  const double h = static_cast<double>(c.hidden);
  const double f = static_cast<double>(c.ffn());
  const double w = static_cast<double>(c.attention_width());
  const double attn_core = 4 * b * s * s * w;
  Flops out;
  if (c.family == Family::kLlama) {
    const double kv_fraction = static_cast<double>(c.kv()) / static_cast<double>(c.heads);
    const double mlp_matrices = c.gated_mlp ? 3 : 2;
    out.self_layer = 4 * b * s * h * w * (1 + kv_fraction) + attn_core;
    if (c.experts == 0) {
      out.self_layer += 2 * mlp_matrices * b * s * h * f;
    } else {
      out.self_layer += 2 * b * s * h * static_cast<double>(c.experts) +
                        2 * mlp_matrices * b * s * static_cast<double>(c.top_k) * h *
                            static_cast<double>(c.expert_ffn());
      if (c.shared_expert_ffn_hidden > 0)
        out.self_layer += 2 * mlp_matrices * b * s * h * static_cast<double>(c.shared_expert_ffn_hidden) +
                          2 * b * s * h;
    }
  } else {
    const double mlp_matrices = c.family == Family::kT5 && c.gated_mlp ? 3 : 2;
    out.self_layer = 8 * b * s * h * w + 2 * mlp_matrices * b * s * h * f + attn_core;
  }
  // Cross-attention: Q and output projections over s, K and V over the
  // encoder sequence (= s), scores and context s x s.
  const double cross = 8 * b * s * h * w + attn_core;
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

namespace {

// T5's relative_attention_num_buckets: 32 in every published T5 config.
constexpr double kT5Buckets = 32;

// Parameters of one self-attention layer and of one encoder-decoder decoder
// layer (self + cross), unsharded.
struct LayerParams {
  double self_layer = 0;
  double cross_layer = 0;
};

LayerParams layer_parameter_count(const ModelConfig& c) {
  const double h = static_cast<double>(c.hidden);
  const double f = static_cast<double>(c.ffn());
  const double w = static_cast<double>(c.attention_width());
  LayerParams out;
  if (c.family == Family::kLlama) {
    const double hkv = w * static_cast<double>(c.kv()) / static_cast<double>(c.heads);
    const double norm = c.norm == Norm::kRmsNorm ? h : 2 * h;
    const double matrices = c.gated_mlp ? 3 : 2;
    double attn = 2 * h * w + 2 * h * hkv;
    if (c.bias || c.qkv_bias) attn += w + 2 * hkv;
    if (c.bias) attn += h;
    auto mlp = [&](double width) { return matrices * h * width + (c.bias ? (matrices - 1) * width + h : 0.0); };
    const double e = static_cast<double>(c.experts);
    double ffn = c.experts == 0 ? mlp(f) : e * mlp(static_cast<double>(c.expert_ffn())) + e * h;
    if (c.shared_expert_ffn_hidden > 0) ffn += mlp(static_cast<double>(c.shared_expert_ffn_hidden)) + h;
    out.self_layer = attn + ffn + 2 * norm;
    return out;
  }
  if (c.family == Family::kT5) {
    // q, k, v, o without biases 4hw, wi (gated: wi_0, wi_1) and wo, an RMSNorm weight per sublayer.
    const double attn = 4 * h * w;
    const double mlp = (c.gated_mlp ? 3 : 2) * h * f;
    out.self_layer = attn + mlp + 2 * h;
    out.cross_layer = out.self_layer + attn + h;
    return out;
  }
  // attention 4hw + 3w + h, MLP 2hf + f + h, two layernorms 4h
  const double attn = 4 * h * w + 3 * w + h;
  out.self_layer = attn + 2 * h * f + f + h + 4 * h;
  if (c.cross_layers() > 0) out.cross_layer = out.self_layer + attn + 2 * h;  // + cross-attn, its norm
  return out;
}

}  // namespace

double parameter_count(const ModelConfig& c) {
  validate(c);
  const double h = static_cast<double>(c.hidden);
  const LayerParams layer = layer_parameter_count(c);
  if (c.family == Family::kLlama) {
    const double norm = c.norm == Norm::kRmsNorm ? h : 2 * h;
    const double embeddings = static_cast<double>(c.vocab) * h * (c.tied_embeddings ? 1 : 2);
    return static_cast<double>(c.layers) * layer.self_layer + embeddings + norm;
  }
  if (c.family == Family::kT5) {
    // One embedding shared by both stacks (and the LM head when tied), the two
    // final norms, and the relative-position bias table (kT5Buckets x heads)
    // of each stack's first layer.
    const double embeddings = static_cast<double>(c.vocab) * h * (c.tied_embeddings ? 1 : 2);
    const double position_bias = 2.0 * kT5Buckets * static_cast<double>(c.heads);
    return static_cast<double>(c.self_only_layers()) * layer.self_layer +
           static_cast<double>(c.cross_layers()) * layer.cross_layer + embeddings + 2 * h + position_bias;
  }
  const double embeddings = static_cast<double>(c.vocab) * h + static_cast<double>(c.seq) * h;
  const double final_norms = (c.cross_layers() > 0 ? 2.0 : 1.0) * 2 * h;
  return static_cast<double>(c.self_only_layers()) * layer.self_layer +
         static_cast<double>(c.cross_layers()) * layer.cross_layer + embeddings + final_norms;
}

ParameterUnits parameter_units(const ModelConfig& c) {
  validate(c);
  const double t = static_cast<double>(c.tp);
  const LayerParams layer = layer_parameter_count(c);
  const double all_layers = static_cast<double>(c.self_only_layers()) * layer.self_layer +
                            static_cast<double>(c.cross_layers()) * layer.cross_layer;
  ParameterUnits u;
  u.total = parameter_count(c) / t;
  u.largest_layer = std::max(layer.self_layer, layer.cross_layer) / t;
  u.self_layer = layer.self_layer / t;
  u.cross_layer = layer.cross_layer / t;
  u.root = std::max(0.0, u.total - all_layers / t);
  return u;
}

}  // namespace ebbtide::plan
