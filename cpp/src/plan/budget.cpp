#include "ebbtide/plan/budget.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "ebbtide/util/error.hpp"

namespace ebbtide::plan {

// Note [Budget from the model]
// The per-GPU forward time of a layer is the report's forward time times the
// layer's share of the forward FLOPs (so mfu and the GPU's peak carry over);
// its bytes are the model's activation bytes of one layer (self or cross).
// Recomputing a layer re-runs its forward and saves only its input, the
// b x s x h hidden state (divided by tp under sequence parallelism), as
// Megatron's full recompute does. The head module holds the logits, the
// bytes outside the layers and the encoder output; it is the one module
// keep_last_modules = 1 keeps. The link: SSD writes at min(drives, PCIe),
// reads at min(drives, PCIe), four layers of prefetch, backward twice the
// forward (the model's 3 x forward step), writes done within the forward.
std::vector<ModuleProfile> model_modules(const PlanReport& r) {
  const ModelConfig& c = r.config;
  EBB_CHECK(c.recompute == Recompute::kNone, "a budget plan chooses what to recompute itself: use --recompute none");
  const double per_flop = r.flops.forward > 0 ? r.forward_seconds / r.flops.forward : 0.0;
  const double input = static_cast<double>(c.batch) * static_cast<double>(c.seq) * static_cast<double>(c.hidden) *
                       static_cast<double>(c.bytes_per_element) / (c.sp ? static_cast<double>(c.tp) : 1.0);
  std::vector<ModuleProfile> out;
  const auto add = [&](const std::string& name, double flops, double bytes, bool recomputable) {
    ModuleProfile m;
    m.name = name;
    m.forward_seconds = flops * per_flop;
    m.bytes = static_cast<uint64_t>(std::llround(bytes));
    m.recomputable = recomputable;
    m.recompute_bytes = recomputable ? static_cast<uint64_t>(std::llround(input)) : 0;
    out.push_back(std::move(m));
  };
  const bool enc_dec = c.arch == Arch::kEncoderDecoder;
  for (int64_t i = 0; i < c.layers; ++i)
    add((enc_dec ? "encoder." : "layer.") + std::to_string(i), r.flops.self_layer, r.activations.self_layer, true);
  if (enc_dec) {
    for (int64_t i = 0; i < c.decoder_layers; ++i)
      add("decoder." + std::to_string(i), r.flops.cross_layer, r.activations.cross_layer, true);
  }
  add("head", r.flops.logits, r.activations.logits + r.activations.outside + r.activations.shared, false);
  return out;
}

PlannerOptions model_planner_options(const PlanReport& r, uint64_t budget, uint64_t host_budget) {
  PlannerOptions o;
  const double link = r.gpu.pcie_gbps * 1e9;
  o.write_bps = r.write_gbps_available * 1e9;
  o.read_bps = std::min(r.ssd_read_gbps * 1e9, link);
  o.host_budget_bytes = host_budget;
  o.host_write_bps = o.host_read_bps = host_budget > 0 ? link : 0.0;
  o.keep_last_modules = 1;
  o.backward_factor = 2.0;
  o.prefetch_modules = 4;
  o.writes_within_forward = true;
  o.activation_budget_bytes = budget;
  return o;
}

int64_t max_micro_batch_budget(const ModelConfig& config, const GpuSpec& gpu, const SsdSpec& ssd,
                               const PlanOptions& options, uint64_t host_budget) {
  EBB_CHECK(config.recompute == Recompute::kNone,
            "a budget plan chooses what to recompute itself: use --recompute none");
  const auto fits = [&](int64_t batch) {
    ModelConfig c = config;
    c.batch = batch;
    const PlanReport r = make_plan(c, gpu, ssd, options);
    const double free = r.gpu_memory_bytes - r.model_state_bytes;
    if (free < 1) return false;
    const Plan p = plan_budget(model_modules(r), model_planner_options(r, static_cast<uint64_t>(free), host_budget));
    return p.feasible && static_cast<double>(p.bytes_ssd) <= r.ssd_capacity_bytes;
  };
  // Every term grows with the micro-batch: double until it does not fit, then bisect.
  constexpr int64_t kMax = int64_t{1} << 20;
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;
  while (hi <= kMax && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  if (hi > kMax) return lo;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace ebbtide::plan
