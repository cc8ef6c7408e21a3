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

std::vector<Placement> placements_of(const Plan& p) {
  std::vector<Placement> out;
  for (const auto& d : p.modules) out.push_back(d.placement);
  return out;
}

std::vector<uint64_t> limits_of(const Plan& p) {
  std::vector<uint64_t> out;
  for (const auto& d : p.modules) out.push_back(d.partial() ? d.offload_bytes : kWholeModule);
  return out;
}

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
    EBB_CHECK(std::isfinite(modules[i].backward_seconds),
              "module ", i, " ('", modules[i].name, "'): backward_seconds must be a number, got ",
              modules[i].backward_seconds);
    if (!modules[i].saves.empty()) {
      uint64_t own = 0;
      for (const auto& sv : modules[i].saves) {
        EBB_CHECK(sv.bytes > 0, "module ", i, " ('", modules[i].name, "'): a save of 0 bytes");
        EBB_CHECK(sv.shared >= -1, "module ", i, " ('", modules[i].name, "'): shared storage id ", sv.shared,
                  " (>= 0, or -1 for none)");
        own += sv.bytes;
      }
      // The held shared storages' bytes belong to their first saver: own <= listed.
      EBB_CHECK(own >= modules[i].bytes, "module ", i, " ('", modules[i].name, "'): its saves list ", own,
                " bytes, fewer than its ", modules[i].bytes, " bytes");
    }
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
// Every plan is judged by playing its step on the step model (Note [Step
// model] in step_model.cpp): its step time and its allocator peak. The walk
// goes through the modules in forward order, the last keep_last_modules
// kept, and tries each on the tiers in order (host memory while its budget
// lasts, then the SSD): a module goes where it adds no stall beyond
// stall_tolerance_seconds, moves something, ends its copies within the
// forward (GPU) or its writes before backward uses them (worker path), and
// lowers the peak (Note [Offload for the peak]). Whole modules: the first
// module no tier takes ends the walk; with partial_offload the walk goes on.
// This is ARCHITECTURE.md's rule (offload while the writes so far and the
// reloads fit in the compute time elapsed and left) made exact for the step
// as the cache runs it.

// Note [Offload for the peak]
// Moving bytes is worth it only where it lowers the peak the step reaches.
// Copies that end after the last release point before the peak are still
// held there; a module whose reload must come back as soon as backward
// begins (the one before the last kept, with its lead) is back by the
// backward's peak; and on the GPU the backward's floor (the gradients that
// grow as the activations go) may be the peak whatever moves. So the walk
// takes a move that lowers the peak, or keeps it while holding less over
// the step (a first module that lets a later one lower it); for a prefix,
// the one with the lowest peak (sampled, then the largest before the
// jump where its copies cross a release point); and a last pass takes back,
// from the end, every move that lowers neither the peak nor the stall.
// Before, the walk took every move that added no stall: on the H200's shape
// a it moved 1.4 GB of which 0.5 GB was still held at the peak.

// Note [Copy bound in the plan]
// On a GPU the cache makes the compute stream wait, after a save, while more
// than device_inflight_bytes of copies are held ahead of it (Note [Copy
// bound] in tensor_cache_device.cpp). The step model does the same after
// each save (both tiers: an SSD-tier tensor is first copied into a bounce
// blob on the same copy stream), at the save's place in the module, and the
// wait is stall, so the walk refuses what the link cannot absorb. Replayed
// on the H200's shape b plan of 2026-11-26 (1.95 GB blocks, 10.5 ms each,
// 55 GB/s, the 1 GiB bound): 33.4 ms of waits, measured 34 ms
// (PlanPlanner.CopyBoundWaitIsPredicted).

