#include "ebbtide/plan/megatron.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "ebbtide/plan/budget.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::plan {

// Note [Megatron flags]
// Megatron-core expresses fewer plans than the tensor cache: its full
// recompute with --recompute-method block recomputes the first N layers of a
// rank's chunk (keeping each one's input), and its fine-grained offloading
// moves the saves of the same --offload-modules in every layer it runs with
// grad to host memory, except in the layer whose backward comes first (its
// "offload margin": a reload there would stall). The margin goes to the last
// group of each name its warm-up iteration saw; with full recompute those
// are groups of the recompute in backward, so every layer not recomputed is
// offloaded (measured on CPU, python/tests/test_integrations_megatron.py).
// So the candidates are N in 0..layers
// and the sets of offload modules Megatron accepts (attn_proj only with
// core_attn); attn_norm is left out when N > 0: Megatron releases the
// attn_norm input (the layer input) with resize_(0) once offloaded, and full
// recompute keeps that same tensor as its checkpoint (megatron-core 0.16.1
// fails in backward with "data is not allocated"). Each candidate becomes
// placements of the budget plan's modules (model_modules: a layer recomputed,
// offloaded to host memory with the offload modules' bytes as its partial
// offload, or kept; the head kept) and is replayed by simulate_plan with
// the budget plan's options, so its peak and step time are the same model's.
// The fastest candidate within the budget wins; ties go to fewer bytes over
// the link, then fewer recomputed layers.

namespace {

const std::vector<std::string>& offload_module_names() {
  static const std::vector<std::string> names{"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"};
  return names;
}

// The candidate offload-module sets in a fixed order (smaller sets first).
std::vector<std::vector<std::string>> offload_sets(bool with_recompute) {
  const auto& names = offload_module_names();
  std::vector<std::vector<std::string>> out;
  const unsigned n = static_cast<unsigned>(names.size());
  for (unsigned size = 0; size <= n; ++size) {
    for (unsigned mask = 0; mask < (1u << n); ++mask) {
      if (static_cast<unsigned>(__builtin_popcount(mask)) != size) continue;
      std::vector<std::string> set;
      for (unsigned i = 0; i < n; ++i)
        if (mask & (1u << i)) set.push_back(names[i]);
      const auto has = [&](const char* m) {
        for (const auto& s : set)
          if (s == m) return true;
        return false;
      };
      if (has("attn_proj") && !has("core_attn")) continue;  // Megatron rejects attn_proj alone
      if (with_recompute && has("attn_norm")) continue;       // Note [Megatron flags]
      out.push_back(std::move(set));
    }
  }
  return out;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : " ") + n;
  return out;
}

}  // namespace

double MegatronLayerSaves::of(const std::vector<std::string>& modules) const {
  double sum = 0;
  for (const auto& m : modules) {
    if (m == "attn_norm") sum += attn_norm;
    else if (m == "qkv_linear") sum += qkv_linear;
    else if (m == "core_attn") sum += core_attn;
    else if (m == "attn_proj") sum += attn_proj;
    else if (m == "mlp_norm") sum += mlp_norm;
    else
      throw InvalidArgument(detail::concat("unknown Megatron offload module '", m, "' (valid: ",
                                           joined(offload_module_names()), ")"));
  }
  return sum;
}

MegatronPlan plan_megatron(const PlanReport& report, uint64_t activation_budget_bytes, uint64_t host_budget_bytes) {
  const ModelConfig& c = report.config;
  EBB_CHECK(c.family == Family::kMegatron, "Megatron flags are planned for family megatron (got family ",
            to_string(c.family), ")");
  const MegatronLayerSaves saves = megatron_layer_saves(c);
  const std::vector<ModuleProfile> modules = model_modules(report);
  const PlannerOptions options = model_planner_options(report, activation_budget_bytes, host_budget_bytes);
  const int64_t layers = c.layers;

  MegatronPlan best;
  bool have = false;
  bool best_fits = false;
  for (int64_t recomputed = 0; recomputed <= layers; ++recomputed) {
    for (const auto& set : offload_sets(recomputed > 0)) {
      if (!set.empty() && (host_budget_bytes == 0 || recomputed >= layers)) continue;
      const auto moved = static_cast<uint64_t>(std::llround(saves.of(set)));
      std::vector<Placement> placements;
      std::vector<uint64_t> limits;
      for (size_t i = 0; i < modules.size(); ++i) {
        const auto layer = static_cast<int64_t>(i);
        Placement p = Placement::kKeep;
        if (layer < recomputed) {
          p = Placement::kRecompute;
        } else if (!set.empty() && layer < layers && (layer < layers - 1 || recomputed > 0) && moved > 0) {
          p = Placement::kOffloadCpu;  // the offload margin: the last layer, without recompute
        }
        placements.push_back(p);
        limits.push_back(p == Placement::kOffloadCpu ? moved : kWholeModule);
      }
      MegatronPlan cand;
      cand.recompute_num_layers = recomputed;
      cand.offload_modules = set;
      cand.plan = simulate_plan(modules, options, placements, limits);
      for (const auto& m : cand.plan.modules) {
        cand.resident_bytes += m.saved_bytes - m.offload_bytes + (is_recompute(m.placement) ? 0 : m.fixed_bytes);
        cand.offloaded_bytes += m.offload_bytes;
      }
      if (cand.offloaded_bytes > host_budget_bytes) continue;
      const bool fits = cand.plan.peak_resident_bytes <= activation_budget_bytes;
      const auto key = [](const MegatronPlan& m) {
        return std::make_tuple(m.plan.predicted_step_seconds(), m.offloaded_bytes, m.recompute_num_layers);
      };
      bool better = !have;
      if (have && fits != best_fits) better = fits;
      else if (have && fits) better = key(cand) < key(best);
      else if (have) better = cand.plan.peak_resident_bytes < best.plan.peak_resident_bytes ||
                              (cand.plan.peak_resident_bytes == best.plan.peak_resident_bytes && key(cand) < key(best));
      if (better) {
        best = std::move(cand);
        best_fits = fits;
        have = true;
      }
    }
  }
  EBB_CHECK(have, "no Megatron setting to plan for ", layers, " layers");
  best.plan.activation_budget_bytes = activation_budget_bytes;
  best.plan.feasible = best_fits;
  best.plan.min_budget_bytes = best_fits ? 0 : best.plan.peak_resident_bytes;
  if (best.recompute_num_layers > 0) {
    best.flags = {"--recompute-granularity full", "--recompute-method block",
                  "--recompute-num-layers " + std::to_string(best.recompute_num_layers)};
  }
  if (!best.offload_modules.empty()) {
    best.flags.push_back("--fine-grained-activation-offloading");
    best.flags.push_back("--offload-modules " + joined(best.offload_modules));
  }
  return best;
}

}  // namespace ebbtide::plan
