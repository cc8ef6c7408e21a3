// The planner on a GPU: the copy bound in the plan and partial offload (Note
// [Copy bound in the plan], Note [Partial offload] in cpp/src/plan/planner.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "ebbtide/plan/budget.hpp"
#include "ebbtide/plan/planner.hpp"
#include "ebbtide/util/error.hpp"
#include "plan_test_helpers.hpp"

using namespace ebbtide::plan;
using namespace ebbtide::plan::test;

// ------------------------------------------- GPU: copy bound, partial offload
// Note [Copy bound in the plan], Note [Partial offload], on the profiles of
// the first H200 runs (2026-11-26, docs/benchmarks.md, "Activation offloading, GPU":
// offload_bench shapes a and b; per-scope times from CUDA events with everything kept, the
// link measured at 55.3 GB/s) and the options the glue passes on a GPU.

namespace {

// A profile as the H200 run measured it: the scope before the blocks, then
// one block per entry of `seconds` named prefix + index; every block saved
// `bytes` but the last, which holds the head and the loss too (`last_bytes`).
std::vector<ModuleProfile> h200_profile(ModuleProfile before, const std::string& prefix,
                                        const std::vector<double>& seconds, uint64_t first_bytes,
                                        uint64_t bytes, uint64_t last_bytes) {
  std::vector<ModuleProfile> m{std::move(before)};
  for (size_t i = 0; i < seconds.size(); ++i) {
    const uint64_t b = i == 0 ? first_bytes : i + 1 == seconds.size() ? last_bytes : bytes;
    m.push_back({prefix + std::to_string(i), seconds[i], b});
  }
  return m;
}

// Shape a: llama, 8 layers, hidden 4096, seq 2048, batch 2, bf16.
std::vector<ModuleProfile> shape_a() {
  return h200_profile({"<before blocks>", 0.0010080959796905519, 32768ULL}, "model.layers.",
                      {0.0030504961013793947, 0.002915839910507202, 0.00291644811630249, 0.0029145920276641844,
                       0.002916224002838135, 0.0029189438819885254, 0.002913088083267212, 0.0037435200214385985},
                      712540176ULL, 711491600ULL, 979976212ULL);
}

// Shape b: gpt2, 9 layers, hidden 8192, seq 2048, batch 2, bf16.
std::vector<ModuleProfile> shape_b() {
  return h200_profile({"<before blocks>", 0.00122435200214386, 33603584ULL}, "transformer.h.",
                      {0.010544511795043945, 0.010215840339660644, 0.010224543571472167, 0.01021513557434082,
                       0.010221759796142578, 0.010177375793457032, 0.01040764808654785, 0.011098848342895509,
                       0.012301695823669434},
                      1947271184ULL, 1947271184ULL, 2215772180ULL);
}

// What ebbtide/cache/adaptive.py passes on a GPU (target auto, host tier).
PlannerOptions gpu_options(double write_bps, double read_bps, double backward_factor) {
  PlannerOptions o;
  o.host_budget_bytes = 1ull << 40;
  o.host_write_bps = write_bps;
  o.host_read_bps = read_bps;
  o.keep_last_modules = 1;
  o.backward_factor = backward_factor;
  o.prefetch_modules = 4;
  o.writes_within_forward = true;
  return o;
}

PlannerOptions shape_a_options() { return gpu_options(55266382949.31681, 55472138284.46099, 2.00024588614953); }
PlannerOptions shape_b_options() { return gpu_options(55317768243.66902, 55416439731.55898, 2.119044640737976); }

constexpr uint64_t kGiB = 1ull << 30;  // the cache's default device_inflight_bytes

uint64_t moved(const Plan& p) { return p.bytes_cpu + p.bytes_ssd; }

}  // namespace

// Shape b without the copy bound in the model: the planner offloads the
// blocks' scope before them and blocks 0 and 1 whole, every copy ending by
// the forward's end and nothing predicted to wait; on the H200 the forward
// took 0.131 s instead of 0.097 s. Replayed with the 1 GiB bound (Note [Copy
// bound] in the step model: each save's copy is queued as it is made, and
// the compute stream waits for the oldest copies once more than the bound
// is held), the same placements wait 33.4 ms: within 5% of the 34 ms
// measured.
TEST(PlanPlanner, CopyBoundWaitIsPredicted) {
  PlannerOptions o = shape_b_options();
  std::vector<Placement> old(10, Placement::kKeep);
  old[0] = old[1] = old[2] = Placement::kOffloadCpu;
  o.copy_bound_bytes = kGiB;
  const Plan replay = simulate_plan(shape_b(), o, old);
  EXPECT_NEAR(replay.forward_wait_seconds, 0.034, 0.05 * 0.034);
  EXPECT_NEAR(replay.predicted_stall_seconds, replay.forward_wait_seconds, 1e-12) << "no reload stalls";
  o.copy_bound_bytes = 0;
  EXPECT_EQ(simulate_plan(shape_b(), o, old).forward_wait_seconds, 0) << "without the bound nothing waits";

  // Planned with the bound, whole blocks only: block 0 alone already
  // waits, so only the 34 MB before the blocks moves, and nothing waits.
  o.copy_bound_bytes = kGiB;
  const Plan p = plan_offload(shape_b(), o);
  EXPECT_EQ(p.modules[0].placement, Placement::kOffloadCpu);
  for (size_t i = 1; i < p.modules.size(); ++i) EXPECT_EQ(p.modules[i].placement, Placement::kKeep) << i;
  EXPECT_EQ(p.forward_wait_seconds, 0);
  EXPECT_EQ(p.predicted_stall_seconds, 0);
}

