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
// With a budget B each module takes one of keep, offload_cpu, offload_ssd,
// recompute, recompute_offload (cpu or ssd), and the plan minimises the
// predicted step time T = forward + backward + recompute + stall subject to
// the predicted peak P <= B, both from the step model (Note [Step model] in
// step_model.cpp): a recomputed module saves only its recompute_bytes in
// forward (offloaded like any module's bytes under recompute_offload) and
// re-makes its activations at the start of its backward. P is the peak of
// saved bytes for activation_budget_bytes, the allocator's (saves,
// reloads, gradients, temporaries) for peak_budget_bytes, both with both
// (Bound). The allocator's peak is where keeping pays: the last blocks'
// activations are freed early in backward, before the gradients have grown,
// so keeping them may cost no peak at all. Recompute costs compute the step
// always pays; offload costs only the stall the links cannot hide; so:
// 1. Start from plan_offload (what the links hide is free), and again from
//    full recompute (every recomputable module; budgets near its peak are
//    met at once), and keep the faster feasible result: a budget full
//    recompute meets is never slower than it.
// 2. While P > B, descend: try every change of one module's placement and
//    take the one that lowers the peak most per second of T it adds (a change
//    that lowers it for nothing first). A change that leaves the peak equal
//    but lowers the sum of resident bytes over the scan's points counts a
//    little, so two equal peaks (say forward end and a backward start) can be
//    lowered one after the other. If no change lowers anything, B is below
//    what this planner can reach: feasible = false, min_budget_bytes (and
//    min_peak_budget_bytes) = the lowest peak found, and step 3 runs with
//    that peak as the bound.
// 3. Polish: try every single change again and take the one that lowers T
//    most with P <= B; at equal T (within float slack), the one that moves
//    fewer bytes over the links. This undoes the descent's overshoot and
//    keeps what need not move (less SSD wear).
// Reloads take the lead that spans enough backward time (Note [Reload
// lead]) throughout, made explicit at the end.
// The peak is predicted at the measured rates. A write that runs slower
// frees its memory later; the cache then holds the budget by making saves
// wait for the writes (Note [Budget guard] in ebbtide/cache/adaptive.py), which
// costs stall, not memory.
// Offload changes follow plan_offload's limits: none for the last
// keep_last_modules, the host tier within host_budget_bytes, and on a GPU
// (writes_within_forward) every write done by the end of forward.
// Each round simulates at most 5 changes per module, each an O(saves) step
// model; rounds are bounded by 8n per phase (test_plan_planner.cpp,
// bench/planner_bench.py).
namespace {

struct Candidate {
  std::vector<Placement> placements;
  std::vector<uint64_t> limits;  // Note [Partial offload]; a changed module moves whole
  Plan plan;
  double area = 0;
};

// The peak a budget bounds (Note [Budget plan]): saved bytes for
// activation_budget_bytes, the allocator's for peak_budget_bytes; with both,
// the saved peak scaled to the allocator bound, so that one number fits
// `bound()` exactly when both fit.
struct Bound {
  uint64_t saved = 0, alloc = 0;
  uint64_t peak(const Plan& p) const {
    if (alloc == 0) return p.peak_resident_bytes;
    if (saved == 0) return p.peak_allocated_bytes;
    const double scaled = static_cast<double>(p.peak_resident_bytes) * static_cast<double>(alloc) /
                          static_cast<double>(saved);
    return std::max(p.peak_allocated_bytes, static_cast<uint64_t>(std::ceil(scaled)));
  }
  uint64_t bound() const { return alloc != 0 ? alloc : saved; }
};

class BudgetSearch {
 public:
  BudgetSearch(const std::vector<ModuleProfile>& modules, const PlannerOptions& o, Bound bound)
      : modules_(modules), o_(o), bound_(bound) {
    const size_t n = modules.size();
    candidates_ = n - std::min(n, static_cast<size_t>(o.keep_last_modules));
    ssd_ = ssd_write_rate(o) > 0 && o.read_bps > 0;
    cpu_ = o.host_budget_bytes > 0 && o.host_write_bps > 0 && o.host_read_bps > 0;
    double f = 0;
    for (const auto& m : modules) f += m.forward_seconds;
    slack_ = 1e-9 * f * (1 + o.backward_factor) + o.stall_tolerance_seconds;
  }

  uint64_t peak(const Plan& p) const { return bound_.peak(p); }

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
    const uint64_t p0 = peak(cur.plan);
    for_each_change(cur, [&](Candidate c) {
      double gain = 0;
      const uint64_t p1 = peak(c.plan);
      if (p1 < p0)
        gain = static_cast<double>(p0 - p1);
      else if (p1 == p0 && c.area < cur.area)
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
      if (peak(c.plan) > budget || !before(c.plan, cur.plan)) return;
      if (!best || before(c.plan, best->plan)) best = std::move(c);
    });
    if (!best) return false;
    cur = std::move(*best);
    return true;
  }

