// Performance model: activation bytes per transformer layer, FLOPs and step
// time on a GPU, the SSD write bandwidth offloading needs, SSD lifetime and the
// largest micro-batch that fits. Pure arithmetic, no I/O; every formula and its
// source is in docs/model.md (Note [Activation bytes] in model_activations.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ebbtide/plan/cluster.hpp"

namespace ebbtide::plan {

enum class Arch { kDecoder, kEncoder, kEncoderDecoder };
enum class Recompute { kNone, kSelective, kFull };
// Layer family (Note [Layer families] in model_activations.cpp): kGpt2 counts what
// Megatron-LM's fused kernels save (Korthikanti et al.); kLlama counts what
// the Hugging Face Llama/Qwen2/Mistral/Mixtral layers save in PyTorch eager;
// kT5 what the Hugging Face T5 blocks save (Note [T5 family]); kMegatron what
// Megatron-core's GPTModel with its local layer spec saves in PyTorch eager
// (Note [Megatron family]).
enum class Family { kGpt2, kLlama, kT5, kMegatron };
enum class Norm { kLayerNorm, kRmsNorm };

// One transformer stack. Zero in ffn_hidden means 4*hidden; zero in
// decoder_layers means `layers` (encoder-decoder only: `layers` counts the
// encoder layers). bytes_per_element is the activation dtype size (2 or 4).
// The llama family is a decoder: kv_heads (0: heads) for grouped-query
// attention, a gated (SwiGLU, three matrices) or plain MLP, RMSNorm or
// LayerNorm, biases, attention dropout, rotary embeddings, and a mixture of
// experts when experts > 0 (top_k routed experts per token, each
// expert_ffn_hidden wide, 0: ffn_hidden). flash_attn false is eager attention.
// head_dim is the width of one attention head (0: hidden/heads); q, k, v and
// the output projection's input are heads*head_dim wide (T5: d_kv). The t5
// family is an encoder-decoder without biases, RMSNorm, relative position
// biases, a ReLU MLP (gated_mlp: gated GELU), dropout and tied_embeddings.
struct ModelConfig {
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t seq = 0;
  int64_t batch = 1;
  int64_t vocab = 50257;
  int64_t ffn_hidden = 0;
  Arch arch = Arch::kDecoder;
  int64_t decoder_layers = 0;
  bool flash_attn = true;
  int64_t tp = 1;
  bool sp = false;
  Recompute recompute = Recompute::kNone;
  int64_t bytes_per_element = 2;
  Family family = Family::kGpt2;
  int64_t kv_heads = 0;
  bool gated_mlp = true;         // llama family; t5: gated GELU (T5 v1.1) instead of ReLU
  Norm norm = Norm::kRmsNorm;    // llama family only
  bool bias = false;             // llama family: q/k/v/o and MLP biases (parameters only)
  bool qkv_bias = false;         // llama family: biases on q, k, v only (Qwen2)
  bool dropout = false;          // llama family: attention dropout; t5: dropout_rate > 0; megatron: hidden and attention dropout
  bool rotary = true;            // llama family
  bool tied_embeddings = false;  // llama, t5 family: LM head shares the embedding
  int64_t experts = 0;
  int64_t top_k = 0;
  int64_t expert_ffn_hidden = 0;
  bool norm_topk = true;                // renormalise the top-k router weights (Mixtral)
  int64_t shared_expert_ffn_hidden = 0; // Qwen2-MoE: a gated shared expert of this width (0: none)
  int64_t head_dim = 0;                 // 0: hidden / heads

