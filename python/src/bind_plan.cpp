// Performance model and offload planner (cpp/include/ebbtide/plan). Plain
// dicts in and out; ebbtide/model.py and ebbtide/planner.py shape the API.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bind.hpp"
#include "ebbtide/plan/model.hpp"
#include "ebbtide/plan/planner.hpp"
#include "ebbtide/util/error.hpp"

namespace nb = nanobind;
using namespace ebbtide::plan;

namespace {

constexpr const char* kConfigKeys =
    "layers, hidden, heads, seq, batch, vocab, ffn_hidden, arch, decoder_layers, flash_attn, tp, "
    "sp, recompute, bytes_per_element, dtype, family, kv_heads, gated_mlp, norm, bias, qkv_bias, dropout, "
    "rotary, tied_embeddings, experts, top_k, expert_ffn_hidden, norm_topk, shared_expert_ffn_hidden";

bool to_bool(nb::handle v, const std::string& key) {
  if (!PyBool_Check(v.ptr()) && !PyLong_Check(v.ptr()))
    throw ebbtide::InvalidArgument("model setting '" + key + "' must be true or false, got " +
                                   nb::cast<std::string>(nb::repr(v)));
  return PyObject_IsTrue(v.ptr()) == 1;
}

int64_t to_int(nb::handle v, const std::string& key) {
  if (PyBool_Check(v.ptr()) || !PyLong_Check(v.ptr()))
    throw ebbtide::InvalidArgument("model setting '" + key + "' must be an integer, got " +
                                   nb::cast<std::string>(nb::repr(v)));
  return nb::cast<int64_t>(v);
}

double to_double(nb::handle v, const std::string& key) {
  if (PyBool_Check(v.ptr()) || !(PyLong_Check(v.ptr()) || PyFloat_Check(v.ptr())))
    throw ebbtide::InvalidArgument("setting '" + key + "' must be a number, got " +
                                   nb::cast<std::string>(nb::repr(v)));
  return nb::cast<double>(v);
}

std::string to_str(nb::handle v, const std::string& key) {
  if (!PyUnicode_Check(v.ptr()))
    throw ebbtide::InvalidArgument("model setting '" + key + "' must be a string, got " +
                                   nb::cast<std::string>(nb::repr(v)));
  return nb::cast<std::string>(v);
}

ModelConfig config_from(const nb::dict& d) {
  ModelConfig c;
  for (auto [k, v] : d) {
    const std::string key = nb::cast<std::string>(nb::str(k));
    if (v.is_none()) continue;  // "use the default"
    if (key == "layers") c.layers = to_int(v, key);
    else if (key == "hidden") c.hidden = to_int(v, key);
    else if (key == "heads") c.heads = to_int(v, key);
    else if (key == "seq") c.seq = to_int(v, key);
    else if (key == "batch") c.batch = to_int(v, key);
    else if (key == "vocab") c.vocab = to_int(v, key);
    else if (key == "ffn_hidden") c.ffn_hidden = to_int(v, key);
    else if (key == "decoder_layers") c.decoder_layers = to_int(v, key);
    else if (key == "tp") c.tp = to_int(v, key);
    else if (key == "bytes_per_element") c.bytes_per_element = to_int(v, key);
    else if (key == "flash_attn") c.flash_attn = PyObject_IsTrue(v.ptr()) == 1;
    else if (key == "sp") c.sp = PyObject_IsTrue(v.ptr()) == 1;
    else if (key == "arch") c.arch = parse_arch(to_str(v, key));
    else if (key == "recompute") c.recompute = parse_recompute(to_str(v, key));
    else if (key == "dtype") c.bytes_per_element = parse_dtype_bytes(to_str(v, key));
    else if (key == "family") c.family = parse_family(to_str(v, key));
    else if (key == "norm") c.norm = parse_norm(to_str(v, key));
    else if (key == "kv_heads") c.kv_heads = to_int(v, key);
    else if (key == "experts") c.experts = to_int(v, key);
    else if (key == "top_k") c.top_k = to_int(v, key);
    else if (key == "expert_ffn_hidden") c.expert_ffn_hidden = to_int(v, key);
    else if (key == "shared_expert_ffn_hidden") c.shared_expert_ffn_hidden = to_int(v, key);
    else if (key == "norm_topk") c.norm_topk = to_bool(v, key);
    else if (key == "gated_mlp") c.gated_mlp = to_bool(v, key);
    else if (key == "bias") c.bias = to_bool(v, key);
    else if (key == "qkv_bias") c.qkv_bias = to_bool(v, key);
    else if (key == "dropout") c.dropout = to_bool(v, key);
    else if (key == "rotary") c.rotary = to_bool(v, key);
    else if (key == "tied_embeddings") c.tied_embeddings = to_bool(v, key);
    else
      throw ebbtide::InvalidArgument("unknown model setting '" + key + "' (valid: " + kConfigKeys + ")");
  }
  validate(c);
  return c;
}

nb::dict config_dict(const ModelConfig& c) {
  nb::dict d;
  d["layers"] = c.layers;
  d["hidden"] = c.hidden;
  d["heads"] = c.heads;
  d["seq"] = c.seq;
  d["batch"] = c.batch;
  d["vocab"] = c.vocab;
  d["ffn_hidden"] = c.ffn();
  d["arch"] = to_string(c.arch);
  d["decoder_layers"] = c.cross_layers();
  d["flash_attn"] = c.flash_attn;
  d["tp"] = c.tp;
  d["sp"] = c.sp;
  d["recompute"] = to_string(c.recompute);
  d["bytes_per_element"] = c.bytes_per_element;
  d["family"] = to_string(c.family);
  if (c.family == Family::kLlama) {
    d["kv_heads"] = c.kv();
    d["gated_mlp"] = c.gated_mlp;
    d["norm"] = to_string(c.norm);
    d["bias"] = c.bias;
    d["qkv_bias"] = c.qkv_bias;
    d["dropout"] = c.dropout;
    d["rotary"] = c.rotary;
    d["tied_embeddings"] = c.tied_embeddings;
    d["experts"] = c.experts;
    d["top_k"] = c.top_k;
    d["expert_ffn_hidden"] = c.experts > 0 ? c.expert_ffn() : 0;
    d["norm_topk"] = c.norm_topk;
    d["shared_expert_ffn_hidden"] = c.shared_expert_ffn_hidden;
  }
  return d;
}

// A catalog shape: the llama-family keys only (seq, batch, dtype are the caller's).
nb::dict model_spec_dict(const ModelSpec& m) {
  nb::dict d;
  d["name"] = m.name;
  d["description"] = m.description;
  const ModelConfig& c = m.config;
  d["family"] = to_string(c.family);
  d["layers"] = c.layers;
  d["hidden"] = c.hidden;
  d["heads"] = c.heads;
  d["kv_heads"] = c.kv();
  d["ffn_hidden"] = c.ffn();
  d["vocab"] = c.vocab;
  d["qkv_bias"] = c.qkv_bias;
  d["tied_embeddings"] = c.tied_embeddings;
  d["experts"] = c.experts;
  d["top_k"] = c.top_k;
  return d;
}

nb::dict activation_dict(const ActivationBytes& a) {
  nb::dict d;
  d["self_layer"] = a.self_layer;
  d["cross_layer"] = a.cross_layer;
  d["shared"] = a.shared;
  d["per_layer"] = a.largest_layer();
  d["per_step"] = a.per_step;
  d["last_layer"] = a.last_layer;
  d["logits"] = a.logits;
  d["outside"] = a.outside;
  return d;
}

nb::dict gpu_dict(const GpuSpec& g) {
  nb::dict d;
  d["name"] = g.name;
  d["description"] = g.description;
  d["peak_bf16_tflops"] = g.peak_bf16_tflops;
  d["peak_tf32_tflops"] = g.peak_tf32_tflops;
  d["memory_gb"] = g.memory_gb;
  d["pcie_gbps"] = g.pcie_gbps;
  return d;
}

nb::dict ssd_dict(const SsdSpec& s) {
  nb::dict d;
  d["name"] = s.name;
  d["description"] = s.description;
  d["capacity_tb"] = s.capacity_tb;
  d["dwpd"] = s.dwpd;
  d["warranty_years"] = s.warranty_years;
  d["pbw"] = s.pbw;
  d["seq_write_gbps"] = s.seq_write_gbps;
  d["seq_read_gbps"] = s.seq_read_gbps;
  return d;
}

nb::dict report_dict(const PlanReport& r) {
  nb::dict d;
  d["config"] = config_dict(r.config);
  d["gpu"] = r.gpu.name;
  d["ssd"] = r.ssd.name;
  d["ssds"] = r.options.ssds;
  d["mfu"] = r.options.mfu;
  d["write_amplification"] = r.options.write_amplification;
  d["params"] = r.params;
  d["model_state_bytes"] = r.model_state_bytes;
  d["activation_bytes_per_layer"] = r.activations.largest_layer();
  d["activation_bytes_self_layer"] = r.activations.self_layer;
  d["activation_bytes_cross_layer"] = r.activations.cross_layer;
  d["activation_bytes_shared"] = r.activations.shared;
  d["activation_bytes_per_step"] = r.activations.per_step;
  d["logits_bytes"] = r.activations.logits;
  d["outside_layers_bytes"] = r.activations.outside;
  d["offloaded_bytes_per_step"] = r.offloaded_bytes_per_step;
  d["resident_bytes_with_offload"] = r.resident_bytes_offloaded;
  d["flops_forward"] = r.flops.forward;
  d["flops_step"] = r.flops.step;
  d["flops_per_layer"] = r.flops.cross_layer > r.flops.self_layer ? r.flops.cross_layer : r.flops.self_layer;
  d["forward_seconds"] = r.forward_seconds;
  d["step_seconds"] = r.step_seconds;
  d["required_write_gbps"] = r.required_write_gbps;
  d["ssd_write_gbps"] = r.ssd_write_gbps;
  d["ssd_read_gbps"] = r.ssd_read_gbps;
  d["pcie_gbps"] = r.gpu.pcie_gbps;
  d["write_gbps_available"] = r.write_gbps_available;
  d["bandwidth_sufficient"] = r.bandwidth_sufficient;
  d["step_seconds_with_offload"] = r.step_seconds_with_offload;
  d["bytes_written_per_second"] = r.bytes_written_per_second;
  d["ssd_lifetime_years"] = r.ssd_lifetime_years;
  d["ssd_capacity_bytes"] = r.ssd_capacity_bytes;
  d["gpu_memory_bytes"] = r.gpu_memory_bytes;
  d["max_micro_batch"] = r.max_micro_batch;
  d["max_micro_batch_without_offload"] = r.max_micro_batch_without_offload;
  return d;
}

PlannerOptions planner_options_from(const nb::dict& d) {
  PlannerOptions o;
  for (auto [k, v] : d) {
    const std::string key = nb::cast<std::string>(nb::str(k));
    if (v.is_none()) continue;
    if (key == "write_bps") o.write_bps = to_double(v, key);
    else if (key == "read_bps") o.read_bps = to_double(v, key);
    else if (key == "max_write_bps") o.max_write_bps = to_double(v, key);
    else if (key == "host_budget_bytes") o.host_budget_bytes = static_cast<uint64_t>(std::max<int64_t>(0, to_int(v, key)));
    else if (key == "host_write_bps") o.host_write_bps = to_double(v, key);
    else if (key == "host_read_bps") o.host_read_bps = to_double(v, key);
    else if (key == "keep_last_modules") o.keep_last_modules = to_int(v, key);
    else if (key == "backward_factor") o.backward_factor = to_double(v, key);
    else if (key == "prefetch_modules") o.prefetch_modules = to_int(v, key);
    else if (key == "stall_tolerance_seconds") o.stall_tolerance_seconds = to_double(v, key);
    else if (key == "replan_fraction") o.replan_fraction = to_double(v, key);
    else if (key == "writes_within_forward") o.writes_within_forward = to_int(v, key) != 0;
    else
      throw ebbtide::InvalidArgument(
          "unknown planner setting '" + key +
          "' (valid: write_bps, read_bps, max_write_bps, host_budget_bytes, host_write_bps, "
          "host_read_bps, keep_last_modules, backward_factor, prefetch_modules, "
          "stall_tolerance_seconds, replan_fraction, writes_within_forward)");
  }
  return o;
}

nb::dict plan_dict(const Plan& p) {
  nb::list modules;
  for (const auto& m : p.modules) {
    nb::dict d;
    d["name"] = m.name;
    d["placement"] = to_string(m.placement);
    d["bytes"] = m.bytes;
    d["forward_end_seconds"] = m.forward_end_seconds;
    d["write_done_seconds"] = m.write_done_seconds;
    d["read_start_seconds"] = m.read_start_seconds;
    d["backward_start_seconds"] = m.backward_start_seconds;
    modules.append(d);
  }
  nb::dict d;
  d["modules"] = modules;
  d["forward_seconds"] = p.forward_seconds;
  d["backward_seconds"] = p.backward_seconds;
  d["predicted_stall_seconds"] = p.predicted_stall_seconds;
  d["all_resident_bytes"] = p.all_resident_bytes;
  d["peak_resident_bytes"] = p.peak_resident_bytes;
  d["peak_resident_fraction"] = p.peak_resident_fraction();
  d["bytes_keep"] = p.bytes_keep;
  d["bytes_cpu"] = p.bytes_cpu;
  d["bytes_ssd"] = p.bytes_ssd;
  d["planned_write_bps"] = p.planned_write_bps;
  d["planned_read_bps"] = p.planned_read_bps;
  d["replan_fraction"] = p.replan_fraction;
  return d;
}

std::vector<ModuleProfile> modules_from(const nb::list& items) {
  std::vector<ModuleProfile> out;
  size_t i = 0;
  for (nb::handle item : items) {
    if (!PyDict_Check(item.ptr()))
      throw ebbtide::InvalidArgument("module " + std::to_string(i) +
                                     " must be a dict with name, forward_seconds, bytes");
    nb::dict d = nb::borrow<nb::dict>(item);
    ModuleProfile m;
    m.name = d.contains("name") ? nb::cast<std::string>(nb::str(d["name"])) : "module" + std::to_string(i);
    for (const char* key : {"forward_seconds", "bytes"})
      if (!d.contains(key))
        throw ebbtide::InvalidArgument("module " + std::to_string(i) + " ('" + m.name + "') lacks '" + key + "'");
    m.forward_seconds = to_double(d["forward_seconds"], "forward_seconds");
    const int64_t bytes = to_int(d["bytes"], "bytes");
    if (bytes < 0)
      throw ebbtide::InvalidArgument("module " + std::to_string(i) + " ('" + m.name + "'): bytes must be >= 0");
    m.bytes = static_cast<uint64_t>(bytes);
    out.push_back(std::move(m));
    ++i;
  }
  return out;
}

}  // namespace

