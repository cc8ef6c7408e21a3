// The budget plan (Note [Budget plan]): keep, offload or recompute per module
// under an activation budget, searched on the timing model of planner.cpp.
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "ebbtide/plan/planner.hpp"
#include "ebbtide/util/error.hpp"
#include "planner_impl.hpp"

namespace ebbtide::plan {

using detail::simulate;
using detail::ssd_write_rate;
using detail::validate;

// Note [Budget plan]
// With activation_budget_bytes B each module takes one of keep, offload_cpu,
// offload_ssd, recompute, recompute_offload (cpu or ssd), and the plan
// minimises the predicted step time T = forward + backward + recompute +
// stall subject to the predicted peak P <= B, both from the timing model of
// Note [Offload rule]: a recomputed module saves only its recompute_bytes in
// forward (offloaded like any module's bytes under recompute_offload) and
// re-runs its forward at the start of its backward, holding all its bytes
// then. Recompute costs compute the step always pays; offload costs only the
// stall the links cannot hide; so:
// 1. Start from plan_offload: what the links hide is free.
// 2. While P > B, descend: try every change of one module's placement and
//    take the one that lowers the peak most per second of T it adds (a change
//    that lowers it for nothing first). A change that leaves the peak equal
//    but lowers the sum of resident bytes over the scan's points counts a
//    little, so two equal peaks (say forward end and a backward start) can be
//    lowered one after the other. If no change lowers anything, B is below
//    what this planner can reach: feasible = false, min_budget_bytes = the
//    lowest peak found, and step 3 runs with that peak as the bound.
// 3. Polish: try every single change again and take the one that lowers T
//    most with P <= B; at equal T (within float slack), the one that moves
//    fewer bytes over the links. This undoes the descent's overshoot and
//    keeps what need not move (less SSD wear).
// The peak is predicted at the measured rates. A write that runs slower
// frees its memory later; the cache then holds the budget by making saves
// wait for the writes (Note [Budget guard] in ebbtide/cache/adaptive.py), which
// costs stall, not memory.
// Offload changes follow plan_offload's limits: none for the last
// keep_last_modules, the host tier within host_budget_bytes, and on a GPU
// (writes_within_forward) every write done by the end of forward.
// Each round simulates at most 5 changes per module, O(n^2) each (the peak
// scan); rounds are bounded by 8n per phase. 80 modules plan in well under a
// second (test_plan_planner.cpp, bench/planner_bench.py).
namespace {

struct Candidate {
  std::vector<Placement> placements;
  std::vector<uint64_t> limits;  // Note [Partial offload]; a changed module moves whole
  Plan plan;
  double area = 0;
};

class BudgetSearch {
 public:
  BudgetSearch(const std::vector<ModuleProfile>& modules, const PlannerOptions& o) : modules_(modules), o_(o) {
    const size_t n = modules.size();
    candidates_ = n - std::min(n, static_cast<size_t>(o.keep_last_modules));
    ssd_ = ssd_write_rate(o) > 0 && o.read_bps > 0;
    cpu_ = o.host_budget_bytes > 0 && o.host_write_bps > 0 && o.host_read_bps > 0;
    double f = 0;
    for (const auto& m : modules) f += m.forward_seconds;
    slack_ = 1e-9 * f * (1 + o.backward_factor) + o.stall_tolerance_seconds;
  }

  Candidate evaluate(std::vector<Placement> placements, std::vector<uint64_t> limits) const {
    Candidate c;
    c.plan = simulate(modules_, o_, placements, true, &c.area, &limits);
    c.placements = std::move(placements);
    c.limits = std::move(limits);
    return c;
  }

  // Placements module i may take.
  std::vector<Placement> options(size_t i) const {
    std::vector<Placement> out{Placement::kKeep};
    const ModuleProfile& m = modules_[i];
    const bool offloadable = i < candidates_;
    if (offloadable && m.bytes > 0) {
      if (cpu_) out.push_back(Placement::kOffloadCpu);
      if (ssd_) out.push_back(Placement::kOffloadSsd);
    }
    if (m.recomputable) {
      out.push_back(Placement::kRecompute);
      if (offloadable && m.recompute_bytes > 0) {
        if (cpu_) out.push_back(Placement::kRecomputeOffloadCpu);
        if (ssd_) out.push_back(Placement::kRecomputeOffloadSsd);
      }
    }
    return out;
  }

  bool allowed(const Plan& p) const {
    if (p.bytes_cpu > o_.host_budget_bytes) return false;
    if (!std::isfinite(p.predicted_stall_seconds)) return false;
    if (o_.writes_within_forward) {
      for (const auto& d : p.modules)
        if (is_offload(d.placement) && d.write_done_seconds > p.forward_seconds + slack_) return false;
    }
    return true;
  }

  // Calls visit(candidate) for every allowed plan one module's change away from `cur`.
  template <class Visit>
  void for_each_change(const Candidate& cur, Visit&& visit) const {
    for (size_t i = 0; i < modules_.size(); ++i) {
      for (Placement p : options(i)) {
        if (p == cur.placements[i]) continue;
        std::vector<Placement> trial = cur.placements;
        std::vector<uint64_t> limits = cur.limits;
        trial[i] = p;
        limits[i] = kWholeModule;
        Candidate c = evaluate(std::move(trial), std::move(limits));
        if (allowed(c.plan)) visit(std::move(c));
      }
    }
  }

