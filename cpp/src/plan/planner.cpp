#include "ebbtide/plan/planner.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "ebbtide/util/error.hpp"
#include "planner_impl.hpp"

namespace ebbtide::plan {

std::string to_string(Placement placement) {
  switch (placement) {
    case Placement::kKeep: return "keep";
    case Placement::kOffloadCpu: return "offload_cpu";
    case Placement::kOffloadSsd: return "offload_ssd";
    case Placement::kRecompute: return "recompute";
    case Placement::kRecomputeOffloadCpu:
    case Placement::kRecomputeOffloadSsd: return "recompute_offload";
  }
  return "?";
}

std::string tier_name(Placement placement) {
  switch (placement) {
    case Placement::kOffloadCpu:
    case Placement::kRecomputeOffloadCpu: return "cpu";
    case Placement::kOffloadSsd:
    case Placement::kRecomputeOffloadSsd: return "ssd";
    default: return "";
  }
}

Placement parse_placement(const std::string& name) {
  for (Placement p : {Placement::kKeep, Placement::kOffloadCpu, Placement::kOffloadSsd, Placement::kRecompute,
                      Placement::kRecomputeOffloadCpu, Placement::kRecomputeOffloadSsd}) {
    const std::string s = is_recompute(p) && is_offload(p) ? to_string(p) + "_" + tier_name(p) : to_string(p);
    if (s == name) return p;
  }
  throw InvalidArgument("placement '" + name + "' is not valid (valid: keep, offload_cpu, offload_ssd, recompute, "
                        "recompute_offload_cpu, recompute_offload_ssd)");
}

bool is_recompute(Placement p) {
  return p == Placement::kRecompute || p == Placement::kRecomputeOffloadCpu || p == Placement::kRecomputeOffloadSsd;
}

bool is_offload(Placement p) { return p != Placement::kKeep && p != Placement::kRecompute; }

bool Plan::needs_replan(double measured_write_bps) const {
  EBB_CHECK(std::isfinite(measured_write_bps) && measured_write_bps >= 0,
            "measured write bandwidth must be a non-negative number of bytes/s, got ", measured_write_bps);
  if (bytes_ssd == 0 || planned_write_bps <= 0) return false;
  return measured_write_bps < replan_fraction * planned_write_bps;
}

bool Plan::link_faster(double measured_write_bps) const {
  EBB_CHECK(std::isfinite(measured_write_bps) && measured_write_bps >= 0,
            "measured write bandwidth must be a non-negative number of bytes/s, got ", measured_write_bps);
  if (bytes_ssd == 0 || planned_write_bps <= 0) return false;
  return measured_write_bps * replan_fraction > planned_write_bps;
}

namespace {

void check_rate(double v, const char* name) {
  EBB_CHECK(std::isfinite(v) && v >= 0, "planner setting '", name,
            "' must be a non-negative number of bytes/s, got ", v);
}

}  // namespace

namespace detail {

void validate(const std::vector<ModuleProfile>& modules, const PlannerOptions& o) {
  for (size_t i = 0; i < modules.size(); ++i) {
    EBB_CHECK(std::isfinite(modules[i].forward_seconds) && modules[i].forward_seconds >= 0,
              "module ", i, " ('", modules[i].name, "'): forward_seconds must be >= 0, got ",
              modules[i].forward_seconds);
    EBB_CHECK(std::isfinite(modules[i].recompute_seconds),
              "module ", i, " ('", modules[i].name, "'): recompute_seconds must be a number, got ",
              modules[i].recompute_seconds);
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

}  // namespace detail

using detail::ssd_write_rate;
using detail::validate;

// Note [Offload rule]
// Modules i = 0..n-1 in forward order, forward time f_i, bytes B_i,
// F = sum f_i, t_i = f_0 + ... + f_i (module i's activations are complete).
// Writes: one FIFO per tier at rate W (SSD: min(write_bps, max_write_bps)),
//   w_i = max(t_i, w_prev) + B_i / W.
// Backward runs i = n-1..0, module i taking beta * f_i (beta =
// backward_factor, ~2). Module i's reload may start once its write is done,
// the tier's previous read is done, and the prefetch window has room: the
// cache's window holds k = prefetch_modules times the largest offloaded
// module's bytes, a module's bytes stay in it from its reload to the start
// of its backward, and kept modules take none of it. So module i's reload
// opens at the backward start of the latest module above it that must leave
// the window first (at F when everything above it fits with it):
//   rho_i = max(w_i, r_prev, open_i),  r_i = rho_i + B_i / R.
// Its backward starts at start_i = max(end of module i+1's backward, r_i);
// the stall is the sum of the r_i - (end of i+1's backward) that are positive.
// The planner walks the forward order, keeping the last keep_last_modules
// resident, and offloads module i to the first tier (host memory while its
// budget lasts, then the SSD) whose simulated total stall stays within
// stall_tolerance_seconds of the plan without it. The first module no tier
// can take ends the walk: it and every later module stay resident. This is
// ARCHITECTURE.md's rule (offload while the writes so far and the reloads fit
// in the compute time elapsed and left) made exact for uneven modules.

// Note [Copy bound in the plan]
// On a GPU the cache makes the compute stream wait, after a save, while more
// than device_inflight_bytes of copies are queued ahead of it (Note [Copy
// bound] in tensor_cache_device.cpp): on the device that wait lasts until the
// copy stream has drained to the bound. With copy_bound_bytes = D the model
// does the same on the link's queue (both tiers: an SSD-tier tensor is first
// copied into a bounce blob on the same copy stream; the link's rate W is
// the host tier's, measured on the device): after module i enqueues its
// copies, the bytes still queued when its last save is made, m, are
// (w_link - m) * W; above D the forward waits until w_link - D / W, and module
// i and everything after it end that much later (forward_wait_seconds, part
// of the stall, so the walk refuses what the link cannot absorb). A whole
// module's last save is taken at its end; a prefix's (Note [Partial offload])
// at its start, since when within the module the first bytes are made is not
// profiled. Without this the planner took the H200's shape b (1.95 GB
// blocks, 10.5 ms each, 55 GB/s) as two blocks whose copies end by the
// forward's end, and the 1 GiB bound made the forward wait 30 ms (predicted
// now, test PlanPlanner.CopyBoundWaitIsPredicted; measured 34 ms).
//
// Note [Partial offload]
// A block's copy may not fit whole where a part of it would: the copies must
// end by the forward's end (writes_within_forward) and stay under the copy
// bound, and with blocks of 0.7-2 GB one block more or less is 12-20% of what
// the link can carry (the H200's shape a: one 712 MB block fitted, two took
// 25.8 ms of copying in a 25.2 ms forward; 0.49 of the link limit). With
// partial_offload the walk first tries a module whole, as before; when that
// fails it takes the largest prefix of the module's saves, by bytes in save
// order, that fits (bisection to 1/1024 of the module), and goes on to the
// next module instead of ending the walk (a later module may fit where this
// one did not). The glue offloads a scope's saves while their bytes stay
// within offload_bytes and keeps the rest; the prefix's copies are queued as
// the whole module's are (from its start, ending no earlier than its end), its
// rest counts as resident until its backward.
// Note [Reloads within the distance]
// The backward's peak is counted at each module's backward with the module
// wholly held (its frees come as its backward runs) and, of the modules
// below it, the reloads the cache may already have made. Those are bounded
// by Note [Prefetch distance] (tensor_cache_load.cpp): a load starts only
// when every byte saved between it and the point backward has reached,
// resident ones included, fits the window. So what is reloaded ahead is the
// moved bytes within `window` bytes of saves below the module, not the
// window filled by whatever was moved: with the late blocks kept, a
// window's distance below them holds few moved bytes. The model counted the
// whole window before, which on the simulated device (test
// CacheStreamOrdered.PlannedPeakIsWithinTenPercentOfTheLinkLimit)
// predicted 16.8/12.6/8.4 MB where the device held 12.8/8.7/4.5 MB, and a
// budget plan would recompute for memory the cache never takes.

// Note [Frees at release points]
// On a GPU an offloaded module's memory comes back at a release point, at a
// module's end (Note [Release points] in tensor_cache_device.cpp), after
// the compute stream has waited for its copies. So the forward's peak at the
// end of module i counts every module whose copies ended after module i-1
// did: module i's allocations are made before the release that frees them.
// Counting them freed at module i's end put the simulated device's forward
// peak one block above the plan's (12.85 vs 12.58 MB) when the link was
// filled to the forward's end.

// Note [Prefix or another tier whole]
// A module the first tier cannot take whole may fit whole on the next: with
// a host budget smaller than the module, the host tier can take only a
// prefix (room-bound), while the SSD tier, if its writes hide, takes it all.
// So a prefix does not end the module's search: every tier is tried, the
// first whole fit wins at once (the order's preference, as without prefixes),
// and otherwise the prefix that moves the most bytes, the earlier tier's at
// equal bytes. Before, the walk took the host prefix and moved on (a 1.5 GB
// host budget over 1 GB modules gave block 1 a 0.5 GB host prefix where the
// SSD took it whole; PlanPlanner.PrefixYieldsToAnotherTierWhole).
namespace detail {

// Note [Guarded writes]
// On the worker path (host tensors) each tensor's write is queued as it is
// saved (so a module's writes start with it, as on a GPU) and its memory
// comes back when its own write ends, not with its module's; under a budget the cache makes
// saves wait while more than slack = budget - K bytes wait to be stored, K
// the plan's kept bytes (Note [Budget guard] in ebbtide/cache/adaptive.py). With
// guarded_writes the model follows: each tier's queue drains at its rate, so
// a module's unwritten bytes at time t are clamp((w_j - t) * rate, 0, B_j)
// and all of a tier's are max(0, w_tier - t) * rate (every queued write
// started by t, so the tier is busy until w_tier). After an offloaded module
// queues its write, the forward waits until the queues hold at most `slack`
// (the module ends then: its last save was accepted); the wait is stall
// (forward_wait_seconds). The forward's peaks are then at most the budget, so
// a plan whose writes lag a little pays the wait the lag costs instead of
// being refused for a peak the cache never reaches (before, offloading every
// block at a budget just above its measured peak was predicted one block
// over, and the plan recomputed 4 blocks: 1.07x offloading's step). Without
// a budget, or when K alone exceeds it (no guard is set), only the partial
// accounting applies.
namespace {

// The earliest t' >= t at which the queues, each busy until w[k] draining at
// rate[k], hold at most `slack` bytes. Piecewise linear: solve on the tiers
// still busy, dropping the one that empties first when the root lies beyond it.
double drained_by(const double w[2], const double rate[2], double t, double slack) {
  for (;;) {
    double sum_wr = 0, sum_r = 0, first_empty = INFINITY;
    for (int k = 0; k < 2; ++k) {
      if (!(w[k] > t) || rate[k] <= 0) continue;
      if (!std::isfinite(w[k])) return INFINITY;
      sum_wr += w[k] * rate[k];
      sum_r += rate[k];
      first_empty = std::min(first_empty, w[k]);
    }
    if (sum_r == 0 || sum_wr - t * sum_r <= slack) return t;
    const double root = (sum_wr - slack) / sum_r;
    if (root <= first_empty) return root;
    t = first_empty;
  }
}

}  // namespace

// The timing model above (planner_impl.hpp says what the arguments mean).
Plan simulate(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
              const std::vector<Placement>& placements, bool with_peak, double* area,
              const std::vector<uint64_t>* limits) {
  const size_t n = modules.size();
  Plan plan;
  plan.replan_fraction = o.replan_fraction;
  plan.planned_write_bps = ssd_write_rate(o);
  plan.planned_read_bps = o.read_bps;
  plan.modules.resize(n);

  double t = 0;
  double w_tier[2] = {0, 0};  // 0: cpu, 1: ssd
  double w_link = 0;          // Note [Copy bound in the plan]: the device's copy stream, both tiers
  const double write_rate[2] = {o.host_write_bps, ssd_write_rate(o)};
  const double read_rate[2] = {o.host_read_bps, o.read_bps};
  auto tier_of = [](Placement p) {
    return p == Placement::kOffloadCpu || p == Placement::kRecomputeOffloadCpu ? 0 : 1;
  };

  // Note [Guarded writes]: the guard's slack, when a guard applies.
  const bool partial = o.guarded_writes;
  double slack = -1;
  if (o.guarded_writes && o.activation_budget_bytes > 0) {
    uint64_t kept = 0;
    for (size_t i = 0; i < n; ++i) {
      const Placement p = placements[i];
      if (!is_recompute(p)) kept += modules[i].fixed_bytes;
      if (!is_offload(p)) kept += is_recompute(p) ? modules[i].recompute_bytes : modules[i].bytes;
    }
    if (kept < o.activation_budget_bytes) slack = static_cast<double>(o.activation_budget_bytes - kept);
  }
  std::vector<double> module_rate(n, 0.0);  // the write rate of each offloaded module's tier
  double compute = 0;

  for (size_t i = 0; i < n; ++i) {
    ModuleDecision& d = plan.modules[i];
    const ModuleProfile& m = modules[i];
    d.name = m.name;
    d.bytes = m.bytes;
    d.placement = placements[i];
    d.saved_bytes = d.bytes;
    d.fixed_bytes = m.fixed_bytes;
    if (is_recompute(d.placement)) {
      d.fixed_bytes = 0;
      d.saved_bytes = m.recompute_bytes;
      d.recompute_seconds = m.recompute_seconds < 0 ? m.forward_seconds : m.recompute_seconds;
      plan.recompute_seconds += d.recompute_seconds;
      const uint64_t all = d.bytes + m.fixed_bytes;
      plan.bytes_recomputed += all > d.saved_bytes ? all - d.saved_bytes : 0;
      plan.modules_recomputed += 1;
    }
    t += m.forward_seconds;
    compute += m.forward_seconds;
    d.forward_end_seconds = t;
    plan.all_resident_bytes += d.bytes + m.fixed_bytes;
    plan.bytes_keep += d.fixed_bytes;
    if (!is_offload(d.placement)) {
      plan.bytes_keep += d.saved_bytes;
      continue;
    }
    const int tier = tier_of(d.placement);
    // Note [Partial offload]: the first offload_bytes of the saves move, the
    // rest stays resident.
    d.offload_bytes = limits == nullptr ? d.saved_bytes : std::min(d.saved_bytes, (*limits)[i]);
    plan.bytes_keep += d.saved_bytes - d.offload_bytes;
    const double rate = write_rate[tier];
    const double duration =
        d.offload_bytes == 0 ? 0.0 : (rate > 0 ? static_cast<double>(d.offload_bytes) / rate : INFINITY);
    // Device copies are enqueued as the module's tensors are produced, and
    // the worker path queues each tensor's write as it is saved (Note
    // [Guarded writes]), so they may start with the module rather than after
    // it (never ending before it does).
    const double start = o.writes_within_forward || o.guarded_writes ? t - modules[i].forward_seconds : t;
    d.write_done_seconds = std::max(t, std::max(start, w_tier[tier]) + duration);
    w_tier[tier] = d.write_done_seconds;
    module_rate[i] = rate;
    (tier == 0 ? plan.bytes_cpu : plan.bytes_ssd) += d.offload_bytes;
    const double link = write_rate[0];
    if (o.copy_bound_bytes > 0 && link > 0) {
      // Note [Copy bound in the plan]: the compute stream waits until the
      // queued copies are down to the bound, from the module's last save
      // (its end; a partial module's prefix: its start). Both tiers' copies
      // queue on the link: an SSD-tier tensor is copied into a bounce blob
      // on the same copy stream before it is written.
      w_link = std::max(t, std::max(start, w_link) + static_cast<double>(d.offload_bytes) / link);
      const double made = d.partial() ? start : t;
      const double resumed = w_link - static_cast<double>(o.copy_bound_bytes) / link;
      if (resumed > made) {
        plan.forward_wait_seconds += resumed - made;
        t += resumed - made;
        d.forward_end_seconds = t;
      }
    }
    if (slack >= 0) {
      const double resumed = drained_by(w_tier, write_rate, t, slack);
      plan.forward_wait_seconds += resumed - t;
      t = resumed;
      d.forward_end_seconds = t;
    }
  }
  plan.forward_seconds = compute;

  const double beta = o.backward_factor;
  const size_t k = static_cast<size_t>(o.prefetch_modules);
  double clock = t;
  double r_tier[2] = {0, 0};
  double stall = plan.forward_wait_seconds;
  // The prefetch window: k times the largest offloaded module's bytes, as
  // the glue sizes it (Note [Prefetch window] in ebbtide/cache/tensor_cache.py).
  uint64_t biggest = 0;
  for (const auto& m : plan.modules)
    if (is_offload(m.placement)) biggest = std::max(biggest, m.offload_bytes);
  const double window = static_cast<double>(k) * static_cast<double>(biggest);
  std::vector<size_t> reloaded;  // offloaded modules, in backward order
  double ahead_all = 0;          // their bytes
  for (size_t idx = n; idx-- > 0;) {
    ModuleDecision& d = plan.modules[idx];
    double start = clock;
    if (is_offload(d.placement)) {
      const int tier = tier_of(d.placement);
      // Open once the modules reloaded ahead of it whose backward has not
      // started, and it, fit the window (a module leaves the window as its
      // backward starts); at F when all of them fit.
      double window_open = t;
      double ahead = ahead_all + static_cast<double>(d.offload_bytes);
      for (size_t q = 0; q < reloaded.size() && ahead > window; ++q) {
        ahead -= static_cast<double>(plan.modules[reloaded[q]].offload_bytes);
        window_open = plan.modules[reloaded[q]].backward_start_seconds;
      }
      reloaded.push_back(idx);
      ahead_all += static_cast<double>(d.offload_bytes);
      d.read_start_seconds = std::max({d.write_done_seconds, r_tier[tier], window_open});
      const double rate = read_rate[tier];
      const double duration =
          d.offload_bytes == 0 ? 0.0 : (rate > 0 ? static_cast<double>(d.offload_bytes) / rate : INFINITY);
      const double ready = d.read_start_seconds + duration;
      r_tier[tier] = ready;
      if (ready > start) {
        stall += ready - start;
        start = ready;
      }
    }
    d.backward_start_seconds = start;
    clock = start + d.recompute_seconds + beta * modules[idx].forward_seconds;
    plan.backward_seconds += beta * modules[idx].forward_seconds;
  }
  plan.predicted_stall_seconds = stall;
  if (!with_peak) return plan;

  // Peak resident bytes: forward peaks come when a module finishes (writes
  // only lower it); backward peaks when a module's backward starts, which for
  // a recomputed module holds its recomputed activations (`bytes` and
// `fixed_bytes`) as well. A module's fixed_bytes count from its forward to
// its backward under every placement but recompute.
  // Offloaded bytes not yet written at `now`: all of the module's, or with
  // guarded_writes its unwritten part (Note [Guarded writes]).
  // A partial module's unmoved rest counts as resident throughout.
  const auto unwritten = [&](size_t j, double now) -> uint64_t {
    const auto& m = plan.modules[j];
    const uint64_t rest = m.saved_bytes - m.offload_bytes;
    if (m.write_done_seconds <= now) return rest;
    if (!partial || !std::isfinite(m.write_done_seconds)) return m.saved_bytes;
    const double left = (m.write_done_seconds - now) * module_rate[j];
    return rest + (left >= static_cast<double>(m.offload_bytes) ? m.offload_bytes : static_cast<uint64_t>(left));
  };
  uint64_t peak = 0;
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    // On a GPU memory comes back at release points, at module ends (Note
    // [Release points]): what module i allocates is made while the copies
    // that end within it are still held. Note [Frees at release points].
    const double now = o.writes_within_forward ? (i == 0 ? 0.0 : plan.modules[i - 1].forward_end_seconds)
                                               : plan.modules[i].forward_end_seconds;
    uint64_t resident = 0;
    for (size_t j = 0; j <= i; ++j) {
      const auto& m = plan.modules[j];
      resident += m.fixed_bytes;
      resident += is_offload(m.placement) ? unwritten(j, now) : m.saved_bytes;
    }
    peak = std::max(peak, resident);
    sum += static_cast<double>(resident);
  }
  // In backward the cache refills its prefetch window tensor by tensor, as
  // far ahead as Note [Prefetch distance] lets it: Note [Reloads within the
  // distance]. order[j]: where module j's saves begin in the save order.
  std::vector<double> order(n + 1, 0.0);
  for (size_t j = 0; j < n; ++j) order[j + 1] = order[j] + static_cast<double>(plan.modules[j].saved_bytes);
  for (size_t i = 0; i < n; ++i) {
    const double now = plan.modules[i].backward_start_seconds;
    uint64_t resident = is_recompute(plan.modules[i].placement) ? plan.modules[i].bytes + modules[i].fixed_bytes : 0;
    double below = 0;  // offloaded, written, reloadable ahead
    for (size_t j = 0; j <= i; ++j) {
      const auto& m = plan.modules[j];
      resident += m.fixed_bytes;
      if (!is_offload(m.placement) || j == i) {
        resident += m.saved_bytes;
      } else if (m.write_done_seconds > now) {
        resident += unwritten(j, now);
      } else {
        // The moved prefix [order[j], order[j] + offload_bytes) where it
        // lies within the window's distance below module i's first save.
        resident += m.saved_bytes - m.offload_bytes;
        const double lo = std::max(order[j], order[i] - window);
        const double hi = std::min(order[j] + static_cast<double>(m.offload_bytes), order[i]);
        below += std::max(0.0, hi - lo);
      }
    }
    resident += static_cast<uint64_t>(std::min(below, window));
    peak = std::max(peak, resident);
    sum += static_cast<double>(resident);
  }
  if (area != nullptr) *area = sum;
  plan.peak_resident_bytes = peak;
  return plan;
}

}  // namespace detail

using detail::simulate;

Plan simulate_plan(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
                   const std::vector<Placement>& placements) {
  validate(modules, o);
  EBB_CHECK(placements.size() == modules.size(), "simulate_plan: ", placements.size(),
            " placements for ", modules.size(), " modules");
  return simulate(modules, o, placements, true);
}

Plan simulate_plan(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
                   const std::vector<Placement>& placements, const std::vector<uint64_t>& offload_limits) {
  validate(modules, o);
  EBB_CHECK(placements.size() == modules.size() && offload_limits.size() == modules.size(), "simulate_plan: ",
            placements.size(), " placements and ", offload_limits.size(), " offload limits for ", modules.size(),
            " modules");
  for (size_t i = 0; i < modules.size(); ++i)
    EBB_CHECK(!is_offload(placements[i]) || offload_limits[i] > 0, "module ", i, " ('", modules[i].name,
              "'): an offload limit of 0 bytes moves nothing (keep it instead)");
  return simulate(modules, o, placements, true, nullptr, &offload_limits);
}

namespace {

// The greedy walk of Note [Offload rule], trying the tiers in `order`.
Plan plan_greedy(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
                 std::initializer_list<Placement> order) {
  const size_t n = modules.size();
  std::vector<Placement> placements(n, Placement::kKeep);
  std::vector<uint64_t> limits(n, kWholeModule);
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
  // Whether module i fits with the placements so far; its stall when it does.
  const auto fits = [&](size_t i) -> std::optional<double> {
    const Plan trial = simulate(modules, o, placements, false, nullptr, &limits);
    const double stall = trial.predicted_stall_seconds;
    const bool in_time = !o.writes_within_forward ||
                         trial.modules[i].write_done_seconds <= trial.forward_seconds + tolerance;
    if (in_time && stall <= base_stall + tolerance) return stall;
    return std::nullopt;
  };
  for (size_t i = 0; i < candidates; ++i) {
    const uint64_t bytes = modules[i].bytes;
    if (bytes == 0) continue;  // nothing to move
    // The first tier that takes the module whole wins; failing that, the tier
    // whose prefix moves the most bytes (the earlier tier at equal bytes).
    // Note [Prefix or another tier whole].
    struct Choice {
      Placement tier = Placement::kKeep;
      uint64_t limit = 0;
      double stall = 0;
    } best;
    for (Placement tier : order) {
      if (tier == Placement::kOffloadSsd && !ssd_usable) continue;
      if (tier == Placement::kOffloadCpu && !cpu_usable) continue;
      const uint64_t room = tier == Placement::kOffloadCpu ? host_left : kWholeModule;
      if (room < bytes && !o.partial_offload) continue;
      placements[i] = tier;
      limits[i] = kWholeModule;
      std::optional<double> stall;
      if (room >= bytes) stall = fits(i);
      if (stall) {
        best = {tier, kWholeModule, *stall};
        break;
      }
      if (o.partial_offload) {
        // Note [Partial offload]: the largest prefix that fits, to within
        // 1/1024 of the module (the stall, the copies' end and the copy
        // bound's wait all grow with the prefix). `stall` keeps the largest
        // fitting prefix's, so that prefix is not simulated again.
        uint64_t lo = 0, hi = std::min(bytes - 1, room);
        const uint64_t resolution = std::max<uint64_t>(1, bytes >> 10);
        limits[i] = hi;
        if (hi > 0 && (stall = fits(i))) lo = hi;
        while (hi - lo > resolution) {
          const uint64_t mid = lo + (hi - lo) / 2;
          limits[i] = mid;
          if (const auto s = fits(i)) {
            lo = mid;
            stall = s;
          } else {
            hi = mid;
          }
        }
        if (stall && lo > best.limit) best = {tier, lo, *stall};
      }
    }
    placements[i] = best.tier;
    limits[i] = best.tier == Placement::kKeep ? kWholeModule : best.limit;
    const bool placed = best.tier != Placement::kKeep;
    if (placed) {
      base_stall = best.stall;
      if (best.tier == Placement::kOffloadCpu) host_left -= std::min(bytes, best.limit);
    }
    // Whole modules: the first one no tier takes ends the walk. With partial
    // offload a later module may still fit where this one did not (the copy
    // bound drains, a smaller module), so the walk goes on.
    if (!placed && !o.partial_offload) break;
  }
  return simulate(modules, o, placements, true, nullptr, &limits);
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
