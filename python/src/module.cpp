// ebbtide._core: runs every registered binding area (see bind.hpp).
#include <algorithm>
#include <string>
#include <vector>

#include "bind.hpp"

namespace ebbtide::py {
namespace {
struct Entry {
  const char* name;
  int order;
  BindFn fn;
};
std::vector<Entry>& registry() {
  static std::vector<Entry> r;
  return r;
}
}  // namespace

BindRegistrar::BindRegistrar(const char* name, int order, BindFn fn) {
  registry().push_back({name, order, fn});
}

}  // namespace ebbtide::py

NB_MODULE(_core, m) {
  auto& reg = ebbtide::py::registry();
  std::stable_sort(reg.begin(), reg.end(),
                   [](const auto& a, const auto& b) { return a.order < b.order; });
  for (const auto& e : reg) e.fn(m);
}