  // One descent round: the best change that lowers the peak (or, at an
  // equal peak, the resident area); false when none does.
  bool descend(Candidate& cur) const {
    const double t0 = cur.plan.predicted_step_seconds();
    std::optional<Candidate> best;
    double best_score = 0;
    bool best_free = false;
    for_each_change(cur, [&](Candidate c) {
      double gain = 0;
      if (c.plan.peak_resident_bytes < cur.plan.peak_resident_bytes)
        gain = static_cast<double>(cur.plan.peak_resident_bytes - c.plan.peak_resident_bytes);
      else if (c.plan.peak_resident_bytes == cur.plan.peak_resident_bytes && c.area < cur.area)
        gain = 1e-3 * (cur.area - c.area);
      if (gain <= 0) return;
      const double dt = c.plan.predicted_step_seconds() - t0;
      const bool free = dt <= slack_;
      const double score = free ? gain : gain / dt;
      if (!best || (free && !best_free) || (free == best_free && score > best_score)) {
        best_score = score;
        best_free = free;
        best = std::move(c);
      }
    });
    if (!best) return false;
    cur = std::move(*best);
    return true;
  }

  // One polish round: the change that lowers T most with P <= budget (at
  // equal T, fewer bytes moved); false when none does.
  bool polish(Candidate& cur, uint64_t budget) const {
    const auto moved = [](const Plan& p) { return p.bytes_cpu + p.bytes_ssd; };
    // a before b: faster, or as fast (within float slack) and moving fewer bytes.
    const auto before = [&](const Plan& a, const Plan& b) {
      const double ta = a.predicted_step_seconds(), tb = b.predicted_step_seconds();
      return ta < tb - slack_ || (ta <= tb + slack_ && moved(a) < moved(b));
    };
    std::optional<Candidate> best;
    for_each_change(cur, [&](Candidate c) {
      if (c.plan.peak_resident_bytes > budget || !before(c.plan, cur.plan)) return;
      if (!best || before(c.plan, best->plan)) best = std::move(c);
    });
    if (!best) return false;
    cur = std::move(*best);
    return true;
  }

 private:
  const std::vector<ModuleProfile>& modules_;
  const PlannerOptions& o_;
  size_t candidates_ = 0;
  bool ssd_ = false;
  bool cpu_ = false;
  double slack_ = 0;
};

}  // namespace

namespace {

struct Fit {
  Candidate best;
  bool feasible = false;
  uint64_t bound = 0;  // the budget, or (infeasible) the lowest peak found
};

// Note [Budget plan]'s search: from plan_offload under `start_options`,
// descend in `descent`'s timing model, then polish in `polish`'s.
Fit fit_budget(const std::vector<ModuleProfile>& modules, const PlannerOptions& start_options,
               const BudgetSearch& descent, const BudgetSearch& polish, uint64_t budget) {
  std::vector<Placement> start;
  std::vector<uint64_t> limits;
  for (const auto& d : plan_offload(modules, start_options).modules) {
    start.push_back(d.placement);
    limits.push_back(d.partial() ? d.offload_bytes : kWholeModule);
  }
  Candidate cur = descent.evaluate(std::move(start), std::move(limits));
  const size_t rounds = 8 * modules.size() + 8;
  for (size_t r = 0; r < rounds && cur.plan.peak_resident_bytes > budget; ++r) {
    if (!descent.descend(cur)) break;
  }
  if (&descent != &polish) cur = polish.evaluate(std::move(cur.placements), std::move(cur.limits));
  Fit fit;
  fit.feasible = cur.plan.peak_resident_bytes <= budget;
  // Infeasible: the fastest plan at the lowest peak found.
  fit.bound = fit.feasible ? budget : cur.plan.peak_resident_bytes;
  for (size_t r = 0; r < rounds; ++r) {
    if (!polish.polish(cur, fit.bound)) break;
  }
  fit.best = std::move(cur);
  return fit;
}

}  // namespace

Plan plan_budget(const std::vector<ModuleProfile>& modules, const PlannerOptions& o) {
  validate(modules, o);
  const uint64_t budget = o.activation_budget_bytes;
  if (budget == 0) return plan_offload(modules, o);
  BudgetSearch search(modules, o);
  Fit fit = fit_budget(modules, o, search, search, budget);
  if (o.guarded_writes) {
    // Note [Guarded writes]: with the guard any offload fits the forward at
    // the cost of waits, which changes the descent's path and where it
    // stops; a greedy descent stops at a local optimum either way. The
    // descent in the model without the guard is tried too, polished in the
    // guarded model; the faster plan (or, neither fitting, the lower peak)
    // wins (PlanBudget.GuardedWritesAlsoDescendWithoutTheGuard: 0.842 s
    // predicted alone, 0.834 s with both).
    PlannerOptions strict = o;
    strict.guarded_writes = false;
    BudgetSearch strict_search(modules, strict);
    Fit alt = fit_budget(modules, strict, strict_search, search, budget);
    const bool better =
        alt.feasible != fit.feasible
            ? alt.feasible
            : (alt.feasible ? alt.best.plan.predicted_step_seconds() < fit.best.plan.predicted_step_seconds()
                            : alt.bound < fit.bound);
    if (better) fit = std::move(alt);
  }
  Plan plan = std::move(fit.best.plan);
  plan.activation_budget_bytes = budget;
  plan.feasible = fit.feasible;
  plan.min_budget_bytes = fit.feasible ? 0 : fit.bound;
  return plan;
}

}  // namespace ebbtide::plan