// Note [Partial offload]
// A block's copy may not fit whole where a part of it would: the copies must
// end by the forward's end (writes_within_forward) and stay under the copy
// bound, and with blocks of 0.7-2 GB one block more or less is 12-20% of what
// the link can carry. With partial_offload the walk first tries a module
// whole; when that fails it finds the largest prefix of the module's saves,
// by bytes in save order, that fits (bisection to 1/1024 of the module),
// then the prefix with the lowest peak (Note [Offload for the peak]), and
// goes on to the next module instead of ending the walk (a later module may
// fit where this one did not). The glue offloads a scope's saves while their
// bytes stay within offload_bytes and keeps the rest: what moves is whole
// saves, the first ones; the step model moves the same saves (the profile's,
// or a module's bytes in pieces), the rest resident until its backward.

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

Plan simulate_ran(const std::vector<ModuleProfile>& modules, const PlannerOptions& o, const RanPlan& ran) {
  validate(modules, o);
  const size_t n = modules.size();
  EBB_CHECK(ran.placements.size() == n, "simulate_ran: ", ran.placements.size(), " placements for ", n, " modules");
  EBB_CHECK(ran.offload_limits.empty() || ran.offload_limits.size() == n, "simulate_ran: ",
            ran.offload_limits.size(), " offload limits for ", n, " modules");
  EBB_CHECK(ran.lead_bytes.empty() || ran.lead_bytes.size() == n, "simulate_ran: ", ran.lead_bytes.size(),
            " reload leads for ", n, " modules");
  EBB_CHECK(ran.release_after.empty() || ran.release_after.size() == n, "simulate_ran: ",
            ran.release_after.size(), " release points for ", n, " modules");
  for (size_t i = 0; i < ran.release_after.size(); ++i)
    EBB_CHECK(ran.release_after[i] >= -1 && ran.release_after[i] <= static_cast<int64_t>(i), "simulate_ran: module ",
              i, " ('", modules[i].name, "') releases through module ", ran.release_after[i],
              ", which is not one before it");
  return simulate(modules, o, ran.placements, true, nullptr, ran.offload_limits.empty() ? nullptr : &ran.offload_limits,
                  &ran.lead_bytes, &ran.release_after);
}

