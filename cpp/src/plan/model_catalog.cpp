// The catalogs: published model shapes (Note [Model catalog]), GPUs and SSDs
// (Note [Catalog sources]), and lookup by name.
#include "ebbtide/plan/model.hpp"

#include "ebbtide/util/error.hpp"
#include "model_impl.hpp"

namespace ebbtide::plan {

namespace {

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
  ModelConfig c = llama_shape(layers, d_model, heads, 0, d_ff, 32128);  // kv_heads is llama's alone
  c.family = Family::kT5;
  c.arch = Arch::kEncoderDecoder;
  c.decoder_layers = layers;
  c.head_dim = d_kv;
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

}  // namespace ebbtide::plan