// SSD-tier copies cross the same link (into bounce blobs) before they are
// written: the bound counts them as it counts the host tier's. Four 1 GB
// modules of 10 ms at 55 GB/s with a 1 GiB bound: the same wait whether the
// second and third go to host memory or to the SSD (the SSD fast enough not
// to matter here), and more than with the third kept.
TEST(PlanPlanner, CopyBoundCountsTheSsdTiersCopies) {
  PlannerOptions o = gpu_options(55e9, 55e9, 2.0);
  o.copy_bound_bytes = kGiB;
  o.write_bps = 100e9;  // the SSD tier
  o.read_bps = 100e9;
  // Page-locked staging unbounded here: a 1 GiB one fills with the SSD-tier
  // saves queued on the link, and a save that finds it full stays resident.
  o.staging_bytes = 0;
  const auto mods = uniform(4, 0.010, kGB);
  using P = Placement;
  const Plan host = simulate_plan(mods, o, {P::kOffloadCpu, P::kOffloadCpu, P::kOffloadCpu, P::kKeep});
  const Plan ssd = simulate_plan(mods, o, {P::kOffloadCpu, P::kOffloadSsd, P::kOffloadSsd, P::kKeep});
  const Plan two = simulate_plan(mods, o, {P::kOffloadCpu, P::kOffloadSsd, P::kKeep, P::kKeep});
  // The link runs behind the forward (55 GB/s against 100 GB/s made): with
  // three modules queued the backlog passes the bound and the forward waits,
  // at least until 3 GB less the bound have been copied (54.5 - 19.5 ms)
  // against the third module's last save at 30 ms.
  EXPECT_GE(host.forward_wait_seconds, 3 * kGB / 55e9 - kGiB / 55e9 - 0.030 - 1e-9);
  EXPECT_NEAR(ssd.forward_wait_seconds, host.forward_wait_seconds, 1e-12);
  EXPECT_EQ(two.forward_wait_seconds, 0);
}

// A bound that the copies never reach changes nothing.
TEST(PlanPlanner, CopyBoundAboveTheBacklogChangesNothing) {
  PlannerOptions o = shape_a_options();
  const Plan free = plan_offload(shape_a(), o);
  o.copy_bound_bytes = kGiB;  // shape a's backlog peaks at 544 MB
  const Plan bounded = plan_offload(shape_a(), o);
  EXPECT_EQ(placements_of(bounded), placements_of(free));
  EXPECT_EQ(bounded.forward_wait_seconds, 0);
  for (size_t i = 0; i < free.modules.size(); ++i)
    EXPECT_EQ(bounded.modules[i].write_done_seconds, free.modules[i].write_done_seconds) << i;
}

// Shape a, whole blocks: block 0's copy ends at 13.9 ms, block 1's would
// end after the 25.3 ms forward: one block. With partial offload block 1
// moves a prefix, the part whose copies end before the last block's
// forward: copies that end later are still held at the forward's end, the
// peak (Note [Offload for the peak]), and would only take the link.
TEST(PlanPlanner, PartialOffloadFillsTheLinkShapeA) {
  PlannerOptions o = shape_a_options();
  o.copy_bound_bytes = kGiB;
  const Plan whole = plan_offload(shape_a(), o);
  EXPECT_EQ(count(whole, Placement::kOffloadCpu), 2) << "the scope before the blocks, and block 0";
  EXPECT_EQ(whole.bytes_cpu, 32768u + 712540176u);
  for (const auto& d : whole.modules) EXPECT_FALSE(d.partial()) << d.name;

  o.partial_offload = true;
  const Plan p = plan_offload(shape_a(), o);
  ASSERT_EQ(p.modules.size(), 9u);
  EXPECT_EQ(p.modules[0].offload_bytes, 32768u);
  EXPECT_EQ(p.modules[1].offload_bytes, 712540176u) << "block 0 whole, as before";
  EXPECT_TRUE(p.modules[2].partial());
  for (size_t i = 3; i < 9; ++i) EXPECT_EQ(p.modules[i].placement, Placement::kKeep) << i;
  EXPECT_EQ(p.predicted_stall_seconds, 0);
  EXPECT_EQ(p.forward_wait_seconds, 0);
  const double last_start = p.modules[7].forward_end_seconds;
  for (const auto& d : p.modules)
    if (is_offload(d.placement)) EXPECT_LE(d.write_done_seconds, last_start + 1e-9) << d.name;
  EXPECT_LT(p.peak_resident_bytes, whole.peak_resident_bytes);
  // What moved, against what the link carries before the last block (the
  // last release point before the peak): most of it.
  const double link = o.host_write_bps * last_start;
  EXPECT_GT(static_cast<double>(moved(p)) / link, 0.75);
  EXPECT_LE(static_cast<double>(moved(p)), link);
  // The unmoved rest of a prefix stays resident: kept bytes and moved bytes
  // add up to everything.
  EXPECT_EQ(p.bytes_keep + p.bytes_cpu, p.all_resident_bytes);
}

