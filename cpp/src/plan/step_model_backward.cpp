// The step model's backward (Note [Step model] in step_model.cpp): reloads,
// the prefetch walk and its leads, and the plan's figures.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "planner_impl.hpp"
#include "step_model_impl.hpp"

namespace ebbtide::plan::detail {

double StepSim::lead_of(const Storage& x) const {
  if (leads_ != nullptr && !leads_->empty() && (*leads_)[x.lead_module] > 0)
    return static_cast<double>((*leads_)[x.lead_module]);
  if (o_.lead_per_module && asap_) return kInf;
  if (o_.lead_per_module && auto_leads_[x.lead_module] > 0) return auto_leads_[x.lead_module];
  return window_;
}

bool StepSim::loadable_now(const Storage& x, double now) const {
  if (!x.entry || x.cancelled || x.loading || x.consumed || x.consumed_walks) return false;
  return device_ ? x.released : x.write_end <= now;
}

void StepSim::issue_load(size_t s, double now, bool priority) {
  Storage& x = st_[s];
  x.loading = true;
  x.load_issue = now;
  window_used_ += static_cast<double>(x.bytes);
  alloc(x.bytes);
  ModuleDecision& d = plan_.modules[x.owner];
  if (d.read_start_seconds == 0 || now < d.read_start_seconds) d.read_start_seconds = now;
  double ready = now;
  if (x.tier == 1) {
    // From the SSD first (the workers), once written.
    const double rs = std::max({now, read_free_[1], x.write_end});
    read_free_[1] = rs + rate_time(x.bytes, read_rate_[1]);
    ready = read_free_[1];
    if (!device_) {
      x.load_end = ready;
      return;
    }
  }
  if (device_) {
    double& queue = priority ? priority_free_ : load_free_;
    const double start = std::max(ready, queue);
    const double span = read_rate_[0] > 0 ? rate_time(x.bytes, read_rate_[0]) : 0.0;
    x.load_end = start + span;
    queue = x.load_end;
    // The two streams share the link: a priority load delays the queued ones by its time.
    if (priority && load_free_ > start) load_free_ += span;
  } else {
    const double start = std::max({now, read_free_[0], x.write_end});
    read_free_[0] = start + rate_time(x.bytes, read_rate_[0]);
    x.load_end = read_free_[0];
  }
}

void StepSim::walk(size_t end, double now, size_t module) {
  const double cum_end = cum_[end];
  // Only the entries not yet loading or used (pending_), from `end` down.
  for (auto it = pending_.lower_bound(end); it != pending_.begin();) {
    const size_t p = *--it;
    const double dist = cum_end - cum_[p];
    const bool adjacent = cum_end - cum_[p + 1] <= 0;
    if (dist > max_lead_ && !adjacent) break;
    Storage& x = st_[positions_[p].storage];
    if (!loadable_now(x, now)) continue;
    if (x.alive) {
      // Note [Originals still alive]: a kept holder still holds it. The
      // rules before 2026-11-29 offered it to no later walk of the step.
      if (!o_.shared_at_last_user) x.consumed_walks = true;
      continue;
    }
    if (dist > lead_of(x) && !adjacent) continue;
    if (window_used_ + static_cast<double>(x.bytes) > window_) break;
    // A load for the module whose backward runs is needed now: it takes
    // the priority stream rather than queue behind the others (the cache's
    // Entry::urgent, Note [Priority loads]).
    issue_load(positions_[p].storage, now, o_.priority_loads && p >= module_begin_[module]);
    it = pending_.erase(it);
  }
}

void StepSim::backward() {
  cum_.assign(positions_.size() + 1, 0.0);
  for (size_t p = 0; p < positions_.size(); ++p) cum_[p + 1] = cum_[p] + static_cast<double>(positions_[p].bytes);
  compute_auto_leads();
  pending_.clear();
  for (size_t p = 0; p < positions_.size(); ++p) {
    const size_t st = positions_[p].storage;
    if (st != kNone && st_[st].order_pos == p && st_[st].entry) pending_.insert(p);
  }
  max_lead_ = 0;
  for (const auto& x : st_)
    if (x.entry) max_lead_ = std::max(max_lead_, lead_of(x));
  double t = t_;
  double compute_backward = 0;
  for (size_t i = n_; i-- > 0;) {
    ModuleDecision& d = plan_.modules[i];
    const double bs = t;
    at(bs);
    d.backward_start_seconds = bs;
    walk(module_end_[i], bs, i);
    const double g = backward_of(i);
    compute_backward += g;
    const double rec = is_recompute(d.placement) ? d.recompute_seconds : 0.0;
    uint64_t remade = 0;
    if (is_recompute(d.placement)) {
      remade = m_[i].bytes + m_[i].fixed_bytes;
      alloc(remade);
    }
    // Its gradients grow as its saves are used and freed, through its
    // backward (the level peaks at its start, with every save and the
    // temporaries, or at its end, with every gradient).
    note_peak(m_[i].backward_temp_bytes);
    area_ += saved_;
    double waited = 0;
    const double grads = static_cast<double>(m_[i].grad_bytes);
    double grads_made = 0;
    const auto& saves = saves_[i];
    for (auto it = saves.rbegin(); it != saves.rend(); ++it) {
      Storage& x = st_[it->storage];
      // A recomputed module needs its inputs before its forward runs again.
      const double use = (is_recompute(d.placement) ? bs : bs + g * (1.0 - it->at)) + waited;
      at(use);
      const double due = grads * std::clamp(1.0 - it->at, 0.0, 1.0);
      if (due > grads_made) {
        alloc(static_cast<uint64_t>(due - grads_made), false);
        grads_made = static_cast<double>(static_cast<uint64_t>(due - grads_made)) + grads_made;
      }
      const bool is_entry_use = (it->role == SaveEvent::kNewOffload || it->role == SaveEvent::kCoreRef) && x.entry;
      if (!is_entry_use) {
        // A kept save: its tensor goes once autograd has used it.
        if (it->role != SaveEvent::kCoreRef) {
          x.kept_holders -= 1;
          maybe_free(it->storage);
        }
        continue;
      }
      if (x.alive && x.kept_holders == 0 && x.core_left == static_cast<int>(x.core_users.size())) {
        // Its write had not ended: the live tensor answers (Note [Late stores]).
        plan_.modules[x.owner].forwarded_bytes += x.bytes;
        x.cancelled = true;
      }
      if (!x.alive) {
        if (!x.loading && !x.consumed) {
          issue_load(it->storage, use, o_.priority_loads);
          pending_.erase(x.order_pos);
        }
        if (x.load_end > use) {
          waited += x.load_end - use;
          at(x.load_end);
        }
      }
      x.core_left -= 1;
      const double now = use + std::max(0.0, x.load_end - use);
      // The unpack's walk (the cache's prefetch from the entry: Note
      // [Prefetch distance]) runs before the use, while its buffer is held.
      if (x.order_pos != kNone) walk(x.order_pos, now, i);
      if (x.core_left == 0) {
        x.consumed = true;
        if (x.loading) {
          window_used_ -= static_cast<double>(x.bytes);
          release_memory(x.bytes);  // the reload buffer, once used
        }
        if (x.cancelled) free_original(it->storage);
      }
    }
    d.wait_seconds = waited;
    plan_.backward_wait_seconds += waited;
    t = bs + rec + g + waited;
    at(t);
    // The module's backward ends: its re-made activations go, every gradient is made.
    if (remade > 0) release_memory(remade);
    if (grads > grads_made) alloc(static_cast<uint64_t>(grads - grads_made), false);
    note_peak(m_[i].backward_temp_bytes);
  }
  plan_.backward_seconds = compute_backward;

}

void StepSim::compute_auto_leads() {
  auto_leads_.assign(n_, 0.0);
  if (!o_.lead_per_module) return;
  std::vector<double> start(n_ + 1, t_);  // start[i]: nominal backward start of module i
  for (size_t i = n_; i-- > 0;) {
    const double rec = is_recompute(plan_.modules[i].placement) ? plan_.modules[i].recompute_seconds : 0.0;
    start[i] = (i + 1 < n_ ? start[i + 1] + backward_of(i + 1) + rec_of(i + 1) : t_);
    (void)rec;
  }
  double next_start[2] = {kInf, kInf};  // per queue: the start of the reload served after
  for (size_t i = 0; i < n_; ++i) {
    const ModuleDecision& d = plan_.modules[i];
    if (!is_offload(d.placement) || d.offload_bytes == 0) continue;
    const int tier = tier_of(d.placement);
    const int q = device_ ? 0 : tier;
    double need = rate_time(d.offload_bytes, device_ ? read_rate_[0] : read_rate_[tier]);
    if (tier == 1 && device_) need += rate_time(d.offload_bytes, read_rate_[1]);
    const double finish = std::min(start[i], next_start[q]);
    const double begin = finish - need;
    next_start[q] = begin;
    // The last boundary at or before `begin`: module j's backward start.
    size_t j = i;
    while (j + 1 < n_ && start[j] > begin) ++j;
    auto_leads_[i] = cum_[module_end_[j]] - cum_[module_begin_[i]];
  }
}

double StepSim::rec_of(size_t i) const {
  return is_recompute(plan_.modules[i].placement) ? plan_.modules[i].recompute_seconds : 0.0;
}

void StepSim::finish() {
  plan_.forward_seconds = compute_forward_;
  plan_.predicted_stall_seconds = plan_.forward_wait_seconds + plan_.backward_wait_seconds;
  plan_.peak_resident_bytes = static_cast<uint64_t>(std::max(0.0, peak_saved_));
  plan_.peak_allocated_bytes = static_cast<uint64_t>(std::max(0.0, peak_alloc_));
  for (size_t i = 0; i < n_; ++i) {
    ModuleDecision& d = plan_.modules[i];
    if (!is_offload(d.placement)) continue;
    if (leads_ != nullptr && !leads_->empty() && (*leads_)[i] > 0)
      d.lead_bytes = (*leads_)[i];
    else if (o_.lead_per_module && asap_)
      d.lead_bytes = plan_.window_bytes;
    else if (o_.lead_per_module && auto_leads_[i] > 0)
      d.lead_bytes = static_cast<uint64_t>(auto_leads_[i]);
    else
      d.lead_bytes = plan_.window_bytes;
  }
}

Plan simulate(const std::vector<ModuleProfile>& modules, const PlannerOptions& o,
              const std::vector<Placement>& placements, bool /*with_peak*/, double* area,
              const std::vector<uint64_t>* limits, const std::vector<uint64_t>* leads,
              const std::vector<int64_t>* release_after, bool asap) {
  return StepSim(modules, o, placements, limits, leads, release_after, asap).run(area);
}

}  // namespace ebbtide::plan::detail
