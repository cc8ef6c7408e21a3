// Activation bytes per layer and per step (Notes [Activation bytes], [Layer
// families], [T5 family]).
#include "ebbtide/plan/megatron.hpp"
#include "ebbtide/plan/model.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::plan {

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

// The sizes each count below starts from, as doubles (Note [Activation
// bytes]'s letters): s seq, b batch, h hidden, a heads, f MLP width, t
// tensor-parallel ranks, p bytes per element.
struct Sizes {
  double s, b, h, a, f, t, p;
};

Sizes sizes_of(const ModelConfig& c) {
  return {static_cast<double>(c.seq),   static_cast<double>(c.batch), static_cast<double>(c.hidden),
          static_cast<double>(c.heads), static_cast<double>(c.ffn()), static_cast<double>(c.tp),
          static_cast<double>(c.bytes_per_element)};
}

double norm_bytes(const ModelConfig& c, double sbh, double sb) {
  const double p = static_cast<double>(c.bytes_per_element);
  return c.norm == Norm::kRmsNorm ? 4 * sbh + 4 * sb + p * sbh : p * sbh + 8 * sb;
}

ActivationBytes llama_activation_bytes(const ModelConfig& c) {
  const auto [s, b, h, a, f, t, p] = sizes_of(c);
  const double g = static_cast<double>(c.kv());
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
  const auto [s, b, h, a, f, t, p] = sizes_of(c);
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

}  // namespace

// Note [Megatron family]
// Megatron-core's GPTModel with its local layer spec (get_gpt_layer_local_spec:
// LayerNorm, the unfused DotProductAttention, a GELU MLP with biases, learned
// positions, the output layer tied to the embedding) counted per storage as
// saved-tensor hooks see it in eager PyTorch (measured with a pack hook on
// megatron-core 0.16.1; python/tests/test_integrations_megatron.py checks
// the count on CPU within 2%). p = bytes_per_element, w = attention width,
// ss = a s^2 b. Per layer, by the module whose forward saves it (the names of
// Megatron's --offload-modules, MegatronLayerSaves):
//   attn_norm: the input LayerNorm's input p sbh;
//   qkv_linear: its output, the QKV projection's input p sbh;
//   core_attn: the QKV output, one storage the scores and the context read
//     (q, k and v are views of it) 3p sbw; the softmax output, fp32 when p = 2
//     (attention_softmax_in_fp32) 4 ss, and without dropout at p = 2 its cast
//     to p, which the context product reads, p ss; with dropout a bool mask
//     and the dropped copy (1 + p) ss instead of the cast. FlashAttention
//     (Transformer Engine's fused attention) keeps the fp32 log-sum-exp
//     4 a s b instead of the scores; selective recompute keeps neither;
//   attn_proj: the output projection's input p sbw;
//   mlp_norm: the pre-MLP LayerNorm's input p sbh;
//   the rest (no offload module takes it): both LayerNorms' fp32 row
//     statistics 16 sb (Megatron's offloading leaves them: far below its
//     min_offloaded_tensor_size), the pre-MLP LayerNorm's output p sbh, the
//     GELU input and output 2p sbf, with dropout the two bias-dropout-add
//     masks 2 sbh.
// LayerNorm terms are split by TP only with sequence parallelism; the
// others by TP. Full recompute keeps the layer input, p sbh.
// Outside the layers: int64 token and position ids 16 sb, the bool attention
// mask b s^2 (GPTDataset's per-sample causal masks), with dropout the
// embedding dropout mask sbh, the final LayerNorm's input, statistics and
// output (the output layer's input) 2p sbh + 8 sb. Logits: the vocab-parallel
// cross entropy's fp32 softmax 4 sbV/t, its bool target mask sb and int64
// masked targets 8 sb. On CPU dropout masks are in the activation dtype and
// LayerNorm statistics in the input dtype: fp32 without dropout saves the
// same on CPU as on a GPU.
MegatronLayerSaves megatron_layer_saves(const ModelConfig& c) {
  validate(c);
  EBB_CHECK(c.family == Family::kMegatron, "Megatron's offload modules are modelled for family megatron (got ",
            to_string(c.family), ")");
  const auto [s, b, h, a, f, t, p] = sizes_of(c);
  const double sb = s * b;
  const double sbh = sb * h;
  const double sbw = sb * static_cast<double>(c.attention_width());
  const double ss = a * s * s * b;
  const double sp_div = c.sp ? t : 1.0;
  constexpr double kFp32 = 4.0;
  constexpr double kMask = 1.0;
  double core = 0;
  if (c.recompute != Recompute::kSelective) {
    core = c.flash_attn ? kFp32 * a * sb
                        : kFp32 * ss + (c.dropout ? (kMask + p) * ss : (p < kFp32 ? p * ss : 0.0));
  }
  MegatronLayerSaves out;
  out.attn_norm = p * sbh / sp_div;
  out.qkv_linear = p * sbh / sp_div;
  out.core_attn = (3 * p * sbw + core) / t;
  out.attn_proj = p * sbw / t;
  out.mlp_norm = p * sbh / sp_div;
  out.rest = (2 * 2 * kFp32 * sb + p * sbh + (c.dropout ? 2 * kMask * sbh : 0.0)) / sp_div + 2 * p * sb * f / t;
  return out;
}