// Shape b with the bound and prefixes: nothing waits, and most of what the
// link carries in the forward moves (whole blocks under the bound moved
// only the 34 MB before them, CopyBoundWaitIsPredicted).
TEST(PlanPlanner, PartialOffloadUnderTheCopyBoundShapeB) {
  PlannerOptions o = shape_b_options();
  o.copy_bound_bytes = kGiB;
  o.partial_offload = true;
  const Plan p = plan_offload(shape_b(), o);
  EXPECT_EQ(p.forward_wait_seconds, 0);
  EXPECT_EQ(p.predicted_stall_seconds, 0);
  for (const auto& d : p.modules)
    if (is_offload(d.placement)) EXPECT_LE(d.write_done_seconds, p.forward_seconds + 1e-9) << d.name;
  EXPECT_EQ(p.modules.back().placement, Placement::kKeep);
  const double link = o.host_write_bps * p.forward_seconds;
  EXPECT_GT(static_cast<double>(moved(p)) / link, 0.7) << moved(p);
  EXPECT_LE(static_cast<double>(moved(p)), link);
  // Replayed with the same prefixes, the model agrees with itself.
  std::vector<uint64_t> limits;
  for (const auto& d : p.modules) limits.push_back(d.partial() ? d.offload_bytes : kWholeModule);
  const Plan again = simulate_plan(shape_b(), o, placements_of(p), limits);
  EXPECT_EQ(moved(again), moved(p));
  EXPECT_EQ(again.peak_resident_bytes, p.peak_resident_bytes);
}

// Where whole modules fit, partial offload changes nothing.
TEST(PlanPlanner, PartialOffloadLeavesWholeModulesAlone) {
  for (bool gpu : {false, true}) {
    PlannerOptions o;
    o.write_bps = o.read_bps = 1e15;
    o.writes_within_forward = gpu;
    const Plan whole = plan_offload(uniform(8, 0.1, kGB), o);
    o.partial_offload = true;
    const Plan p = plan_offload(uniform(8, 0.1, kGB), o);
    EXPECT_EQ(placements_of(p), placements_of(whole));
    for (const auto& d : p.modules) {
      EXPECT_FALSE(d.partial()) << d.name;
      EXPECT_EQ(d.offload_bytes, is_offload(d.placement) ? d.saved_bytes : 0u) << d.name;
    }
    EXPECT_EQ(p.peak_resident_bytes, whole.peak_resident_bytes);
  }
}

// A prefix by hand: 3 modules of 1 GB in 0.1 s (made in eight 125 MB
// pieces, one every 12.5 ms), a 5 GB/s host link, module 0 moving its
// first 0.25 GB: piece 0 is made at 12.5 ms and copied by 37.5 ms, piece 1
// (made at 25 ms) then by 62.5 ms (Note [Partial offload]); 2.75 GB stay
// resident.
TEST(PlanPlanner, SimulatedPrefixByHand) {
  PlannerOptions o;
  o.host_budget_bytes = 1ull << 40;
  o.host_write_bps = o.host_read_bps = 5e9;
  o.writes_within_forward = true;
  o.prefetch_modules = 1;
  const std::vector<Placement> pl{Placement::kOffloadCpu, Placement::kKeep, Placement::kKeep};
  const Plan p = simulate_plan(uniform(3, 0.1, kGB), o, pl, {kGB / 4, kWholeModule, kWholeModule});
  EXPECT_EQ(p.modules[0].offload_bytes, kGB / 4);
  EXPECT_TRUE(p.modules[0].partial());
  EXPECT_EQ(p.bytes_cpu, kGB / 4);
  EXPECT_EQ(p.bytes_keep, 3 * kGB - kGB / 4);
  EXPECT_DOUBLE_EQ(p.modules[0].write_done_seconds, 0.0625);
  // Forward end: 2.75 GB resident; backward: the reload is back by the time
  // module 0's backward starts, so the peak is at the forward's end or the
  // last module's backward with the reload in the window: 3 GB at most.
  EXPECT_GE(p.peak_resident_bytes, 3 * kGB - kGB / 4);
  EXPECT_LE(p.peak_resident_bytes, 3 * kGB);
  // A limit past the module's bytes moves it whole; 0 is refused.
  const Plan whole = simulate_plan(uniform(3, 0.1, kGB), o, pl, {2 * kGB, kWholeModule, kWholeModule});
  EXPECT_FALSE(whole.modules[0].partial());
  EXPECT_EQ(whole.bytes_cpu, kGB);
  EXPECT_THROW(simulate_plan(uniform(3, 0.1, kGB), o, pl, {0, kWholeModule, kWholeModule}),
               ebbtide::InvalidArgument);
  EXPECT_THROW(simulate_plan(uniform(3, 0.1, kGB), o, pl, {kWholeModule}), ebbtide::InvalidArgument);
}

