#include "ebbtide/plan/planner.hpp"

#include <algorithm>
#include <cmath>

#include "ebbtide/util/error.hpp"

namespace ebbtide::plan {

std::string to_string(Placement placement) {
  switch (placement) {
    case Placement::kKeep: return "keep";
    case Placement::kOffloadCpu: return "offload_cpu";
    case Placement::kOffloadSsd: return "offload_ssd";
  }
  return "?";
}

bool Plan::needs_replan(double measured_write_bps) const {
  EBB_CHECK(std::isfinite(measured_write_bps) && measured_write_bps >= 0,
            "measured write bandwidth must be a non-negative number of bytes/s, got ", measured_write_bps);
  if (bytes_ssd == 0 || planned_write_bps <= 0) return false;
  return measured_write_bps < replan_fraction * planned_write_bps;
}

namespace {

void check_rate(double v, const char* name) {
  EBB_CHECK(std::isfinite(v) && v >= 0, "planner setting '", name,
            "' must be a non-negative number of bytes/s, got ", v);
}

void validate(const std::vector<ModuleProfile>& modules, const PlannerOptions& o) {
  for (size_t i = 0; i < modules.size(); ++i) {
    EBB_CHECK(std::isfinite(modules[i].forward_seconds) && modules[i].forward_seconds >= 0,
              "module ", i, " ('", modules[i].name, "'): forward_seconds must be >= 0, got ",
              modules[i].forward_seconds);
  }
  check_rate(o.write_bps, "write_bps");
  check_rate(o.read_bps, "read_bps");
  check_rate(o.max_write_bps, "max_write_bps");
  check_rate(o.host_write_bps, "host_write_bps");
  check_rate(o.host_read_bps, "host_read_bps");
  EBB_CHECK(o.keep_last_modules >= 0, "planner setting 'keep_last_modules' must be >= 0, got ",
            o.keep_last_modules);
  EBB_CHECK(std::isfinite(o.backward_factor) && o.backward_factor > 0,
            "planner setting 'backward_factor' must be > 0, got ", o.backward_factor);
  EBB_CHECK(o.prefetch_modules >= 1, "planner setting 'prefetch_modules' must be >= 1, got ",
            o.prefetch_modules);
  EBB_CHECK(std::isfinite(o.stall_tolerance_seconds) && o.stall_tolerance_seconds >= 0,
            "planner setting 'stall_tolerance_seconds' must be >= 0, got ", o.stall_tolerance_seconds);
  EBB_CHECK(o.replan_fraction > 0 && o.replan_fraction <= 1,
            "planner setting 'replan_fraction' must be in (0, 1], got ", o.replan_fraction);
}

double ssd_write_rate(const PlannerOptions& o) {
  return o.max_write_bps > 0 ? std::min(o.write_bps, o.max_write_bps) : o.write_bps;
}

}  // namespace

// Note [Offload rule]
// Modules i = 0..n-1 in forward order, forward time f_i, bytes B_i,
// F = sum f_i, t_i = f_0 + ... + f_i (module i's activations are complete).
// Writes: one FIFO per tier at rate W (SSD: min(write_bps, max_write_bps)),
//   w_i = max(t_i, w_prev) + B_i / W.
// Backward runs i = n-1..0, module i taking beta * f_i (beta =
// backward_factor, ~2). Module i's reload may start once its write is done,
// the tier's previous read is done, and backward has reached module
// i + prefetch_modules (a bounded prefetch window; at F if there is none):
//   rho_i = max(w_i, r_prev, start_{i+k}),  r_i = rho_i + B_i / R.
// Its backward starts at start_i = max(end of module i+1's backward, r_i);
// the stall is the sum of the r_i - (end of i+1's backward) that are positive.
// The planner walks the forward order, keeping the last keep_last_modules
// resident, and offloads module i to the first tier (host memory while its
// budget lasts, then the SSD) whose simulated total stall stays within
// stall_tolerance_seconds of the plan without it. The first module no tier
// can take ends the walk: it and every later module stay resident. This is
// ARCHITECTURE.md's rule (offload while the writes so far and the reloads fit
// in the compute time elapsed and left) made exact for uneven modules.
namespace {

// The timing model above; the O(n^2) peak-memory scan only when asked (the
// greedy walk needs the stall alone). Inputs already validated.
Plan simulate(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
              const std::vector<Placement>& placements, bool with_peak) {
  const size_t n = modules.size();
  Plan plan;
  plan.replan_fraction = o.replan_fraction;
  plan.planned_write_bps = ssd_write_rate(o);
  plan.planned_read_bps = o.read_bps;
  plan.modules.resize(n);

  double t = 0;
  double w_tier[2] = {0, 0};  // 0: cpu, 1: ssd
  const double write_rate[2] = {o.host_write_bps, ssd_write_rate(o)};
  const double read_rate[2] = {o.host_read_bps, o.read_bps};
  auto tier_of = [](Placement p) { return p == Placement::kOffloadCpu ? 0 : 1; };

  for (size_t i = 0; i < n; ++i) {
    ModuleDecision& d = plan.modules[i];
    d.name = modules[i].name;
    d.bytes = modules[i].bytes;
    d.placement = placements[i];
    t += modules[i].forward_seconds;
    d.forward_end_seconds = t;
    plan.all_resident_bytes += d.bytes;
    if (d.placement == Placement::kKeep) {
      plan.bytes_keep += d.bytes;
      continue;
    }
    const int tier = tier_of(d.placement);
    const double rate = write_rate[tier];
    const double duration = d.bytes == 0 ? 0.0 : (rate > 0 ? static_cast<double>(d.bytes) / rate : INFINITY);
    // Device copies are enqueued as the module's tensors are produced, so
    // they may start with the module rather than after it (never ending
    // before it does).
    const double start = o.writes_within_forward ? t - modules[i].forward_seconds : t;
    d.write_done_seconds = std::max(t, std::max(start, w_tier[tier]) + duration);
    w_tier[tier] = d.write_done_seconds;
    (tier == 0 ? plan.bytes_cpu : plan.bytes_ssd) += d.bytes;
  }
  plan.forward_seconds = t;

  const double beta = o.backward_factor;
  const size_t k = static_cast<size_t>(o.prefetch_modules);
  double clock = t;
  double r_tier[2] = {0, 0};
  double stall = 0;
  for (size_t idx = n; idx-- > 0;) {
    ModuleDecision& d = plan.modules[idx];
    double start = clock;
    if (d.placement != Placement::kKeep) {
      const int tier = tier_of(d.placement);
      const double window_open = idx + k < n ? plan.modules[idx + k].backward_start_seconds : t;
      d.read_start_seconds = std::max({d.write_done_seconds, r_tier[tier], window_open});
      const double rate = read_rate[tier];
      const double duration = d.bytes == 0 ? 0.0 : (rate > 0 ? static_cast<double>(d.bytes) / rate : INFINITY);
      const double ready = d.read_start_seconds + duration;
      r_tier[tier] = ready;
      if (ready > start) {
        stall += ready - start;
        start = ready;
      }
    }
    d.backward_start_seconds = start;
    clock = start + beta * modules[idx].forward_seconds;
    plan.backward_seconds += beta * modules[idx].forward_seconds;
  }
  plan.predicted_stall_seconds = stall;
  if (!with_peak) return plan;

  // Peak resident bytes: forward peaks come when a module finishes (writes
  // only lower it); backward peaks when a module's backward starts.
  uint64_t peak = 0;
  for (size_t i = 0; i < n; ++i) {
    const double now = plan.modules[i].forward_end_seconds;
    uint64_t resident = 0;
    for (size_t j = 0; j <= i; ++j) {
      const auto& m = plan.modules[j];
      if (m.placement == Placement::kKeep || m.write_done_seconds > now) resident += m.bytes;
    }
    peak = std::max(peak, resident);
  }
  for (size_t i = 0; i < n; ++i) {
    const double now = plan.modules[i].backward_start_seconds;
    uint64_t resident = 0;
    for (size_t j = 0; j <= i; ++j) {
      const auto& m = plan.modules[j];
      if (m.placement == Placement::kKeep || m.write_done_seconds > now || m.read_start_seconds <= now)
        resident += m.bytes;
    }
    peak = std::max(peak, resident);
  }
  plan.peak_resident_bytes = peak;
  return plan;
}

}  // namespace

Plan simulate_plan(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
                   const std::vector<Placement>& placements) {
  validate(modules, o);
  EBB_CHECK(placements.size() == modules.size(), "simulate_plan: ", placements.size(),
            " placements for ", modules.size(), " modules");
  return simulate(modules, o, placements, true);
}

namespace {

// The greedy walk of Note [Offload rule], trying the tiers in `order`.
Plan plan_greedy(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
                 std::initializer_list<Placement> order) {
  const size_t n = modules.size();
  std::vector<Placement> placements(n, Placement::kKeep);
  const size_t keep = std::min(n, static_cast<size_t>(o.keep_last_modules));
  const size_t candidates = n - keep;
  const double step = [&] {
    double f = 0;
    for (const auto& m : modules) f += m.forward_seconds;
    return f * (1 + o.backward_factor);
  }();
  // Floating-point slack, far below any stall worth reporting.
  const double tolerance = o.stall_tolerance_seconds + 1e-9 * step;
  const bool ssd_usable = ssd_write_rate(o) > 0 && o.read_bps > 0;
  const bool cpu_usable = o.host_budget_bytes > 0 && o.host_write_bps > 0 && o.host_read_bps > 0;
  uint64_t host_left = o.host_budget_bytes;

  double base_stall = 0;
  for (size_t i = 0; i < candidates; ++i) {
    if (modules[i].bytes == 0) continue;  // nothing to move
    bool placed = false;
    for (Placement tier : order) {
      if (tier == Placement::kOffloadSsd && !ssd_usable) continue;
      if (tier == Placement::kOffloadCpu && (!cpu_usable || host_left < modules[i].bytes)) continue;
      placements[i] = tier;
      const Plan trial = simulate(modules, o, placements, false);
      const double stall = trial.predicted_stall_seconds;
      const bool in_time = !o.writes_within_forward ||
                           trial.modules[i].write_done_seconds <= trial.forward_seconds + tolerance;
      if (in_time && stall <= base_stall + tolerance) {
        base_stall = stall;
        if (tier == Placement::kOffloadCpu) host_left -= modules[i].bytes;
        placed = true;
        break;
      }
      placements[i] = Placement::kKeep;
    }
    if (!placed) break;
  }
  return simulate(modules, o, placements, true);
}

}  // namespace

// Note [Tier order]
// Host memory is the tier in front of the SSD: the walk fills it first (no
// SSD wear, fastest reloads). With a small budget that can cost offload: the
// early modules, whose writes have the most compute to hide behind, would
// serve the SSD best. So with both tiers the walk also runs SSD-first, and
// that plan wins only when it moves strictly more bytes.
Plan plan_offload(const std::vector<ModuleProfile>& modules, const PlannerOptions& o) {
  validate(modules, o);
  Plan cpu_first = plan_greedy(modules, o, {Placement::kOffloadCpu, Placement::kOffloadSsd});
  if (cpu_first.bytes_cpu == 0 || cpu_first.bytes_keep == 0) return cpu_first;  // nothing to gain
  Plan ssd_first = plan_greedy(modules, o, {Placement::kOffloadSsd, Placement::kOffloadCpu});
  const auto moved = [](const Plan& p) { return p.bytes_cpu + p.bytes_ssd; };
  return moved(ssd_first) > moved(cpu_first) ? ssd_first : cpu_first;
}

}  // namespace ebbtide::plan
