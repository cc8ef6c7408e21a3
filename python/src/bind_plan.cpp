// Performance model and offload planner (cpp/include/ebbtide/plan) as classes:
// the inputs (ModelConfig, PlannerOptions, ModuleProfile) with writable
// fields, the results with read-only ones. ebbtide/_records.py fills inputs
// from settings and turns results into the dicts ebbtide/plan/model.py and
// ebbtide/plan/planner.py return.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "bind.hpp"
#include "ebbtide/plan/budget.hpp"
#include "ebbtide/plan/megatron.hpp"
#include "ebbtide/plan/model.hpp"
#include "ebbtide/plan/planner.hpp"

namespace nb = nanobind;

// No file-scope using-directive (Note [Unity build] in CMakeLists.txt).
namespace ebbtide::plan {
namespace {

nb::tuple as_tuple(nb::handle list) { return nb::steal<nb::tuple>(PyList_AsTuple(list.ptr())); }

// Binds T, listing its fields in binding order as `_fields` (an instance
// property: a field given `shown` is listed only where shown() holds) and
// the writable ones as the class attribute `_settings`, once the chain of
// calls on a temporary Record ends.
template <class T>
class Record {
 public:
  using Shown = bool (*)(const T&);

  Record(nb::module_& m, const char* name, const char* doc) : cls_(m, name, doc) {}

  Record& init() {
    cls_.def(nb::init<>());
    return *this;
  }
  template <class V>
  Record& ro(const char* name, V T::*member) {
    cls_.def_ro(name, member);
    return field(name, nullptr);
  }
  // A field of a member: `name` reads t.*outer.*inner.
  template <class S, class V>
  Record& ro(const char* name, S T::*outer, V S::*inner) {
    cls_.def_prop_ro(name, [outer, inner](const T& t) { return t.*outer.*inner; });
    return field(name, nullptr);
  }
  template <class Get>
  Record& prop(const char* name, Get get) {
    cls_.def_prop_ro(name, std::move(get));
    return field(name, nullptr);
  }
  template <class V>
  Record& rw(const char* name, V T::*member, Shown shown = nullptr) {
    cls_.def_rw(name, member);
    settings_.push_back(name);
    return field(name, shown);
  }
  // A field converted on the way in and out (`get(t)`, `set(t, value)`).
  template <class Get, class Set>
  Record& rw_prop(const char* name, Get get, Set set) {
    cls_.def_prop_rw(name, std::move(get), std::move(set));
    settings_.push_back(name);
    return field(name, nullptr);
  }
  // An enum field, read and written by name (`parse` throws InvalidArgument).
  template <class E>
  Record& rw_named(const char* name, E T::*member, E (*parse)(std::string_view), std::string (*str)(E),
                   Shown shown = nullptr) {
    cls_.def_prop_rw(
        name, [member, str](const T& t) { return str(t.*member); },
        [member, parse](T& t, const std::string& v) { t.*member = parse(v); });
    settings_.push_back(name);
    return field(name, shown);
  }
  template <class... Args>
  Record& def(Args&&... args) {
    cls_.def(std::forward<Args>(args)...);
    return *this;
  }
  ~Record() {
    cls_.attr("_settings") = as_tuple(nb::cast(settings_));
    cls_.def_prop_ro("_fields", [fields = std::move(fields_)](const T& t) {
      nb::list out;
      for (const auto& [name, shown] : fields)
        if (shown == nullptr || shown(t)) out.append(name);
      return as_tuple(out);
    });
  }

 private:
  Record& field(const char* name, Shown shown) {
    fields_.emplace_back(name, shown);
    return *this;
  }

