// Profiles and plan readers shared by the planner's tests (test_plan_planner.cpp,
// test_plan_gpu.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ebbtide/plan/planner.hpp"

namespace ebbtide::plan::test {

constexpr uint64_t kGB = 1000000000ULL;

// n modules of `seconds` forward each, saving `bytes`.
inline std::vector<ModuleProfile> uniform(int n, double seconds, uint64_t bytes) {
  std::vector<ModuleProfile> m;
  for (int i = 0; i < n; ++i) m.push_back({"layer" + std::to_string(i), seconds, bytes});
  return m;
}

// The same, each recomputable from `inputs` saved bytes.
inline std::vector<ModuleProfile> recomputable(int n, double seconds, uint64_t bytes, uint64_t inputs) {
  auto m = uniform(n, seconds, bytes);
  for (auto& x : m) {
    x.recomputable = true;
    x.recompute_bytes = inputs;
  }
  return m;
}

inline int count(const Plan& p, Placement placement) {
  int c = 0;
  for (const auto& d : p.modules) c += d.placement == placement;
  return c;
}

inline std::vector<Placement> placements_of(const Plan& p) {
  std::vector<Placement> out;
  for (const auto& d : p.modules) out.push_back(d.placement);
  return out;
}

}  // namespace ebbtide::plan::test