  int64_t ffn() const { return ffn_hidden > 0 ? ffn_hidden : 4 * hidden; }
  int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t expert_ffn() const { return expert_ffn_hidden > 0 ? expert_ffn_hidden : ffn(); }
  int64_t head_size() const { return head_dim > 0 ? head_dim : (heads > 0 ? hidden / heads : 0); }
  int64_t attention_width() const { return heads * head_size(); }  // q/k/v width, all heads
  int64_t self_only_layers() const;  // layers in the self-attention-only stack
  int64_t cross_layers() const;    // decoder layers with cross-attention (enc-dec)
};

// Throws InvalidArgument naming the setting and the valid choices: sizes
// positive, heads divides hidden (unless head_dim is set), tp divides heads,
// bytes_per_element 2 or 4, family settings on their family.
void validate(const ModelConfig& config);

// `config` with the derived defaults written out: ffn_hidden as used,
// decoder_layers the number of cross-attention layers (0 unless
// encoder-decoder), head_dim as used and, for the llama family, kv_heads and expert_ffn_hidden
// (0 without experts) as used. Valid and computing the same as `config`.
ModelConfig normalized(const ModelConfig& config);

// Names accepted by the CLI and Python ("decoder", "encoder",
// "encoder-decoder"/"encoder_decoder"; "gpt2", "llama", "t5", "megatron"; "layernorm",
// "rmsnorm"; "none", "selective", "full"; "bf16", "fp16", "fp32"). Unknown
// names throw InvalidArgument listing them.
Arch parse_arch(std::string_view name);
Family parse_family(std::string_view name);
Norm parse_norm(std::string_view name);
std::string to_string(Family family);
std::string to_string(Norm norm);
Recompute parse_recompute(std::string_view name);
int64_t parse_dtype_bytes(std::string_view name);
std::string to_string(Arch arch);
std::string to_string(Recompute recompute);

// Activation bytes saved for backward, per GPU (tensor parallel rank).
struct ActivationBytes {
  double self_layer = 0;      // one layer with self-attention + MLP
  double cross_layer = 0;     // one enc-dec decoder layer (self + cross + MLP)
  double shared = 0;          // once per step: encoder output read by every cross-attention
  double per_step = 0;        // all layers + shared
  double last_layer = 0;      // the layer kept resident when offloading
  double logits = 0;          // output layer logits (never offloaded); llama family: what the loss saves
  double outside = 0;         // llama/t5/megatron family, once per step: token ids, rotary tables, final norm, LM-head input
  double recompute_layer = 0; // full recompute: the largest layer's activations, rebuilt during its backward
  double largest_layer() const { return cross_layer > self_layer ? cross_layer : self_layer; }
};
ActivationBytes activation_bytes(const ModelConfig& config);

struct Flops {
  double self_layer = 0;   // forward FLOPs of one self-attention layer
  double cross_layer = 0;  // forward FLOPs of one enc-dec decoder layer
  double logits = 0;       // output projection 2*b*s*h*V
  double forward = 0;      // whole model, one forward, all GPUs together
  double recompute = 0;    // extra forward work recomputation adds per step
  double step = 0;         // 3 * forward + recompute
  double largest_layer() const { return cross_layer > self_layer ? cross_layer : self_layer; }
};
Flops flops(const ModelConfig& config);

// Parameters of the whole model (all tensor-parallel ranks together).
double parameter_count(const ModelConfig& config);
// The parameters per tensor-parallel rank as FSDP units: one per layer (the
// largest: an encoder-decoder's decoder layer), the rest in the root unit.
ParameterUnits parameter_units(const ModelConfig& config);

struct GpuSpec {
  std::string name;          // catalog key, e.g. "h100-sxm"
  std::string description;
  double peak_bf16_tflops;   // dense, no sparsity
  double peak_tf32_tflops;   // dense, used when bytes_per_element == 4
  double memory_gb;          // 1e9 bytes
  double pcie_gbps;          // host link, one direction, 1e9 bytes/s
};

struct SsdSpec {
  std::string name;  // catalog key, e.g. "d7-p5620"
  std::string description;
  double capacity_tb;       // 1e12 bytes
  double dwpd;              // drive writes per day over the warranty
  double warranty_years;
  double pbw;               // rated endurance, 1e15 bytes written
  double seq_write_gbps;    // 1e9 bytes/s, vendor spec sheet
  double seq_read_gbps;
};

// A published model shape (Note [Model catalog] in model_catalog.cpp); seq, batch,
// dtype and parallelism are the caller's.
struct ModelSpec {
  std::string name;  // catalog key, e.g. "llama3-8b"
  std::string description;
  ModelConfig config;
};

const std::vector<ModelSpec>& model_catalog();
const ModelSpec& find_model(std::string_view name);
const std::vector<GpuSpec>& gpu_catalog();
const std::vector<SsdSpec>& ssd_catalog();
// Case-insensitive lookup; unknown names throw InvalidArgument listing the valid names.
const GpuSpec& find_gpu(std::string_view name);
const SsdSpec& find_ssd(std::string_view name);

struct PlanOptions {
  double mfu = 0.5;                  // hardware FLOPs utilisation, (0, 1]
  int64_t ssds = 1;                  // drives per GPU, striped
  double write_amplification = 1.0;  // >= 1; large sequential writes ~1.0
  ShardingOptions sharding;          // data parallelism, ZeRO stage / FSDP, bytes per parameter
};

// Everything `ebbtide plan` prints. Bytes are per GPU; rates in 1e9 bytes/s.
struct PlanReport {
  ModelConfig config;
  GpuSpec gpu;
  SsdSpec ssd;
  PlanOptions options;
  double params = 0;
  double model_state_bytes = 0;         // model_state.total: per GPU under options.sharding
  ParameterUnits units;                 // per tensor-parallel rank
  ModelStateBytes model_state;
  ActivationBytes activations;
  double offloaded_bytes_per_step = 0;  // per_step - last layer - shared
  double resident_bytes_offloaded = 0;  // last layer + shared + logits + outside + recompute_layer
  Flops flops;
  double forward_seconds = 0;
  double step_seconds = 0;
  double required_write_gbps = 0;       // offloaded / (step / 2)
  double ssd_write_gbps = 0;            // all drives together
  double ssd_read_gbps = 0;
  double write_gbps_available = 0;      // min(drives, PCIe)
  bool bandwidth_sufficient = false;
  double step_seconds_with_offload = 0; // step stretched when writes cannot keep up
  double bytes_written_per_second = 0;  // with write amplification
  double ssd_lifetime_years = 0;        // rated endurance of all drives / write rate
  double ssd_capacity_bytes = 0;        // all drives
  double gpu_memory_bytes = 0;
  int64_t max_micro_batch = 0;          // offloading all but the last layer
  int64_t max_micro_batch_without_offload = 0;
};

// Throws InvalidArgument on a bad config or option (naming it).
PlanReport make_plan(const ModelConfig& config, const GpuSpec& gpu, const SsdSpec& ssd,
                     const PlanOptions& options);

// The data-parallel collectives of one step of `report` on `network` (Note
// [Collective time] in model_plan.cpp): per-layer all-gather / reduce-scatter
// under stage 3, the gradient all-reduce otherwise, and what of them the
// compute does not hide.
CommTimes communication(const PlanReport& report, const NetworkSpec& network);

}  // namespace ebbtide::plan