namespace {

ActivationBytes megatron_activation_bytes(const ModelConfig& c) {
  const auto [s, b, h, a, f, t, p] = sizes_of(c);
  const double sb = s * b;
  const double sbh = sb * h;
  const double sp_div = c.sp ? t : 1.0;
  constexpr double kFp32 = 4.0;
  constexpr double kInt64 = 8.0;
  constexpr double kMask = 1.0;
  ActivationBytes out;
  out.self_layer = c.recompute == Recompute::kFull ? p * sbh / sp_div : megatron_layer_saves(c).total();
  out.per_step = static_cast<double>(c.layers) * out.self_layer;
  out.last_layer = out.self_layer;
  out.outside = 2 * kInt64 * sb + b * s * s + ((c.dropout ? kMask * sbh : 0.0) + 2 * p * sbh + 2 * kFp32 * sb) / sp_div;
  out.logits = kFp32 * sb * static_cast<double>(c.vocab) / t + kMask * sb + kInt64 * sb;
  return out;
}

ActivationBytes stack_activation_bytes(const ModelConfig& c) {
  const auto [s, b, h, a, f, t, p] = sizes_of(c);
  const double sbh = s * b * h;
  const double sbw = s * b * static_cast<double>(c.attention_width());
  const double sp_div = c.sp ? t : 1.0;
  const double kMask = 1.0;  // dropout masks are bool/uint8
  const double kLse = 4.0;   // FlashAttention's log-sum-exp is fp32

  const double attention_core = c.recompute == Recompute::kSelective ? 0.0
                                : c.flash_attn                       ? kLse * a * s * b / t
                                                                     : (2 * p + kMask) * a * s * s * b / t;

  ActivationBytes out;
  if (c.recompute == Recompute::kFull) {
    out.self_layer = p * sbh / sp_div;
    out.cross_layer = c.cross_layers() > 0 ? p * sbh / sp_div : 0.0;
  } else {
    const double replicated = (4 * p + 2 * kMask) * sbh;
    const double sharded = 4 * p * sbw + 2 * p * f / h * sbh;
    out.self_layer = replicated / sp_div + sharded / t + attention_core;
    if (c.cross_layers() > 0) {
      const double x_replicated = (2 * p + kMask) * sbh;
      const double x_sharded = 4 * p * sbw;
      out.cross_layer = out.self_layer + x_replicated / sp_div + x_sharded / t + attention_core;
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
  ActivationBytes out = c.family == Family::kLlama      ? llama_activation_bytes(c)
                        : c.family == Family::kT5       ? t5_activation_bytes(c)
                        : c.family == Family::kMegatron ? megatron_activation_bytes(c)
                                                        : stack_activation_bytes(c);
  if (c.recompute == Recompute::kFull) {
    // The layer being differentiated is rebuilt whole, beside the checkpoints.
    ModelConfig kept = c;
    kept.recompute = Recompute::kNone;
    out.recompute_layer = activation_bytes(kept).largest_layer();
  }
  return out;
}

}  // namespace ebbtide::plan