namespace {

// Both tiers with prefixes allowed: a host tier of `host_budget` at a fast
// link, an SSD at `ssd_bps` each way (Note [Prefix or another tier whole]).
PlannerOptions two_tiers(uint64_t host_budget, double ssd_bps, bool gpu) {
  PlannerOptions o;
  o.host_budget_bytes = host_budget;
  o.host_write_bps = o.host_read_bps = 1e15;
  o.write_bps = o.read_bps = ssd_bps;
  o.writes_within_forward = gpu;
  o.partial_offload = true;
  return o;
}

}  // namespace

// Note [Prefix or another tier whole]: a 1.5 GB host budget over 1 GB
// modules, both tiers fast. Block 0 fits the host whole; block 1 could take
// only a 0.5 GB host prefix, and the SSD takes it whole, so it goes there;
// so does block 2. Block 3, before the last, stays: its reload would come
// back as backward begins (PlanPlanner.AmpleBandwidthOffloadsAllButTheLast).
// Before, block 1 took the host prefix, the SSD-first walk moved 0.5 GB
// more, and that plan won: nothing on the host.
TEST(PlanPlanner, PrefixYieldsToAnotherTierWhole) {
  for (bool gpu : {false, true}) {
    const Plan p = plan_offload(uniform(5, 0.1, kGB), two_tiers(3 * kGB / 2, 1e15, gpu));
    EXPECT_EQ(p.modules[0].placement, Placement::kOffloadCpu) << gpu;
    for (size_t i = 1; i < 3; ++i) EXPECT_EQ(p.modules[i].placement, Placement::kOffloadSsd) << i << gpu;
    EXPECT_EQ(p.modules[3].placement, Placement::kKeep) << gpu;
    for (const auto& d : p.modules) EXPECT_FALSE(d.partial()) << d.name << gpu;
    EXPECT_EQ(p.bytes_cpu, kGB) << gpu;
    EXPECT_EQ(p.bytes_ssd, 2 * kGB) << gpu;
    EXPECT_EQ(p.predicted_stall_seconds, 0) << gpu;
  }
}

// Where no tier takes a module whole, the larger prefix wins: a host tier
// with room for 0.3 GB, and an SSD at 2 GB/s each way behind an instant
// link (three 1 GB blocks of 0.1 s, a 0.3 s forward): block 0 moves to the
// SSD as much as its reads can bring back by its backward (0.7 s) after its
// writes end, more than the host's room, so it goes to the SSD. Block 1,
// before the last, stays (its reload would come back as backward begins).
TEST(PlanPlanner, LargerPrefixWinsAcrossTiers) {
  const Plan p = plan_offload(uniform(3, 0.1, kGB), two_tiers(3 * kGB / 10, 2e9, true));
  EXPECT_EQ(p.modules[0].placement, Placement::kOffloadSsd);
  EXPECT_GT(static_cast<double>(p.modules[0].offload_bytes), 0.3e9 + static_cast<double>(kGB >> 10));
  EXPECT_LT(p.modules[0].offload_bytes, kGB);
  EXPECT_EQ(p.modules[1].placement, Placement::kKeep);
  EXPECT_EQ(p.modules[2].placement, Placement::kKeep);
  EXPECT_EQ(p.predicted_stall_seconds, 0);
  // The host tier alone takes its room.
  PlannerOptions host = two_tiers(3 * kGB / 10, 2e9, true);
  host.write_bps = host.read_bps = 0;
  const Plan h = plan_offload(uniform(3, 0.1, kGB), host);
  EXPECT_EQ(h.modules[0].placement, Placement::kOffloadCpu);
  EXPECT_EQ(h.modules[0].offload_bytes, 3 * kGB / 10);
  EXPECT_GT(h.peak_resident_bytes, p.peak_resident_bytes);
}
