// The step model (Note [Step model]): one training step played as the device
// and the tensor cache run it, for the planner's search and for replays of
// recorded runs. The forward and memory here; the backward and reloads in
// step_model_backward.cpp.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "planner_impl.hpp"
#include "step_model_impl.hpp"

namespace ebbtide::plan::detail {

// Note [Step model]
// The planner predicts a step by playing it: the compute stream runs each
// module's forward, then each module's backward in reverse order; the copy
// queues run beside it, and the memory the allocator holds is counted at
// every point of the compute stream's order. The same rules as the cache
// and the glue, stated once here:
// - Saves. A module's saves are made through its forward in save order, at
//   the fraction of its forward time their bytes reach (a profile without
//   its saves: `bytes` in kChunks even pieces). A save the plan offloads
//   (the first offload_bytes of the module's saves, Note [Partial offload])
//   queues its copy as it is made.
// - Copies on a GPU (writes_within_forward): one device-to-host queue at the
//   host tier's rate for both tiers, an SSD-tier save then written by the
//   workers at the SSD's rate. The device memory of a copied save comes back
//   at a release point: after each module, the saves whose copies are done
//   by then (the glue's rule, Note [Release points]), all of them when
//   backward begins (the compute stream waits for the copies still running);
//   and when more than copy_bound_bytes of copies are held ahead of the
//   compute stream, it waits for the oldest (Note [Copy bound]).
// - The worker path (host tensors, guarded_writes): one write queue per
//   tier; a save's memory comes back when its write ends, and under a budget
//   the forward waits while the queues hold more than the budget's slack
//   (Note [Guarded writes]). Writes not started when backward begins are
//   cancelled: the saves stay resident (Note [Late stores]).
// - Reloads follow the cache's prefetch (Note [Prefetch distance] in
//   tensor_cache_load.cpp, Note [Reload lead]): at each module's backward
//   start and at each unpack of an entry (before its use frees the buffer), the forward order is walked
//   back from the point backward has reached; an entry may start loading
//   when the bytes saved between (kept saves included) are within its lead,
//   and while the bytes loading or loaded stay within the window. Loads run
//   in the order issued on one queue per link; a reload buffer is allocated
//   when its load is issued and freed once backward has used it. With
//   priority_loads a load for the module whose backward runs, and one an
//   unpack makes on demand, take the priority stream (sharing the link: the
//   queued loads are delayed by its time), as the cache's do (Note
//   [Priority loads] in tensor_cache_device.cpp); else they queue behind
//   the others.
// - Backward of module i allocates its gradients (grad_bytes, held to the
//   step's end) and re-makes its activations first when it is recomputed;
//   its saves are used in reverse save order, through its backward time, and
//   the compute stream waits for a reload not yet done (backward_wait).
//   Its kept saves, reload buffers and re-made activations go at its end.
// - The allocator's level is every resident save, reload buffer, re-made
//   activation and gradient; at a module's forward end it also holds
//   forward_temp_bytes, in its backward backward_temp_bytes (the profile's
//   measured transients). peak_allocated_bytes is its maximum;
//   peak_resident_bytes the same without gradients and temporaries.
// The step's time is the compute stream's: the modules' forward, backward
// and recompute time, and every wait (predicted_stall_seconds).

// Note [Shared storages]
// A storage several modules save (the rotary cos/sin tables HF Llama passes
// to every block) is one allocation. The first module to save it decides:
// offloaded, it becomes an entry of the cache whose copy is released as any
// other; a later module that offloads joins that entry (a handle, the
// core's dedup), a later module that keeps holds the tensor itself (a kept
// handle) and so keeps the memory until its own backward ends. In backward
// a module that holds the entry uses the tensor while a kept holder still
// holds it (Note [Originals still alive]: no reload), else the reload. The
// entry sits in the forward order where its last offloading saver saved it
// (shared_at_last_user, the cache's rule: reloads come in the order
// backward needs them), and a prefetch walk skips it only while a kept
// holder holds it. Before 2026-11-29 it sat in its first saver's place, and
// a walk that found it held offered it to no later walk of the step, so the
// holders' unpack loaded it on demand behind the queued loads (12 ms on the
// H200's shape a); shared_at_last_user false replays those rules.

// Note [Reload lead]
// A reload started early holds device memory early: with the leads of a
// window of four blocks (the glue's default on a GPU), backward held the
// early blocks' reloads beside the late blocks' gradients, and offloading
// never lowered the backward's peak. So each offloaded module has a lead:
// its reloads may start once backward is within lead_bytes of saves of
// them. With lead_per_module the planner chooses the shortest lead that
// hides the reload: in the search, the lead that spans enough backward time
// of the modules above it for the reload at the link's rate; then, module
// by module from the last offloaded, the shortest module boundary whose
// step is no slower than loading as early as the window allows. A load made
// on demand (an entry the prefetch did not reach, or found held) runs on a
// priority stream of its own: behind queued prefetches it waited, on the
// H200's shape a, 12 ms for a 1 MiB table.

double rate_time(uint64_t bytes, double rate) {
  if (bytes == 0) return 0;
  return rate > 0 ? static_cast<double>(bytes) / rate : kInf;
}

// The earliest t' >= t at which the queues, each busy until w[k] draining at
// rate[k], hold at most `slack` bytes. Piecewise linear: solve on the tiers
// still busy, dropping the one that empties first when the root lies beyond it.
double drained_by(const double w[2], const double rate[2], double t, double slack) {
  for (;;) {
    double sum_wr = 0, sum_r = 0, first_empty = kInf;
    for (int k = 0; k < 2; ++k) {
      if (!(w[k] > t) || rate[k] <= 0) continue;
      if (!std::isfinite(w[k])) return kInf;
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

Plan StepSim::run(double* area) {
  plan_.replan_fraction = o_.replan_fraction;
  plan_.planned_write_bps = write_rate_[1];
  plan_.planned_read_bps = o_.read_bps;
  plan_.modules.resize(n_);
  build();
  module_begin_.assign(n_, 0);
  module_end_.assign(n_, 0);
  forward();
  backward();
  finish();
  if (area != nullptr) *area = area_;
  return std::move(plan_);
}

double StepSim::backward_of(size_t i) const {
  return m_[i].backward_seconds >= 0 ? m_[i].backward_seconds : o_.backward_factor * m_[i].forward_seconds;
}

size_t StepSim::new_storage(uint64_t bytes, size_t owner) {
  Storage s;
  s.bytes = bytes;
  s.owner = owner;
  st_.push_back(s);
  return st_.size() - 1;
}

void StepSim::build() {
  saves_.assign(n_, {});
  std::vector<size_t> shared_storage;  // shared id -> storage
  std::vector<bool> shared_entry_seen;
  for (size_t i = 0; i < n_; ++i) {
    const ModuleProfile& m = m_[i];
    ModuleDecision& d = plan_.modules[i];
    const Placement p = pl_[i];
    d.name = m.name;
    d.bytes = m.bytes;
    d.placement = p;
    d.saved_bytes = m.bytes;
    d.fixed_bytes = m.fixed_bytes;
    plan_.all_resident_bytes += m.bytes + m.fixed_bytes;
    if (is_recompute(p)) {
      d.fixed_bytes = 0;
      d.saved_bytes = m.recompute_bytes;
      d.recompute_seconds = m.recompute_seconds < 0 ? m.forward_seconds : m.recompute_seconds;
      plan_.recompute_seconds += d.recompute_seconds;
      const uint64_t all = m.bytes + m.fixed_bytes;
      plan_.bytes_recomputed += all > d.saved_bytes ? all - d.saved_bytes : 0;
      plan_.modules_recomputed += 1;
      if (m.recompute_bytes > 0) {
        // The block's inputs, saved as it begins.
        const size_t s = new_storage(m.recompute_bytes, i);
        saves_[i].push_back({s, 0.0, is_offload(p) ? SaveEvent::kNewOffload : SaveEvent::kNewKept});
        if (is_offload(p)) {
          st_[s].entry = true;
          st_[s].tier = tier_of(p);
          st_[s].core_users.push_back(i);
          d.offload_bytes = m.recompute_bytes;
        } else {
          st_[s].kept_holders = 1;
        }
      }
      continue;
    }
    const bool offload = is_offload(p);
    const uint64_t limit = !offload ? 0 : (limits_ == nullptr ? kWholeModule : (*limits_)[i]);
    uint64_t used = 0;
    bool reached = false;
    // Fractions of the module's forward by bytes, its own and held ones alike.
    std::vector<Save> list = m.saves;
    if (list.empty() && m.bytes > 0) {
      const uint64_t piece = std::max<uint64_t>(1, (m.bytes + kChunks - 1) / kChunks);
      for (uint64_t left = m.bytes; left > 0;) {
        const uint64_t b = std::min(piece, left);
        list.push_back({b, -1});
        left -= b;
      }
    }
    double total = static_cast<double>(m.fixed_bytes);
    for (const auto& s : list) total += static_cast<double>(s.bytes);
    double cum = 0;
    const bool fluid = m.saves.empty();  // synthesized pieces may split at the limit
    // Without a copy path (neither a GPU's nor the workers'), a module's
    // writes start when its activations are complete.
    const bool at_end = fluid && !o_.writes_within_forward && !o_.guarded_writes;
    for (const auto& s : list) {
      const double place = total > 0 ? (cum + static_cast<double>(s.bytes)) / total : 1.0;
      const double frac_end = at_end ? 1.0 : place;
      cum += static_cast<double>(s.bytes);
      if (s.shared >= 0) {
        const auto id = static_cast<size_t>(s.shared);
        if (id >= shared_storage.size()) shared_storage.resize(id + 1, kNone);
        const size_t have = shared_storage[id];
        if (have != kNone && st_[have].owner != i) {
          // A later module saving it: the entry's handle, or the tensor (Note [Shared storages]).
          Storage& sh = st_[have];
          if (offload && sh.entry) {
            saves_[i].push_back({have, frac_end, SaveEvent::kCoreRef, place});
            sh.core_users.push_back(i);
          } else {
            saves_[i].push_back({have, frac_end, SaveEvent::kKeptRef, place});
            sh.kept_holders += 1;
          }
          continue;
        }
        if (have != kNone) continue;  // saved again in the same module: the hooks dedup it
      }
      // A new storage: offloaded while the module's prefix lasts (Note
      // [Scope byte limits] in hooks.cpp), else kept.
      uint64_t bytes = s.bytes;
      bool move = offload && !reached && used + bytes <= limit;
      if (offload && !reached && !move && fluid && limit > used) {
        // A synthesized piece: split where the prefix ends.
        const uint64_t head = limit - used;
        const size_t a = new_storage(head, i);
        st_[a].entry = true;
        st_[a].tier = tier_of(p);
        st_[a].core_users.push_back(i);
        const double place_head = total > 0 ? (cum - static_cast<double>(bytes - head)) / total : 1.0;
        saves_[i].push_back({a, at_end ? 1.0 : place_head, SaveEvent::kNewOffload, place_head});
        used += head;
        bytes -= head;
      }
      if (!move) reached = offload;
      const size_t k = new_storage(bytes, i);
      if (move) {
        st_[k].entry = true;
        st_[k].tier = tier_of(p);
        st_[k].core_users.push_back(i);
        used += bytes;
      } else {
        st_[k].kept_holders = 1;
      }
      saves_[i].push_back({k, frac_end, move ? SaveEvent::kNewOffload : SaveEvent::kNewKept, place});
      if (s.shared >= 0) shared_storage[static_cast<size_t>(s.shared)] = k;
    }
    if (m.fixed_bytes > 0) {
      const size_t k = new_storage(m.fixed_bytes, i);
      st_[k].fixed = true;
      st_[k].kept_holders = 1;
      saves_[i].push_back({k, 1.0, SaveEvent::kNewKept});
    }
    if (offload) d.offload_bytes = used;
  }
  // Module byte counts of the plan.
  for (size_t i = 0; i < n_; ++i) {
    ModuleDecision& d = plan_.modules[i];
    plan_.bytes_keep += d.fixed_bytes;
    if (!is_offload(d.placement)) {
      plan_.bytes_keep += d.saved_bytes;
      continue;
    }
    plan_.bytes_keep += d.saved_bytes - std::min(d.saved_bytes, d.offload_bytes);
    (tier_of(d.placement) == 0 ? plan_.bytes_cpu : plan_.bytes_ssd) += d.offload_bytes;
  }
  uint64_t biggest = 0;
  for (const auto& d : plan_.modules)
    if (is_offload(d.placement)) biggest = std::max(biggest, d.offload_bytes);
  window_ = o_.window_bytes > 0 ? static_cast<double>(o_.window_bytes)
                                : static_cast<double>(o_.prefetch_modules) * static_cast<double>(biggest);
  if (o_.lead_per_module && o_.window_bytes == 0) window_ = kInf;  // the leads bound the loads
  plan_.window_bytes = std::isfinite(window_) ? static_cast<uint64_t>(window_) : plan_.bytes_cpu + plan_.bytes_ssd;
}

int StepSim::tier_of(Placement p) {
  return p == Placement::kOffloadCpu || p == Placement::kRecomputeOffloadCpu ? 0 : 1;
}

void StepSim::alloc(uint64_t bytes, bool saved) {
  alloc_ += static_cast<double>(bytes);
  if (saved) saved_ += static_cast<double>(bytes);
  note_peak(0);
}

void StepSim::release_memory(uint64_t bytes, bool saved) {
  alloc_ -= static_cast<double>(bytes);
  if (saved) saved_ -= static_cast<double>(bytes);
}

void StepSim::note_peak(uint64_t temp) {
  if (alloc_ + static_cast<double>(temp) > peak_alloc_) {
    peak_alloc_ = alloc_ + static_cast<double>(temp);
    plan_.peak_seconds = now_;
  }
  peak_saved_ = std::max(peak_saved_, saved_);
}

void StepSim::at(double t) {
  now_ = t;
  while (!frees_.empty() && frees_.top().first <= t) {
    const size_t s = frees_.top().second;
    frees_.pop();
    Storage& x = st_[s];
    if (x.cancelled || x.write_end > t) continue;
    x.released = true;  // written: the glue drops the tensor at its next call
    maybe_free(s);
  }
}

void StepSim::maybe_free(size_t s) {
  Storage& x = st_[s];
  if (!x.alive || x.kept_holders > 0) return;
  if (x.entry && !x.released && !x.cancelled) return;
  if (x.entry && x.cancelled && x.core_left > 0) return;  // forwarded: resident until used
  free_original(s);
}

void StepSim::free_original(size_t s) {
  Storage& x = st_[s];
  if (!x.alive) return;
  x.alive = false;
  release_memory(x.bytes);
}

void StepSim::enqueue_copy(size_t s, double made) {
  Storage& x = st_[s];
  x.made = made;
  x.core_left = static_cast<int>(x.core_users.size());
  if (device_) {
    // Both tiers cross the link; the SSD tier is then written by the workers.
    const double link = write_rate_[0];
    const double start = std::max(made, link_free_);
    x.write_start = start;
    x.copy_end = link > 0 ? start + rate_time(x.bytes, link) : made;
    if (link > 0) link_free_ = x.copy_end;
    x.write_end = x.copy_end;
    if (x.tier == 1) {
      const double ws = std::max(x.copy_end, tier_free_[1]);
      x.write_end = ws + rate_time(x.bytes, write_rate_[1]);
      tier_free_[1] = x.write_end;
      if (link <= 0) x.copy_end = x.write_end;  // no link measured: the SSD bounds the copy
    }
    backlog_.push_back(s);
    backlog_bytes_ += x.bytes;
  } else {
    const double start = std::max(made, tier_free_[x.tier]);
    x.write_start = start;
    x.copy_end = x.write_end = start + rate_time(x.bytes, write_rate_[x.tier]);
    tier_free_[x.tier] = x.write_end;
    if (std::isfinite(x.write_end)) frees_.push({x.write_end, s});
    pending_writes_.push_back(s);
  }
}

double StepSim::release_through(size_t count, double t) {
  double until = t;
  for (size_t k = 0; k < count && !backlog_.empty(); ++k) {
    const size_t s = backlog_.front();
    backlog_.pop_front();
    backlog_bytes_ -= st_[s].bytes;
    until = std::max(until, st_[s].copy_end);
    st_[s].released = true;
    released_bytes_ += st_[s].bytes;
    released_now_.push_back(s);
  }
  return until;
}

void StepSim::drop_released() {
  for (size_t s : released_now_) maybe_free(s);
  released_now_.clear();
}

void StepSim::forward() {
  double t = 0;
  double slack = -1;  // Note [Guarded writes]
  if (o_.guarded_writes && o_.activation_budget_bytes > 0) {
    uint64_t kept = 0;
    for (size_t i = 0; i < n_; ++i) {
      const Placement p = pl_[i];
      if (!is_recompute(p)) kept += m_[i].fixed_bytes;
      if (!is_offload(p)) kept += is_recompute(p) ? m_[i].recompute_bytes : m_[i].bytes;
      else if (!is_recompute(p)) kept += m_[i].bytes - std::min(m_[i].bytes, plan_.modules[i].offload_bytes);
    }
    if (kept < o_.activation_budget_bytes) slack = static_cast<double>(o_.activation_budget_bytes - kept);
  }
  for (size_t i = 0; i < n_; ++i) {
    ModuleDecision& d = plan_.modules[i];
    const double f = m_[i].forward_seconds;
    const double start = t;
    double waited = 0;
    module_begin_[i] = positions_.size();
    for (const SaveEvent& e : saves_[i]) {
      double made = start + waited + f * e.frac;
      at(made);
      Storage& x = st_[e.storage];
      if (e.role == SaveEvent::kNewOffload && device_ && x.tier == 1 && !staging_room(x.bytes, made)) {
        // Note [SSD below the link]: no page-locked room, the save stays resident.
        x.entry = false;
        x.kept_holders += 1;
        d.forwarded_bytes += x.bytes;
      }
      if (e.role == SaveEvent::kNewOffload || e.role == SaveEvent::kNewKept) {
        x.made = made;
        alloc(x.bytes);
        push_position(e);
      } else if (e.role == SaveEvent::kCoreRef) {
        if (o_.shared_at_last_user) move_position(e.storage);
        continue;
      } else {
        continue;
      }
      if (e.role != SaveEvent::kNewOffload || !x.entry) continue;
      enqueue_copy(e.storage, made);
      if (device_ && x.tier == 1) staging_.push_back(e.storage);
      d.write_done_seconds = std::max(d.write_done_seconds, device_ ? x.copy_end : x.write_end);
      double resume = made;
      if (device_ && o_.copy_bound_bytes > 0 && backlog_bytes_ > o_.copy_bound_bytes) {
        // Note [Copy bound]: wait for the oldest copies until the rest fit.
        size_t count = 0;
        uint64_t left = backlog_bytes_;
        for (size_t b : backlog_) {
          if (left <= o_.copy_bound_bytes) break;
          left -= st_[b].bytes;
          ++count;
        }
        resume = release_through(count, made);
      }
      if (slack >= 0) resume = std::max(resume, drained_by(tier_free_, write_rate_, made, slack));
      if (resume > made) {
        waited += resume - made;
        plan_.forward_wait_seconds += resume - made;
      }
      at(resume);
      drop_released();
    }
    module_end_[i] = positions_.size();
    t = start + f + waited;
    at(t);
    d.forward_end_seconds = t;
    note_peak(m_[i].forward_temp_bytes);
    area_ += saved_;
    if (device_) release_after_module(i, t);
  }
  compute_forward_ = 0;
  for (const auto& m : m_) compute_forward_ += m.forward_seconds;
  if (device_) {
    // Backward begins: every copy is released (Note [Release points]).
    const double until = release_through(backlog_.size(), t);
    if (until > t) {
      plan_.forward_wait_seconds += until - t;
      t = until;
    }
    at(t);
    drop_released();
  } else {
    // Note [Late stores]: writes not started stay resident, unwritten.
    at(t);
    for (size_t s : pending_writes_) {
      Storage& x = st_[s];
      if (x.write_start > t) {
        x.cancelled = true;
        x.write_end = x.copy_end = kInf;
      } else if (x.write_end <= t) {
        x.released = true;
      }
    }
  }
  t_ = t;
}

void StepSim::release_after_module(size_t i, double& t) {
  if (release_after_ != nullptr && !release_after_->empty()) {
    const int64_t r = (*release_after_)[i];
    size_t count = 0;
    for (size_t b : backlog_) {
      if (static_cast<int64_t>(st_[b].owner) > r) break;
      ++count;
    }
    const double until = release_through(count, t);
    if (until > t) {
      plan_.forward_wait_seconds += until - t;
      t = until;
    }
  } else {
    // The glue's rule: the copies the plan has done by now, in copy order
    // (Note [Release by bytes]).
    size_t count = 0;
    for (size_t b : backlog_) {
      if (st_[b].copy_end > t) break;
      ++count;
    }
    release_through(count, t);
  }
  plan_.modules[i].release_bytes = released_bytes_;
  at(t);
  drop_released();
}

bool StepSim::staging_room(uint64_t bytes, double t) {
  if (o_.staging_bytes == 0) return true;
  uint64_t used = 0;
  std::deque<size_t> still;
  for (size_t s : staging_)
    if (st_[s].write_end > t) {
      used += st_[s].bytes;
      still.push_back(s);
    }
  staging_.swap(still);
  return used + bytes <= o_.staging_bytes;
}

void StepSim::push_position(const SaveEvent& e) {
  Storage& x = st_[e.storage];
  if (e.role == SaveEvent::kNewOffload && x.entry) {
    x.order_pos = positions_.size();
    x.lead_module = x.owner;
    positions_.push_back({x.bytes, e.storage});
  } else if (o_.kept_in_distance) {
    positions_.push_back({x.bytes, kNone});
  }
}

void StepSim::move_position(size_t s) {
  // The entry moves to its last offloading saver's place (Note [Shared storages]).
  Storage& x = st_[s];
  x.order_pos = positions_.size();
  x.lead_module = x.core_users.back();
  positions_.push_back({0, s});
}

}  // namespace ebbtide::plan::detail
