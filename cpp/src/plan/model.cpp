#include "ebbtide/plan/model.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <utility>

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
  throw InvalidArgument(detail::concat("unknown family '", name, "' (valid: gpt2, llama, t5)"));
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
// Note [Layer families]
// Family gpt2 is Note [Activation bytes]: the paper's count of Megatron-LM's
// fused kernels. Family llama counts, op by op, what autograd saves for the
// Hugging Face LlamaDecoderLayer (also Qwen2, Mistral, Mixtral) in PyTorch
// eager, one count per storage as the tensor cache keeps them (measured with a
// pack hook on random-init models, docs/model.md "Llama family").
// p = bytes_per_element, g = kv heads, d = h/a, T = s*b tokens, R = T*top_k:
//   RMSNorm (Python code): the fp32 input (pow and mul save it; a copy at
//     p = 2), the fp32 rsqrt per row, the normalised tensor in p (the weight
//     multiply saves it): 4 sbh + 4 sb + p sbh. LayerNorm: input and the two
//     fp32 row statistics, p sbh + 8 sb. Two per layer; their outputs are the
//     q/k/v and MLP inputs, p sbh each.
//   rotary: q*cos + rotate_half(q)*sin saves only cos and sin (they need no
//     grad), one s x d table each per step, shared by every layer (`outside`).
//   SDPA / flash: q (p sbh), k and v at g heads (2 p sbh g/a), the output,
//     which is the o-projection input (its transpose is already contiguous),
//     and the fp32 log-sum-exp 4 a s b.
//   eager: q, k and v repeated to a heads (repeat_kv copies, 3 p sbh), the
//     fp32 softmax output 4 a s^2 b, at p = 2 its cast to p (p a s^2 b), with
//     dropout a bool mask and the dropped copy (1 + p) a s^2 b, and the
//     o-projection input (transpose(...).contiguous() copies: p sbh).
//   gated MLP: gate output, SiLU output, up output, product: 4 p sbf; a plain
//     MLP 2 p sbf (activation input, second-linear input).
//   mixture of experts (grouped_mm path: the R token-expert pairs sorted by
//     expert, so the total does not depend on the routing): fp32 router
//     softmax 4 T E; top-k indices, sort permutation, token index and inverse
//     permutation, int64, 32 R; fp32 top-k weights before and after sorting
//     8 R, their row sums 4 T; int32 group offsets 4 E; the gathered tokens and
//     the expert outputs p R h each; per expert row 4 p fe (gate_up output 2fe,
//     SiLU output, product). Without renormalisation (Qwen2-MoE's default)
//     the top-k weights and row sums (4 R + 4 T) go. Qwen2-MoE's shared
//     expert adds a gated MLP over all tokens, its sigmoid gate output p sb
//     and its output p sbh (the gate multiply saves both); it casts the
//     routing weights to p, which this count keeps at fp32 (2 R more at p = 2).
// Outside the layers (`outside`): int64 ids 8 sb, cos and sin 2 s d p, the
// final norm, the LM-head input p sbh. `logits` is what HF's loss saves: it
// upcasts the logits, so the log-softmax is fp32 (4 sbV), plus int64 targets
// and a scalar. TP shards q/k/v, the attention core and the MLP inner tensors;
// SP shards the rest, as for family gpt2.
namespace {

double norm_bytes(const ModelConfig& c, double sbh, double sb) {
  const double p = static_cast<double>(c.bytes_per_element);
  return c.norm == Norm::kRmsNorm ? 4 * sbh + 4 * sb + p * sbh : p * sbh + 8 * sb;
}

ActivationBytes llama_activation_bytes(const ModelConfig& c) {
  const double s = static_cast<double>(c.seq);
  const double b = static_cast<double>(c.batch);
  const double h = static_cast<double>(c.hidden);
  const double a = static_cast<double>(c.heads);
  const double g = static_cast<double>(c.kv());
  const double f = static_cast<double>(c.ffn());
  const double t = static_cast<double>(c.tp);
  const double p = static_cast<double>(c.bytes_per_element);
  const double sb = s * b;
  const double sbh = sb * h;
  const double sp_div = c.sp ? t : 1.0;
  constexpr double kFp32 = 4.0;
  constexpr double kInt64 = 8.0;
  constexpr double kMask = 1.0;

  double core = 0;  // attention core, dropped by selective recompute
  if (c.flash_attn) {
    core = kFp32 * a * sb;
  } else {
    const double ss = a * s * s * b;
    core = kFp32 * ss + (p != kFp32 ? p * ss : 0.0) + (c.dropout ? (kMask + p) * ss : 0.0);
  }
  if (c.recompute == Recompute::kSelective) core = 0;
  const double sbw = sb * static_cast<double>(c.attention_width());
  const double qkv = c.flash_attn ? p * sbw * (1 + 2 * g / a) : 3 * p * sbw;
  double replicated = 2 * norm_bytes(c, sbh, sb) + 2 * p * sbh;
  double sharded = qkv + p * sbw;
  if (c.experts == 0) {
    sharded += (c.gated_mlp ? 4 : 2) * p * sb * f;
  } else {
    const double e = static_cast<double>(c.experts);
    const double r = sb * static_cast<double>(c.top_k);
    const double fe = static_cast<double>(c.expert_ffn());
    replicated += kFp32 * sb * e + 4 * kInt64 * r + kFp32 * r + kFp32 * e + 2 * p * r * h;
    if (c.norm_topk) replicated += kFp32 * r + kFp32 * sb;
    sharded += (c.gated_mlp ? 4 : 2) * p * r * fe;
    if (c.shared_expert_ffn_hidden > 0) {
      replicated += p * sb + p * sbh;  // sigmoid gate output, shared expert output
      sharded += (c.gated_mlp ? 4 : 2) * p * sb * static_cast<double>(c.shared_expert_ffn_hidden);
    }
  }
  ActivationBytes out;
  out.self_layer = c.recompute == Recompute::kFull ? p * sbh / sp_div
                                                   : replicated / sp_div + sharded / t + core / t;
  out.per_step = static_cast<double>(c.layers) * out.self_layer;
  out.last_layer = out.self_layer;
  const double head_dim = static_cast<double>(c.head_size());
  out.outside = kInt64 * sb + (c.rotary ? 2 * s * head_dim * p : 0.0) +
                (norm_bytes(c, sbh, sb) + p * sbh) / sp_div;
  out.logits = kFp32 * sb * static_cast<double>(c.vocab) / t + kInt64 * sb + kFp32;
  return out;
}

// Note [T5 family]: what autograd saves for the Hugging Face T5 blocks
// (T5ForConditionalGeneration, eager attention with the relative position
// bias added to the scores), counted as predicted_saved_bytes counts it on
// CUDA (bool dropout masks); w = heads x d_kv, ss = a s^2 b, p the dtype:
//   T5LayerNorm (Python): the input, its fp32 copy (p = 2 only), the fp32
//     rsqrt per row and the normalised tensor cast back: (2p + 4) sbh + 4 sb;
//     its output is the next projection's input, p sbh.
//   attention: q, k, v as matmul saves them (3p sbw), the o-projection input
//     (p sbw), softmax output p ss, with dropout its mask and the dropped copy
//     (1 + p) ss; flash_attn (SDPA with the bias as a mask): the fp32
//     log-sum-exp 4 a s b instead of the scores. The residual dropout mask sbh.
//   MLP: ReLU: its output p sbf (the wo input without dropout); dropout adds
//     the mask and the dropped copy (1 + p) sbf. Gated GELU (gelu_new, Python
//     code): x, tanh, 0.5x, 1 + tanh (4p sbf), the GELU and linear outputs the
//     product saves (2p sbf), and the wo input p sbf (+ the mask with dropout).
//   decoder layers add cross-attention: a norm, the query input, q, k, v and
//     the o input over the encoder output, which is saved once (`shared`).
//   outside, per stack: int64 ids, the embedding and final dropout masks, the
//     int64 s x s relative-position buckets, the final norm; the LM-head input.
//     Full recompute (checkpointing each block) keeps each block's input, and
//     the three (1, a, s, s) position biases (encoder, decoder, cross; HF 5
//     adds the masks inside the attention) every checkpointed block holds
//     as an input: a term that does not grow with the batch.
//   logits: CrossEntropyLoss's log-softmax in p, int64 targets, a scalar.
ActivationBytes t5_activation_bytes(const ModelConfig& c) {
  const double s = static_cast<double>(c.seq);
  const double b = static_cast<double>(c.batch);
  const double h = static_cast<double>(c.hidden);
  const double a = static_cast<double>(c.heads);
  const double f = static_cast<double>(c.ffn());
  const double t = static_cast<double>(c.tp);
  const double p = static_cast<double>(c.bytes_per_element);
  const double sb = s * b;
  const double sbh = sb * h;
  const double sbw = sb * static_cast<double>(c.attention_width());
  const double sbf = sb * f;
  const double ss = a * s * s * b;
  const double sp_div = c.sp ? t : 1.0;
  constexpr double kFp32 = 4.0;
  constexpr double kInt64 = 8.0;
  constexpr double kMask = 1.0;
  const double drop = c.dropout ? kMask : 0.0;  // a dropout mask per element

  const double norm = (2 * p + (p != kFp32 ? kFp32 : 0.0)) * sbh + kFp32 * sb + p * sbh;  // + its output
  double core = c.flash_attn ? kFp32 * a * sb : p * ss + (c.dropout ? (kMask + p) * ss : 0.0);
  if (c.recompute == Recompute::kSelective) core = 0;
  const double attn_replicated = norm + drop * sbh;
  const double attn_sharded = 4 * p * sbw + core;
  double mlp_sharded = 0;
  if (c.gated_mlp) {
    mlp_sharded = 6 * p * sbf + p * sbf + drop * sbf;
  } else {
    mlp_sharded = p * sbf + (c.dropout ? (kMask + p) * sbf : 0.0);
  }
  const double mlp_replicated = norm + drop * sbh;

  ActivationBytes out;
  if (c.recompute == Recompute::kFull) {
    out.self_layer = p * sbh / sp_div;
    out.cross_layer = p * sbh / sp_div;
  } else {
    out.self_layer = (attn_replicated + mlp_replicated) / sp_div + (attn_sharded + mlp_sharded) / t;
    out.cross_layer = out.self_layer + attn_replicated / sp_div + attn_sharded / t;
  }
  out.shared = p * sbh / sp_div;
  const double n_self = static_cast<double>(c.self_only_layers());
  const double n_cross = static_cast<double>(c.cross_layers());
  out.per_step = n_self * out.self_layer + n_cross * out.cross_layer + out.shared;
  out.last_layer = out.cross_layer;
  const double final_norm = (2 * p + (p != kFp32 ? kFp32 : 0.0)) * sbh + kFp32 * sb;
  const double per_stack = kInt64 * sb + kInt64 * s * s + (2 * drop * sbh + final_norm) / sp_div;
  out.outside = 2 * per_stack + p * sbh / sp_div;
  if (c.recompute == Recompute::kFull) out.outside += 3 * p * a * s * s / t;
  out.logits = p * sb * static_cast<double>(c.vocab) / t + kInt64 * sb + p;
  return out;
}

ActivationBytes stack_activation_bytes(const ModelConfig& c) {
  const double s = static_cast<double>(c.seq);
  const double b = static_cast<double>(c.batch);
  const double h = static_cast<double>(c.hidden);
  const double a = static_cast<double>(c.heads);
  const double f = static_cast<double>(c.ffn());
  const double t = static_cast<double>(c.tp);
  const double p = static_cast<double>(c.bytes_per_element);
  const double sbh = s * b * h;
  const double sbw = s * b * static_cast<double>(c.attention_width());
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
    const double sharded = 4 * p * sbw + 2 * p * f / h * sbh;
    out.self_layer = replicated / sp_div + sharded / t + attention_core();
    if (c.cross_layers() > 0) {
      const double x_replicated = (2 * p + kMask) * sbh;
      const double x_sharded = 4 * p * sbw;
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

}  // namespace

ActivationBytes activation_bytes(const ModelConfig& c) {
  validate(c);
  ActivationBytes out = c.family == Family::kLlama ? llama_activation_bytes(c)
                        : c.family == Family::kT5  ? t5_activation_bytes(c)
                                                   : stack_activation_bytes(c);
  if (c.recompute == Recompute::kFull) {
    // The layer being differentiated is rebuilt whole, beside the checkpoints.
    ModelConfig kept = c;
    kept.recompute = Recompute::kNone;
    out.recompute_layer = activation_bytes(kept).largest_layer();
  }
  return out;
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

namespace {

ModelConfig llama_shape(int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t ffn,
                        int64_t vocab) {
  ModelConfig c;
  c.family = Family::kLlama;
  c.layers = layers;
  c.hidden = hidden;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.ffn_hidden = ffn;
  c.vocab = vocab;
  return c;
}

// A T5 v1.0 shape: ReLU MLP, tied embeddings, dropout 0.1, eager attention.
ModelConfig t5_shape(int64_t layers, int64_t d_model, int64_t heads, int64_t d_kv, int64_t d_ff) {
  ModelConfig c;
  c.family = Family::kT5;
  c.arch = Arch::kEncoderDecoder;
  c.layers = layers;
  c.decoder_layers = layers;
  c.hidden = d_model;
  c.heads = heads;
  c.head_dim = d_kv;
  c.ffn_hidden = d_ff;
  c.vocab = 32128;
  c.gated_mlp = false;
  c.tied_embeddings = true;
  c.dropout = true;
  c.flash_attn = false;
  return c;
}

ModelConfig with_qkv_bias(ModelConfig c) {
  c.qkv_bias = true;
  return c;
}

ModelConfig with_experts(ModelConfig c, int64_t experts, int64_t top_k) {
  c.experts = experts;
  c.top_k = top_k;
  return c;
}

}  // namespace

// Note [Model catalog]: shapes from each model's published config.json
// (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
// intermediate_size, vocab_size, num_local_experts, num_experts_per_tok,
// tie_word_embeddings false for all five). Parameter counts come out at the
// published 8.03 B, 70.6 B, 7.62 B, 72.7 B and 46.7 B (docs/model.md). T5
// from the t5-3b / t5-11b config.json (num_layers, num_decoder_layers,
// d_model, num_heads, d_kv, d_ff, vocab_size, feed_forward_proj relu):
// 2,851,598,336 and 11,307,321,344 parameters.
const std::vector<ModelSpec>& model_catalog() {
  static const std::vector<ModelSpec> kModels = {
      {"llama3-8b", "Meta Llama 3 8B (also 3.1)", llama_shape(32, 4096, 32, 8, 14336, 128256)},
      {"llama3-70b", "Meta Llama 3 70B (also 3.1, 3.3)", llama_shape(80, 8192, 64, 8, 28672, 128256)},
      {"qwen2.5-7b", "Qwen2.5 7B", with_qkv_bias(llama_shape(28, 3584, 28, 4, 18944, 152064))},
      {"qwen2.5-72b", "Qwen2.5 72B", with_qkv_bias(llama_shape(80, 8192, 64, 8, 29568, 152064))},
      {"mixtral-8x7b", "Mistral AI Mixtral 8x7B (8 experts, top 2)",
       with_experts(llama_shape(32, 4096, 32, 8, 14336, 32000), 8, 2)},
      {"t5-3b", "Google T5 3B (T5-XL v1.0, encoder-decoder 24 + 24)", t5_shape(24, 1024, 32, 128, 16384)},
      {"t5-11b", "Google T5 11B (T5-XXL v1.0, encoder-decoder 24 + 24)", t5_shape(24, 1024, 128, 128, 65536)},
  };
  return kModels;
}

const ModelSpec& find_model(std::string_view name) { return find_in(model_catalog(), name, "model"); }

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
const NetworkSpec& find_network(std::string_view name) { return find_in(network_catalog(), name, "network"); }
const OptimizerPreset& find_optimizer(std::string_view name) {
  return find_in(optimizer_presets(), name, "optimizer");
}

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
  r.units = parameter_units(config);
  r.model_state = model_state_bytes(r.units, options.sharding);
  r.model_state_bytes = r.model_state.total;
  r.activations = activation_bytes(config);
  r.offloaded_bytes_per_step =
      std::max(0.0, r.activations.per_step - r.activations.last_layer - r.activations.shared);
  r.resident_bytes_offloaded = r.activations.last_layer + r.activations.shared + r.activations.logits +
                               r.activations.outside + r.activations.recompute_layer;
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

  // Every activation term is affine in the micro-batch (a few, such as
  // position tables, do not grow with it): size one and two samples, fit
  // per sample in what the fixed part leaves.
  ModelConfig one = config;
  one.batch = 1;
  ModelConfig two = config;
  two.batch = 2;
  const ActivationBytes a1 = activation_bytes(one);
  const ActivationBytes a2 = activation_bytes(two);
  const double free_gpu = r.gpu_memory_bytes - r.model_state_bytes;
  auto resident = [](const ActivationBytes& a) {
    return a.last_layer + a.shared + a.logits + a.outside + a.recompute_layer;
  };
  auto kept = [](const ActivationBytes& a) { return a.per_step + a.logits + a.outside + a.recompute_layer; };
  auto offloaded = [](const ActivationBytes& a) { return std::max(0.0, a.per_step - a.last_layer - a.shared); };
  auto fit_affine = [](double budget, double at1, double at2) { return fit(budget - (2 * at1 - at2), at2 - at1); };
  const int64_t by_gpu = fit_affine(free_gpu, resident(a1), resident(a2));
  const int64_t by_ssd =
      offloaded(a1) > 0 ? fit_affine(r.ssd_capacity_bytes, offloaded(a1), offloaded(a2)) : by_gpu;
  r.max_micro_batch = std::min(by_gpu, by_ssd);
  r.max_micro_batch_without_offload = fit_affine(free_gpu, kept(a1), kept(a2));
  return r;
}

// Note [Collective time]: a ring collective over n GPUs moves (n-1)/n of
// the full buffer through each link of the ring in n-1 steps: (n-1)/n x
// bytes / bw + (n-1) x latency. Inside a node bw is a GPU's NVLink rate.
// Across nodes it depends on who shares the NICs: a ring that all of a
// node's GPUs join (FSDP's shard group, DDP's all-reduce) enters and leaves
// each node once per channel, and NCCL spreads its channels over all the
// node's NICs, so it runs at the node's aggregate rate (gpus_per_node x
// inter_gbps, at most NVLink); HSDP's replica all-reduces (one GPU per node
// in each, all of a node's GPUs at once) get a GPU's share. Stage 3
// all-gathers each layer before its forward and again before its backward,
// and reduce-scatters its gradients after backward (HSDP: then all-reduces
// the shard across the dp / N replicas); a layer's collectives overlap the
// neighbouring layer's compute, so what exceeds the layer's compute is
// exposed, layer kind by layer kind (an encoder-decoder's decoder layers are
// larger and longer than its encoder layers), and the root unit's gather
// (before the first layer) and reduce-scatter (after the last) are exposed
// whole. Stages 0-2 all-reduce (2: reduce-scatter) the gradients in buckets
// during backward, exposed beyond the backward time; stages 1-2 all-gather
// the updated parameters after the optimizer step, exposed.
CommTimes communication(const PlanReport& r, const NetworkSpec& net) {
  EBB_CHECK(net.gpus_per_node > 0 && net.intra_gbps > 0 && net.inter_gbps > 0 && net.latency_us >= 0,
            "network '", net.name, "' needs positive GPUs per node and rates, and latency >= 0");
  const ShardingOptions& o = r.options.sharding;
  const double node_gbps = std::min(net.intra_gbps, net.inter_gbps * static_cast<double>(net.gpus_per_node));
  auto ring = [&](double bytes, int64_t n, bool one_gpu_per_node) {
    if (n <= 1) return 0.0;
    const double gbps = one_gpu_per_node ? net.inter_gbps : (n > net.gpus_per_node ? node_gbps : net.intra_gbps);
    const double k = static_cast<double>(n);
    return (k - 1) / k * bytes / (gbps * 1e9) + (k - 1) * net.latency_us * 1e-6;
  };
  CommTimes c;
  const double t = static_cast<double>(r.config.tp);
  const double rate = r.flops.forward / t / r.forward_seconds;  // FLOP/s per GPU
  const double backward_ratio = (r.step_seconds - r.forward_seconds) / r.forward_seconds;
  const double backward = r.step_seconds - r.forward_seconds;
  const int64_t n = r.model_state.shard_over;
  const int64_t replicas = o.dp / n;
  if (o.zero_stage == 3) {
    auto reduce = [&](double params) {
      return ring(o.grad_bytes * params, n, false) +
             2 * ring(o.grad_bytes * params / static_cast<double>(n), replicas, true);
    };
    struct LayerKind {
      double count, params, flops;
    };
    const LayerKind kinds[] = {
        {static_cast<double>(r.config.self_only_layers()), r.units.self_layer, r.flops.self_layer / t},
        {static_cast<double>(r.config.cross_layers()), r.units.cross_layer, r.flops.cross_layer / t},
    };
    for (const LayerKind& kind : kinds) {
      if (kind.count <= 0) continue;
      const double forward = kind.flops / rate;
      const double gather = ring(o.param_bytes * kind.params, n, false);
      const double reduced = reduce(kind.params);
      c.comm_seconds += kind.count * (2 * gather + reduced);
      c.exposed_seconds += kind.count * (std::max(0.0, gather - forward) +
                                         std::max(0.0, gather + reduced - forward * backward_ratio));
      if (kind.params >= r.units.largest_layer) {  // report the largest layer's times
        c.gather_seconds = gather;
        c.reduce_seconds = reduced;
        c.unit_forward_seconds = forward;
        c.unit_backward_seconds = forward * backward_ratio;
      }
    }
    const double root = ring(o.param_bytes * r.units.root, n, false) + reduce(r.units.root);
    c.comm_seconds += root;
    c.exposed_seconds += root;
  } else {
    const double layer_flops = r.flops.largest_layer() / t;
    c.unit_forward_seconds = layer_flops / rate;
    c.unit_backward_seconds = c.unit_forward_seconds * backward_ratio;
    const double grads = o.grad_bytes * r.units.total;
    const double reduce = o.zero_stage == 2 ? ring(grads, n, false) + 2 * ring(grads / static_cast<double>(n),
                                                                               replicas, true)
                                            : 2 * ring(grads, o.dp, false);
    const double gather = o.zero_stage >= 1 ? ring(o.param_bytes * r.units.total, n, false) : 0.0;
    c.comm_seconds = reduce + gather;
    c.exposed_seconds = std::max(0.0, reduce - backward) + gather;
  }
  c.step_seconds = r.step_seconds + c.exposed_seconds;
  c.scaling_efficiency = r.step_seconds / c.step_seconds;
  return c;
}

}  // namespace ebbtide::plan