  nb::class_<T> cls_;
  std::vector<std::pair<std::string, Shown>> fields_;
  std::vector<std::string> settings_;
};

bool llama(const ModelConfig& c) { return c.family == Family::kLlama; }
bool llama_or_t5(const ModelConfig& c) { return c.family == Family::kLlama || c.family == Family::kT5; }
bool has_dropout(const ModelConfig& c) { return llama_or_t5(c) || c.family == Family::kMegatron; }

void bind_model_config(nb::module_& m) {
  Record<ModelConfig>(m, "ModelConfig", "A transformer stack (ebbtide::plan::ModelConfig); llama-family fields "
                                         "are listed in _fields for that family only.")
      .init()
      .rw("layers", &ModelConfig::layers)
      .rw("hidden", &ModelConfig::hidden)
      .rw("heads", &ModelConfig::heads)
      .rw("seq", &ModelConfig::seq)
      .rw("batch", &ModelConfig::batch)
      .rw("vocab", &ModelConfig::vocab)
      .rw("ffn_hidden", &ModelConfig::ffn_hidden)
      .rw_named("arch", &ModelConfig::arch, parse_arch, to_string)
      .rw("decoder_layers", &ModelConfig::decoder_layers)
      .rw("flash_attn", &ModelConfig::flash_attn)
      .rw("tp", &ModelConfig::tp)
      .rw("sp", &ModelConfig::sp)
      .rw_named("recompute", &ModelConfig::recompute, parse_recompute, to_string)
      .rw("bytes_per_element", &ModelConfig::bytes_per_element)
      .rw_named("family", &ModelConfig::family, parse_family, to_string)
      .rw("kv_heads", &ModelConfig::kv_heads, llama)
      .rw("gated_mlp", &ModelConfig::gated_mlp, llama_or_t5)
      .rw_named("norm", &ModelConfig::norm, parse_norm, to_string, llama)
      .rw("bias", &ModelConfig::bias, llama)
      .rw("qkv_bias", &ModelConfig::qkv_bias, llama)
      .rw("dropout", &ModelConfig::dropout, has_dropout)
      .rw("rotary", &ModelConfig::rotary, llama)
      .rw("tied_embeddings", &ModelConfig::tied_embeddings, llama_or_t5)
      .rw("experts", &ModelConfig::experts, llama)
      .rw("top_k", &ModelConfig::top_k, llama)
      .rw("expert_ffn_hidden", &ModelConfig::expert_ffn_hidden, llama)
      .rw("norm_topk", &ModelConfig::norm_topk, llama)
      .rw("shared_expert_ffn_hidden", &ModelConfig::shared_expert_ffn_hidden, llama)
      .rw("head_dim", &ModelConfig::head_dim)
      .def("validate", &validate, "Raises ValueError naming a bad setting.")
      .def("normalized", &normalized, "A copy with the derived defaults written out.");
}

void bind_model_results(nb::module_& m) {
  Record<ActivationBytes>(m, "ActivationBytes", "Activation bytes saved for backward, per GPU.")
      .ro("self_layer", &ActivationBytes::self_layer)
      .ro("cross_layer", &ActivationBytes::cross_layer)
      .ro("shared", &ActivationBytes::shared)
      .prop("per_layer", &ActivationBytes::largest_layer)
      .ro("per_step", &ActivationBytes::per_step)
      .ro("last_layer", &ActivationBytes::last_layer)
      .ro("logits", &ActivationBytes::logits)
      .ro("outside", &ActivationBytes::outside)
      .ro("recompute_layer", &ActivationBytes::recompute_layer);
  Record<Flops>(m, "Flops", "Forward FLOPs per layer and per step (all GPUs together).")
      .ro("self_layer", &Flops::self_layer)
      .ro("cross_layer", &Flops::cross_layer)
      .ro("logits", &Flops::logits)
      .ro("forward", &Flops::forward)
      .ro("recompute", &Flops::recompute)
      .ro("step", &Flops::step);
  Record<GpuSpec>(m, "GpuSpec", "A GPU of the catalog.")
      .ro("name", &GpuSpec::name)
      .ro("description", &GpuSpec::description)
      .ro("peak_bf16_tflops", &GpuSpec::peak_bf16_tflops)
      .ro("peak_tf32_tflops", &GpuSpec::peak_tf32_tflops)
      .ro("memory_gb", &GpuSpec::memory_gb)
      .ro("pcie_gbps", &GpuSpec::pcie_gbps);
  Record<SsdSpec>(m, "SsdSpec", "An SSD of the catalog.")
      .ro("name", &SsdSpec::name)
      .ro("description", &SsdSpec::description)
      .ro("capacity_tb", &SsdSpec::capacity_tb)
      .ro("dwpd", &SsdSpec::dwpd)
      .ro("warranty_years", &SsdSpec::warranty_years)
      .ro("pbw", &SsdSpec::pbw)
      .ro("seq_write_gbps", &SsdSpec::seq_write_gbps)
      .ro("seq_read_gbps", &SsdSpec::seq_read_gbps);
  Record<ModelSpec>(m, "ModelSpec", "A published model shape; config is normalized.")
      .ro("name", &ModelSpec::name)
      .ro("description", &ModelSpec::description)
      .prop("config", [](const ModelSpec& s) { return normalized(s.config); });
  Record<ShardingOptions>(m, "ShardingOptions",
                          "Data parallelism and ZeRO / FSDP sharding of model state, bytes per parameter.")
      .init()
      .rw("dp", &ShardingOptions::dp)
      .rw("zero_stage", &ShardingOptions::zero_stage)
      .rw("shard_group", &ShardingOptions::shard_group)
      .rw("param_bytes", &ShardingOptions::param_bytes)
      .rw("grad_bytes", &ShardingOptions::grad_bytes)
      .rw("optimizer_bytes", &ShardingOptions::optimizer_bytes)
      .def("validate", &validate_sharding, "Raises ValueError naming a bad setting.");
  Record<ModelStateBytes>(m, "ModelStateBytes", "Model state per GPU by term, bytes.")
      .ro("shard_over", &ModelStateBytes::shard_over)
      .ro("params_bytes", &ModelStateBytes::params)
      .ro("grads_bytes", &ModelStateBytes::grads)
      .ro("optimizer_bytes", &ModelStateBytes::optimizer)
      .ro("gathered_unit_bytes", &ModelStateBytes::gathered_unit)
      .ro("prefetch_unit_bytes", &ModelStateBytes::prefetch_unit)
      .ro("root_unit_bytes", &ModelStateBytes::root_unit)
      .ro("model_state_bytes", &ModelStateBytes::total);
  Record<OptimizerPreset>(m, "OptimizerPreset", "A named optimizer's bytes per parameter (K).")
      .ro("name", &OptimizerPreset::name)
      .ro("description", &OptimizerPreset::description)
      .ro("optimizer_bytes", &OptimizerPreset::optimizer_bytes);
  Record<NetworkSpec>(m, "NetworkSpec", "A cluster interconnect of the catalog; rates per GPU, 1e9 bytes/s.")
      .ro("name", &NetworkSpec::name)
      .ro("description", &NetworkSpec::description)
      .ro("gpus_per_node", &NetworkSpec::gpus_per_node)
      .ro("intra_gbps", &NetworkSpec::intra_gbps)
      .ro("inter_gbps", &NetworkSpec::inter_gbps)
      .ro("latency_us", &NetworkSpec::latency_us);
  Record<CommTimes>(m, "CommTimes", "Data-parallel collectives of one step, seconds per GPU.")
      .ro("comm_gather_seconds", &CommTimes::gather_seconds)
      .ro("comm_reduce_seconds", &CommTimes::reduce_seconds)
      .ro("unit_forward_seconds", &CommTimes::unit_forward_seconds)
      .ro("unit_backward_seconds", &CommTimes::unit_backward_seconds)
      .ro("comm_seconds", &CommTimes::comm_seconds)
      .ro("comm_exposed_seconds", &CommTimes::exposed_seconds)
      .ro("step_seconds_with_comm", &CommTimes::step_seconds)
      .ro("scaling_efficiency", &CommTimes::scaling_efficiency);
  // The names are the keys of `ebbtide plan --json` (docs/model.md).
  Record<PlanReport>(m, "PlanReport", "Everything `ebbtide plan` reports; bytes per GPU, rates in 1e9 bytes/s.")
      .prop("config", [](const PlanReport& r) { return normalized(r.config); })
      .ro("gpu", &PlanReport::gpu, &GpuSpec::name)
      .ro("ssd", &PlanReport::ssd, &SsdSpec::name)
      .ro("ssds", &PlanReport::options, &PlanOptions::ssds)
      .ro("mfu", &PlanReport::options, &PlanOptions::mfu)
      .ro("write_amplification", &PlanReport::options, &PlanOptions::write_amplification)
      .ro("params", &PlanReport::params)
      .ro("model_state_bytes", &PlanReport::model_state_bytes)
      .prop("activation_bytes_per_layer", [](const PlanReport& r) { return r.activations.largest_layer(); })
      .ro("activation_bytes_self_layer", &PlanReport::activations, &ActivationBytes::self_layer)
      .ro("activation_bytes_cross_layer", &PlanReport::activations, &ActivationBytes::cross_layer)
      .ro("activation_bytes_shared", &PlanReport::activations, &ActivationBytes::shared)
      .ro("activation_bytes_per_step", &PlanReport::activations, &ActivationBytes::per_step)
      .ro("logits_bytes", &PlanReport::activations, &ActivationBytes::logits)
      .ro("outside_layers_bytes", &PlanReport::activations, &ActivationBytes::outside)
      .ro("recomputed_layer_bytes", &PlanReport::activations, &ActivationBytes::recompute_layer)
      .ro("offloaded_bytes_per_step", &PlanReport::offloaded_bytes_per_step)
      .ro("resident_bytes_with_offload", &PlanReport::resident_bytes_offloaded)
      .ro("flops_forward", &PlanReport::flops, &Flops::forward)
      .ro("flops_step", &PlanReport::flops, &Flops::step)
      .prop("flops_per_layer", [](const PlanReport& r) { return r.flops.largest_layer(); })
      .ro("forward_seconds", &PlanReport::forward_seconds)
      .ro("step_seconds", &PlanReport::step_seconds)
      .ro("required_write_gbps", &PlanReport::required_write_gbps)
      .ro("ssd_write_gbps", &PlanReport::ssd_write_gbps)
      .ro("ssd_read_gbps", &PlanReport::ssd_read_gbps)
      .ro("pcie_gbps", &PlanReport::gpu, &GpuSpec::pcie_gbps)
      .ro("write_gbps_available", &PlanReport::write_gbps_available)
      .ro("bandwidth_sufficient", &PlanReport::bandwidth_sufficient)
      .ro("step_seconds_with_offload", &PlanReport::step_seconds_with_offload)
      .ro("bytes_written_per_second", &PlanReport::bytes_written_per_second)
      .ro("ssd_lifetime_years", &PlanReport::ssd_lifetime_years)
      .ro("ssd_capacity_bytes", &PlanReport::ssd_capacity_bytes)
      .ro("gpu_memory_bytes", &PlanReport::gpu_memory_bytes)
      .ro("max_micro_batch", &PlanReport::max_micro_batch)
      .ro("max_micro_batch_without_offload", &PlanReport::max_micro_batch_without_offload)
      .ro("sharding", &PlanReport::options, &PlanOptions::sharding)
      .ro("shard_over", &PlanReport::model_state, &ModelStateBytes::shard_over)
      .ro("params_bytes", &PlanReport::model_state, &ModelStateBytes::params)
      .ro("grads_bytes", &PlanReport::model_state, &ModelStateBytes::grads)
      .ro("optimizer_bytes", &PlanReport::model_state, &ModelStateBytes::optimizer)
      .ro("gathered_unit_bytes", &PlanReport::model_state, &ModelStateBytes::gathered_unit)
      .ro("prefetch_unit_bytes", &PlanReport::model_state, &ModelStateBytes::prefetch_unit)
      .ro("root_unit_bytes", &PlanReport::model_state, &ModelStateBytes::root_unit)
      .ro("layer_params", &PlanReport::units, &ParameterUnits::largest_layer)
      .ro("root_params", &PlanReport::units, &ParameterUnits::root);
}

void bind_planner(nb::module_& m) {
  Record<ModuleProfile>(m, "ModuleProfile", "One module, in forward order: compute time and saved bytes.")
      .init()
      .rw("name", &ModuleProfile::name)
      .rw("forward_seconds", &ModuleProfile::forward_seconds)
      .rw("bytes", &ModuleProfile::bytes)
      .rw("fixed_bytes", &ModuleProfile::fixed_bytes)
      .rw("recomputable", &ModuleProfile::recomputable)
      .rw("recompute_bytes", &ModuleProfile::recompute_bytes)
      .rw("recompute_seconds", &ModuleProfile::recompute_seconds)
      .rw("backward_seconds", &ModuleProfile::backward_seconds)
      .rw("grad_bytes", &ModuleProfile::grad_bytes)
      .rw("forward_temp_bytes", &ModuleProfile::forward_temp_bytes)
      .rw("backward_temp_bytes", &ModuleProfile::backward_temp_bytes)
      // Its saves as a list of (bytes, shared id or -1) pairs.
      .rw_prop(
          "saves",
          [](const ModuleProfile& p) {
            std::vector<std::pair<uint64_t, int64_t>> out;
            for (const auto& s : p.saves) out.emplace_back(s.bytes, s.shared);
            return out;
          },
          [](ModuleProfile& p, const std::vector<std::pair<uint64_t, int64_t>>& v) {
            p.saves.clear();
            for (const auto& [bytes, shared] : v) p.saves.push_back(Save{bytes, shared});
          });
  Record<PlannerOptions>(m, "PlannerOptions", "Measured bandwidths (bytes/s) and planner settings.")
      .init()
      .rw("write_bps", &PlannerOptions::write_bps)
      .rw("read_bps", &PlannerOptions::read_bps)
      .rw("max_write_bps", &PlannerOptions::max_write_bps)
      .rw("host_budget_bytes", &PlannerOptions::host_budget_bytes)
      .rw("host_write_bps", &PlannerOptions::host_write_bps)
      .rw("host_read_bps", &PlannerOptions::host_read_bps)
      .rw("keep_last_modules", &PlannerOptions::keep_last_modules)
      .rw("backward_factor", &PlannerOptions::backward_factor)
      .rw("prefetch_modules", &PlannerOptions::prefetch_modules)
      .rw("stall_tolerance_seconds", &PlannerOptions::stall_tolerance_seconds)
      .rw("replan_fraction", &PlannerOptions::replan_fraction)
      .rw("writes_within_forward", &PlannerOptions::writes_within_forward)
      .rw("guarded_writes", &PlannerOptions::guarded_writes)
      .rw("copy_bound_bytes", &PlannerOptions::copy_bound_bytes)
      .rw("staging_bytes", &PlannerOptions::staging_bytes)
      .rw("partial_offload", &PlannerOptions::partial_offload)
      .rw("activation_budget_bytes", &PlannerOptions::activation_budget_bytes)
      .rw("peak_budget_bytes", &PlannerOptions::peak_budget_bytes)
      .rw("window_bytes", &PlannerOptions::window_bytes)
      .rw("lead_per_module", &PlannerOptions::lead_per_module)
      .rw("kept_in_distance", &PlannerOptions::kept_in_distance)
      .rw("shared_at_last_user", &PlannerOptions::shared_at_last_user)
      .rw("priority_loads", &PlannerOptions::priority_loads);
  Record<ModuleDecision>(m, "ModuleDecision", "Where one module's activations go, and when.")
      .ro("name", &ModuleDecision::name)
      .prop("placement", [](const ModuleDecision& d) { return to_string(d.placement); })
      .prop("tier", [](const ModuleDecision& d) -> nb::object {
        const std::string t = tier_name(d.placement);
        return t.empty() ? nb::none() : nb::cast(t);
      })
      .ro("bytes", &ModuleDecision::bytes)
      .ro("saved_bytes", &ModuleDecision::saved_bytes)
      .ro("fixed_bytes", &ModuleDecision::fixed_bytes)
      .ro("recompute_seconds", &ModuleDecision::recompute_seconds)
      .ro("forward_end_seconds", &ModuleDecision::forward_end_seconds)
      .ro("write_done_seconds", &ModuleDecision::write_done_seconds)
      .ro("read_start_seconds", &ModuleDecision::read_start_seconds)
      .ro("backward_start_seconds", &ModuleDecision::backward_start_seconds)
      .ro("offload_bytes", &ModuleDecision::offload_bytes)
      .ro("lead_bytes", &ModuleDecision::lead_bytes)
      .ro("wait_seconds", &ModuleDecision::wait_seconds)
      .ro("forwarded_bytes", &ModuleDecision::forwarded_bytes)
      .ro("release_bytes", &ModuleDecision::release_bytes);
  Record<Plan>(m, "Plan", "The planner's decisions and the step it predicts.")
      .ro("modules", &Plan::modules)
      .ro("forward_seconds", &Plan::forward_seconds)
      .ro("backward_seconds", &Plan::backward_seconds)
      .ro("predicted_stall_seconds", &Plan::predicted_stall_seconds)
      .ro("forward_wait_seconds", &Plan::forward_wait_seconds)
      .ro("all_resident_bytes", &Plan::all_resident_bytes)
      .ro("peak_resident_bytes", &Plan::peak_resident_bytes)
      .ro("peak_allocated_bytes", &Plan::peak_allocated_bytes)
      .ro("peak_seconds", &Plan::peak_seconds)
      .ro("backward_wait_seconds", &Plan::backward_wait_seconds)
      .ro("window_bytes", &Plan::window_bytes)
      .prop("peak_resident_fraction", &Plan::peak_resident_fraction)
      .ro("bytes_keep", &Plan::bytes_keep)
      .ro("bytes_cpu", &Plan::bytes_cpu)
      .ro("bytes_ssd", &Plan::bytes_ssd)
      .ro("bytes_recomputed", &Plan::bytes_recomputed)
      .ro("modules_recomputed", &Plan::modules_recomputed)
      .ro("recompute_seconds", &Plan::recompute_seconds)
      .prop("predicted_step_seconds", &Plan::predicted_step_seconds)
      .ro("activation_budget_bytes", &Plan::activation_budget_bytes)
      .ro("feasible", &Plan::feasible)
      .ro("min_budget_bytes", &Plan::min_budget_bytes)
      .ro("peak_budget_bytes", &Plan::peak_budget_bytes)
      .ro("min_peak_budget_bytes", &Plan::min_peak_budget_bytes)
      .ro("planned_write_bps", &Plan::planned_write_bps)
      .ro("planned_read_bps", &Plan::planned_read_bps)
      .ro("replan_fraction", &Plan::replan_fraction);
  Record<MegatronLayerSaves>(m, "MegatronLayerSaves",
                             "Bytes one layer saves inside each of Megatron's offload modules.")
      .ro("attn_norm", &MegatronLayerSaves::attn_norm)
      .ro("qkv_linear", &MegatronLayerSaves::qkv_linear)
      .ro("core_attn", &MegatronLayerSaves::core_attn)
      .ro("attn_proj", &MegatronLayerSaves::attn_proj)
      .ro("mlp_norm", &MegatronLayerSaves::mlp_norm)
      .ro("rest", &MegatronLayerSaves::rest)
      .prop("total", &MegatronLayerSaves::total);
  Record<MegatronPlan>(m, "MegatronPlan", "Megatron-core flags for a budget and what they give in the model.")
      .ro("recompute_num_layers", &MegatronPlan::recompute_num_layers)
      .ro("offload_modules", &MegatronPlan::offload_modules)
      .ro("flags", &MegatronPlan::flags)
      .ro("plan", &MegatronPlan::plan)
      .ro("resident_bytes", &MegatronPlan::resident_bytes)
      .ro("offloaded_bytes", &MegatronPlan::offloaded_bytes);
}

}  // namespace
}  // namespace ebbtide::plan