void ebbtide::py::bind_plan(nb::module_& m) {
  m.def("plan_normalize_config", [](const nb::dict& d) { return config_dict(config_from(d)); },
        "Validates a model-config dict and fills the defaults.");
  m.def("plan_activation_bytes", [](const nb::dict& d) { return activation_dict(activation_bytes(config_from(d))); },
        "Activation bytes per layer and per step for a model-config dict.");
  m.def("plan_flops", [](const nb::dict& d) {
    const Flops f = flops(config_from(d));
    nb::dict out;
    out["self_layer"] = f.self_layer;
    out["cross_layer"] = f.cross_layer;
    out["logits"] = f.logits;
    out["forward"] = f.forward;
    out["recompute"] = f.recompute;
    out["step"] = f.step;
    return out;
  });
  m.def("plan_parameter_count", [](const nb::dict& d) { return parameter_count(config_from(d)); });
  m.def("plan_gpus", [] {
    nb::list l;
    for (const auto& g : gpu_catalog()) l.append(gpu_dict(g));
    return l;
  });
  m.def("plan_models", [] {
    nb::list l;
    for (const auto& s : model_catalog()) l.append(model_spec_dict(s));
    return l;
  });
  m.def("plan_ssds", [] {
    nb::list l;
    for (const auto& s : ssd_catalog()) l.append(ssd_dict(s));
    return l;
  });
  m.def("plan_report",
        [](const nb::dict& config, const std::string& gpu, const std::string& ssd, int64_t ssds,
           double mfu, double write_amplification) {
          PlanOptions o;
          o.ssds = ssds;
          o.mfu = mfu;
          o.write_amplification = write_amplification;
          return report_dict(make_plan(config_from(config), find_gpu(gpu), find_ssd(ssd), o));
        },
        nb::arg("config"), nb::arg("gpu"), nb::arg("ssd"), nb::arg("ssds") = 1, nb::arg("mfu") = 0.5,
        nb::arg("write_amplification") = 1.0);
  m.def("plan_offload",
        [](const nb::list& modules, const nb::dict& options) {
          return plan_dict(plan_offload(modules_from(modules), planner_options_from(options)));
        },
        nb::arg("modules"), nb::arg("options"));
  m.def("plan_needs_replan",
        [](uint64_t bytes_ssd, double planned_write_bps, double replan_fraction, double measured) {
          Plan p;
          p.bytes_ssd = bytes_ssd;
          p.planned_write_bps = planned_write_bps;
          p.replan_fraction = replan_fraction;
          return p.needs_replan(measured);
        },
        nb::arg("bytes_ssd"), nb::arg("planned_write_bps"), nb::arg("replan_fraction"),
        nb::arg("measured_write_bps"));
}