namespace detail {

// Note [Reload lead]'s refinement: from the last offloaded module back, the
// shortest lead at a module boundary (the bytes from the module's first save
// to the end of module j >= i) whose step is no slower than `plan`'s.
Plan refine_leads(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
                  const std::vector<Placement>& placements, const std::vector<uint64_t>& limits, Plan plan) {
  const size_t n = modules.size();
  if (!o.lead_per_module || n == 0) return plan;
  double f = 0;
  for (const auto& m : modules) f += m.forward_seconds;
  const double tolerance = o.stall_tolerance_seconds + 1e-9 * f * (1 + o.backward_factor);
  // The leads as the plan has them (the latest start that hides each
  // reload, Note [Reload lead]), made explicit.
  std::vector<uint64_t> leads(n, 0);
  for (size_t i = 0; i < n; ++i)
    if (is_offload(placements[i])) leads[i] = std::max<uint64_t>(1, plan.modules[i].lead_bytes);
  Plan best = simulate(modules, o, placements, true, nullptr, &limits, &leads);
  // Saved bytes from module i's first save to the end of module j (kept ones
  // included, as the cache's distance counts them).
  std::vector<double> saved(n + 1, 0);
  for (size_t j = 0; j < n; ++j)
    saved[j + 1] = saved[j] + static_cast<double>(best.modules[j].saved_bytes + best.modules[j].fixed_bytes);
  const auto lead_to = [&](size_t i, size_t j) {
    return static_cast<uint64_t>(std::max(1.0, saved[j + 1] - saved[i]));
  };
  // Where a reload still waits (the queue held loads the nominal schedule
  // did not foresee), the shortest longer lead that removes the wait.
  for (size_t i = n; i-- > 0;) {
    if (!is_offload(placements[i]) || best.modules[i].wait_seconds <= tolerance) continue;
    size_t lo = i, hi = n - 1;
    while (lo < hi) {
      const size_t mid = lo + (hi - lo) / 2;
      std::vector<uint64_t> trial = leads;
      trial[i] = std::max(leads[i], lead_to(i, mid));
      const Plan p = simulate(modules, o, placements, false, nullptr, &limits, &trial);
      if (p.modules[i].wait_seconds <= tolerance) hi = mid;
      else lo = mid + 1;
    }
    std::vector<uint64_t> trial = leads;
    trial[i] = std::max(leads[i], lead_to(i, lo));
    Plan p = simulate(modules, o, placements, true, nullptr, &limits, &trial);
    if (p.predicted_step_seconds() <= best.predicted_step_seconds() + tolerance) {
      leads = std::move(trial);
      best = std::move(p);
    }
  }
  return best;
}

}  // namespace detail

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

  struct Trial {
    double stall = 0;
    uint64_t peak = 0;
    double area = 0;  // resident bytes summed over module boundaries
    // Better than `o`: a lower peak, or the same peak with less held (a
    // module that lowers the forward's level may let a later one lower the
    // peak; the prune below undoes what never did).
    bool below(const Trial& o) const { return peak < o.peak || (peak == o.peak && area < o.area); }
  };
  // Each reload with the lead that spans enough backward time (Note [Reload lead]).
  double area = 0;
  const auto run = [&] { return simulate(modules, o, placements, true, &area, &limits); };
  Trial base{0, run().peak_allocated_bytes, area};
  // Module i with the placements so far: its stall and the allocator's peak,
  // when it adds no stall, moves something, and (GPU) its copies end within
  // the forward or (worker path) its writes end before backward uses them
  // (else the live tensor answers and the write bought nothing).
  const auto fits = [&](size_t i) -> std::optional<Trial> {
    const Plan trial = run();
    const bool in_time = o.writes_within_forward
                             ? trial.modules[i].write_done_seconds <= trial.forward_seconds + tolerance
                             : trial.modules[i].forwarded_bytes == 0;
    if (!in_time || trial.predicted_stall_seconds > base.stall + tolerance || trial.modules[i].offload_bytes == 0)
      return std::nullopt;
    return Trial{trial.predicted_stall_seconds, trial.peak_allocated_bytes, area};
  };
  for (size_t i = 0; i < candidates; ++i) {
    const uint64_t bytes = modules[i].bytes;
    if (bytes == 0) continue;  // nothing to move
    // Note [Offload for the peak]: per tier, the largest part of the module
    // that fits, then the part of it with the lowest peak; the first tier
    // whose whole module lowers the peak most wins, else the lowest peak (the
    // earlier tier at an equal one; Note [Prefix or another tier whole]).
    struct Choice {
      Placement tier = Placement::kKeep;
      uint64_t limit = kWholeModule;
      Trial t;
    } best;
    const uint64_t resolution = std::max<uint64_t>(1, bytes >> 10);
    for (Placement tier : order) {
      if (tier == Placement::kOffloadSsd && !ssd_usable) continue;
      if (tier == Placement::kOffloadCpu && !cpu_usable) continue;
      const uint64_t room = tier == Placement::kOffloadCpu ? host_left : kWholeModule;
      if (room < bytes && !o.partial_offload) continue;
      placements[i] = tier;
      limits[i] = kWholeModule;
      std::optional<Trial> top;
      uint64_t top_limit = kWholeModule;
      if (room >= bytes) top = fits(i);
      if (!top && o.partial_offload) {
        // Note [Partial offload]: the largest prefix that fits, to within
        // 1/1024 of the module (the stall, the copies' end and the copy
        // bound's wait all grow with the prefix).
        uint64_t lo = 0, hi = std::min(bytes - 1, room);
        limits[i] = hi;
        if (hi > 0 && (top = fits(i))) lo = hi;
        while (hi - lo > resolution) {
          const uint64_t mid = lo + (hi - lo) / 2;
          limits[i] = mid;
          if (const auto t = fits(i)) {
            lo = mid;
            top = t;
          } else {
            hi = mid;
          }
        }
        top_limit = lo;
      }
      if (!top) continue;
      Choice c{tier, top_limit, *top};
      if (o.partial_offload) {
        // The prefix with the lowest peak (Note [Offload for the peak]): a
        // prefix whose copies end after the last release point before the
        // peak is still held there, so the peak falls with the prefix, then
        // jumps back. Sampled, then the largest prefix before the jump.
        const uint64_t span = top_limit == kWholeModule ? bytes : top_limit;
        constexpr uint64_t kSamples = 16;
        uint64_t at = span, step = std::max<uint64_t>(1, span / kSamples);
        for (uint64_t k = 1; k < kSamples; ++k) {
          limits[i] = k * step;
          const auto t = fits(i);
          if (t && t->below(c.t)) {
            c = Choice{tier, limits[i], *t};
            at = limits[i];
          }
        }
        uint64_t lo = at, hi = std::min(span, at + step);
        while (at != span && hi - lo > resolution) {
          const uint64_t mid = lo + (hi - lo) / 2;
          limits[i] = mid;
          const auto t = fits(i);
          if (t && t->peak <= c.t.peak) {
            lo = mid;
            c = Choice{tier, mid, *t};
          } else {
            hi = mid;
          }
        }
      }
      if (!c.t.below(base)) continue;
      if (c.limit == kWholeModule || c.limit >= bytes) {
        best = c;
        break;
      }
      if (best.tier == Placement::kKeep || c.t.below(best.t)) best = c;
    }
    placements[i] = best.tier;
    limits[i] = best.tier == Placement::kKeep || best.limit >= bytes ? kWholeModule : best.limit;
    const bool placed = best.tier != Placement::kKeep;
    if (placed) {
      base = best.t;
      if (best.tier == Placement::kOffloadCpu) host_left -= std::min(bytes, best.limit);
    }
    // Whole modules: the first one no tier takes ends the walk. With partial
    // offload a later module may still fit where this one did not (the copy
    // bound drains, a smaller module), so the walk goes on.
    if (!placed && !o.partial_offload) break;
  }
  // The prune: from the last module moved back, a module whose move lowers
  // neither the peak nor the stall goes back to the device (it only took
  // the link: Note [Offload for the peak]).
  const Plan all = run();
  uint64_t peak = all.peak_allocated_bytes;
  double stall = all.predicted_stall_seconds;
  for (size_t i = candidates; i-- > 0;) {
    if (placements[i] == Placement::kKeep) continue;
    const Placement was = placements[i];
    const uint64_t was_limit = limits[i];
    placements[i] = Placement::kKeep;
    limits[i] = kWholeModule;
    const Plan without = run();
    if (without.peak_allocated_bytes <= peak && without.predicted_stall_seconds <= stall + tolerance) {
      peak = without.peak_allocated_bytes;
      stall = without.predicted_stall_seconds;
    } else {
      placements[i] = was;
      limits[i] = was_limit;
    }
  }
  return run();
}

}  // namespace

// Note [Tier order]
// Host memory is the tier in front of the SSD: the walk fills it first (no
// SSD wear, fastest reloads). With a small budget that can cost offload: the
// early modules, whose writes have the most compute to hide behind, would
// serve the SSD best. So with both tiers the walk also runs SSD-first, and
// that plan wins only when its peak is strictly lower.
Plan plan_offload(const std::vector<ModuleProfile>& modules, const PlannerOptions& o) {
  validate(modules, o);
  Plan plan = plan_greedy(modules, o, {Placement::kOffloadCpu, Placement::kOffloadSsd});
  if (plan.bytes_cpu != 0 && plan.bytes_keep != 0) {
    Plan ssd_first = plan_greedy(modules, o, {Placement::kOffloadSsd, Placement::kOffloadCpu});
    if (ssd_first.peak_allocated_bytes < plan.peak_allocated_bytes) plan = std::move(ssd_first);
  }
  const auto placements = placements_of(plan);
  const auto limits = limits_of(plan);
  return detail::refine_leads(modules, o, placements, limits, std::move(plan));
}


}  // namespace ebbtide::plan