void ebbtide::py::bind_plan(nb::module_& m) {
  using namespace ebbtide::plan;
  bind_model_config(m);
  bind_model_results(m);
  bind_planner(m);
  m.def("plan_dtype_bytes", &parse_dtype_bytes, nb::arg("dtype"));
  m.def("plan_activation_bytes", &activation_bytes, nb::arg("config"));
  m.def("plan_flops", &flops, nb::arg("config"));
  m.def("plan_parameter_count", &parameter_count, nb::arg("config"));
  m.def("plan_gpus", &gpu_catalog);
  m.def("plan_models", &model_catalog);
  m.def("plan_ssds", &ssd_catalog);
  m.def("plan_report",
        [](const ModelConfig& config, const std::string& gpu, const std::string& ssd, int64_t ssds, double mfu,
           double write_amplification, const ShardingOptions& sharding) {
          return make_plan(config, find_gpu(gpu), find_ssd(ssd),
                           PlanOptions{mfu, ssds, write_amplification, sharding});
        },
        nb::arg("config"), nb::arg("gpu"), nb::arg("ssd"), nb::arg("ssds") = 1, nb::arg("mfu") = 0.5,
        nb::arg("write_amplification") = 1.0, nb::arg("sharding") = ShardingOptions{});
  m.def("plan_model_state",
        [](double params, double layer_params, double root_params, const ShardingOptions& sharding) {
          return model_state_bytes(ParameterUnits{params, layer_params, root_params}, sharding);
        },
        nb::arg("params"), nb::arg("layer_params"), nb::arg("root_params"), nb::arg("sharding"));
  m.def("plan_optimizers", &optimizer_presets);
  m.def("plan_networks", &network_catalog);
  m.def("plan_communication",
        [](const ModelConfig& config, const std::string& gpu, const std::string& ssd, int64_t ssds, double mfu,
           const ShardingOptions& sharding, const std::string& network) {
          return communication(make_plan(config, find_gpu(gpu), find_ssd(ssd), PlanOptions{mfu, ssds, 1.0, sharding}),
                               find_network(network));
        },
        nb::arg("config"), nb::arg("gpu"), nb::arg("ssd"), nb::arg("ssds"), nb::arg("mfu"), nb::arg("sharding"),
        nb::arg("network"));
  m.def("plan_find_optimizer", &find_optimizer, nb::arg("name"));
  m.def("plan_offload", &plan_offload, nb::arg("modules"), nb::arg("options"));
  m.def("plan_model_modules", &model_modules, nb::arg("report"));
  m.def("plan_max_micro_batch_budget",
        [](const ModelConfig& config, const std::string& gpu, const std::string& ssd, int64_t ssds, double mfu,
           const ShardingOptions& sharding, uint64_t host_budget) {
          return max_micro_batch_budget(config, find_gpu(gpu), find_ssd(ssd), PlanOptions{mfu, ssds, 1.0, sharding},
                                        host_budget);
        },
        nb::arg("config"), nb::arg("gpu"), nb::arg("ssd"), nb::arg("ssds"), nb::arg("mfu"), nb::arg("sharding"),
        nb::arg("host_budget_bytes") = 0);
  m.def("plan_model_options", &model_planner_options, nb::arg("report"), nb::arg("activation_budget_bytes"),
        nb::arg("host_budget_bytes") = 0);
  m.def("plan_report_budget",
        [](const ModelConfig& config, const std::string& gpu, const std::string& ssd, int64_t ssds, double mfu,
           uint64_t budget, uint64_t host_budget) {
          const PlanReport r = make_plan(config, find_gpu(gpu), find_ssd(ssd), PlanOptions{mfu, ssds, 1.0});
          return plan_budget(model_modules(r), model_planner_options(r, budget, host_budget));
        },
        nb::arg("config"), nb::arg("gpu"), nb::arg("ssd"), nb::arg("ssds"), nb::arg("mfu"),
        nb::arg("activation_budget_bytes"), nb::arg("host_budget_bytes") = 0);
  m.def("plan_budget", &plan_budget, nb::arg("modules"), nb::arg("options"));
  m.def("plan_megatron_layer_saves", &megatron_layer_saves, nb::arg("config"));
  m.def("plan_megatron",
        [](const ModelConfig& config, const std::string& gpu, const std::string& ssd, int64_t ssds, double mfu,
           uint64_t budget, uint64_t host_budget) {
          return plan_megatron(make_plan(config, find_gpu(gpu), find_ssd(ssd), PlanOptions{mfu, ssds, 1.0}), budget,
                               host_budget);
        },
        nb::arg("config"), nb::arg("gpu"), nb::arg("ssd"), nb::arg("ssds"), nb::arg("mfu"),
        nb::arg("activation_budget_bytes"), nb::arg("host_budget_bytes") = 0);
  m.def("plan_simulate",
        [](const std::vector<ModuleProfile>& modules, const PlannerOptions& options,
           const std::vector<std::string>& placements, const std::vector<int64_t>& offload_limits) {
          std::vector<Placement> p;
          for (const auto& name : placements) p.push_back(parse_placement(name));
          if (offload_limits.empty()) return simulate_plan(modules, options, p);
          // Note [Partial offload]: a negative limit moves the module whole.
          std::vector<uint64_t> limits;
          for (int64_t v : offload_limits) limits.push_back(v < 0 ? kWholeModule : static_cast<uint64_t>(v));
          return simulate_plan(modules, options, p, limits);
        },
        nb::arg("modules"), nb::arg("options"), nb::arg("placements"),
        nb::arg("offload_limits") = std::vector<int64_t>{});
  m.def("plan_simulate_ran",
        [](const std::vector<ModuleProfile>& modules, const PlannerOptions& options,
           const std::vector<std::string>& placements, const std::vector<int64_t>& offload_limits,
           const std::vector<uint64_t>& lead_bytes, const std::vector<int64_t>& release_after) {
          RanPlan ran;
          for (const auto& name : placements) ran.placements.push_back(parse_placement(name));
          for (int64_t v : offload_limits) ran.offload_limits.push_back(v < 0 ? kWholeModule : static_cast<uint64_t>(v));
          ran.lead_bytes = lead_bytes;
          ran.release_after = release_after;
          return simulate_ran(modules, options, ran);
        },
        nb::arg("modules"), nb::arg("options"), nb::arg("placements"), nb::arg("offload_limits"),
        nb::arg("lead_bytes"), nb::arg("release_after"));
  // The re-plan triggers of a plan the glue holds as a dict.
  const auto replan_plan = [](uint64_t bytes_ssd, double planned_write_bps, double replan_fraction) {
    Plan p;
    p.bytes_ssd = bytes_ssd;
    p.planned_write_bps = planned_write_bps;
    p.replan_fraction = replan_fraction;
    return p;
  };
  m.def("plan_needs_replan",
        [replan_plan](uint64_t bytes_ssd, double planned_write_bps, double replan_fraction, double measured) {
          return replan_plan(bytes_ssd, planned_write_bps, replan_fraction).needs_replan(measured);
        },
        nb::arg("bytes_ssd"), nb::arg("planned_write_bps"), nb::arg("replan_fraction"),
        nb::arg("measured_write_bps"));
  m.def("plan_link_faster",
        [replan_plan](uint64_t bytes_ssd, double planned_write_bps, double replan_fraction, double measured) {
          return replan_plan(bytes_ssd, planned_write_bps, replan_fraction).link_faster(measured);
        },
        nb::arg("bytes_ssd"), nb::arg("planned_write_bps"), nb::arg("replan_fraction"),
        nb::arg("measured_write_bps"));
}