 private:
  const std::vector<ModuleProfile>& modules_;
  const PlannerOptions& o_;
  Bound bound_;
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

// Note [Budget plan]'s search: from `start`, descend in `descent`'s timing
// model, then polish in `polish`'s.
Fit fit_budget(const std::vector<ModuleProfile>& modules, std::vector<Placement> start, std::vector<uint64_t> limits,
               const BudgetSearch& descent, const BudgetSearch& polish, uint64_t budget) {
  Candidate cur = descent.evaluate(std::move(start), std::move(limits));
  const size_t rounds = 8 * modules.size() + 8;
  for (size_t r = 0; r < rounds && descent.peak(cur.plan) > budget; ++r) {
    if (!descent.descend(cur)) break;
  }
  if (&descent != &polish) cur = polish.evaluate(std::move(cur.placements), std::move(cur.limits));
  Fit fit;
  fit.feasible = polish.peak(cur.plan) <= budget;
  // Infeasible: the fastest plan at the lowest peak found.
  fit.bound = fit.feasible ? budget : polish.peak(cur.plan);
  for (size_t r = 0; r < rounds; ++r) {
    if (!polish.polish(cur, fit.bound)) break;
  }
  fit.best = std::move(cur);
  return fit;
}

// The placements and limits of plan_offload under `o`: the search's first start.
void offload_start(const std::vector<ModuleProfile>& modules, const PlannerOptions& o, std::vector<Placement>& start,
                   std::vector<uint64_t>& limits) {
  for (const auto& d : plan_offload(modules, o).modules) {
    start.push_back(d.placement);
    limits.push_back(d.partial() ? d.offload_bytes : kWholeModule);
  }
}

// The better of two fits: the feasible one, the faster of two feasible ones,
// the lower peak of two infeasible ones.
bool better(const Fit& a, const Fit& b) {
  if (a.feasible != b.feasible) return a.feasible;
  if (a.feasible) return a.best.plan.predicted_step_seconds() < b.best.plan.predicted_step_seconds();
  return a.bound < b.bound;
}

}  // namespace

// Note [Budget plan], the starts: the search descends from plan_offload's
// plan, and also from full recompute (every module that can be recomputed
// is), where budgets near full recompute's peak are met at once; the polish
// then keeps what the allocator's peak allows (the last blocks, whose
// activations backward frees before the gradients have grown). The faster
// feasible plan wins, so a budget full recompute meets is never slower than it.
Plan plan_budget(const std::vector<ModuleProfile>& modules, const PlannerOptions& o) {
  validate(modules, o);
  const Bound bound{o.activation_budget_bytes, o.peak_budget_bytes};
  const uint64_t budget = bound.bound();
  if (budget == 0) return plan_offload(modules, o);
  BudgetSearch search(modules, o, bound);
  std::vector<Placement> start;
  std::vector<uint64_t> limits;
  offload_start(modules, o, start, limits);
  Fit fit = fit_budget(modules, start, limits, search, search, budget);
  {
    std::vector<Placement> all(modules.size(), Placement::kKeep);
    bool any = false;
    for (size_t i = 0; i < modules.size(); ++i)
      if (modules[i].recomputable) all[i] = Placement::kRecompute, any = true;
    if (any) {
      Fit alt = fit_budget(modules, std::move(all), std::vector<uint64_t>(modules.size(), kWholeModule), search,
                           search, budget);
      if (better(alt, fit)) fit = std::move(alt);
    }
  }
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
    BudgetSearch strict_search(modules, strict, bound);
    std::vector<Placement> s2;
    std::vector<uint64_t> l2;
    offload_start(modules, strict, s2, l2);
    Fit alt = fit_budget(modules, std::move(s2), std::move(l2), strict_search, search, budget);
    if (better(alt, fit)) fit = std::move(alt);
  }
  Plan plan = detail::refine_leads(modules, o, fit.best.placements, fit.best.limits, std::move(fit.best.plan));
  plan.activation_budget_bytes = o.activation_budget_bytes;
  plan.peak_budget_bytes = o.peak_budget_bytes;
  plan.feasible = fit.feasible;
  plan.min_budget_bytes = fit.feasible || o.activation_budget_bytes == 0 ? 0 : plan.peak_resident_bytes;
  plan.min_peak_budget_bytes = fit.feasible || o.peak_budget_bytes == 0 ? 0 : plan.peak_allocated_bytes;
  return plan;
}

}  // namespace ebbtide::plan
