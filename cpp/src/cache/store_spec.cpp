// make_store: the tiers a target name stands for.
#include "ebbtide/cache/store.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::cache {

std::unique_ptr<Store> make_store(const StoreSpec& spec) {
  const std::string& target = spec.target;
  EBB_CHECK(target == "cpu" || target == "ssd" || target == "auto", "tensor cache: target '", target,
            "' is not valid (valid: auto, ssd, cpu)");
  TieredStoreOptions t;
  // "auto" with no host budget: the SSD alone.
  if (target == "cpu" || (target == "auto" && spec.host_budget_bytes > 0)) {
    HostStoreOptions o;
    o.capacity_bytes = target == "cpu" ? spec.capacity_bytes : spec.host_budget_bytes;
    o.driver = spec.driver;
    t.cpu = make_host_store(o);
  }
  if (target == "ssd" || target == "auto") {
    SsdStoreOptions o;
    o.dirs = spec.dirs;
    o.capacity_bytes = spec.capacity_bytes;
    o.cuda = spec.driver != nullptr;  // a CPU-training cache never initialises CUDA
    o.cuda_driver = spec.driver;
    t.ssd = make_ssd_store(o);
    t.ssd_max_write_bps = spec.max_write_bps;
  }
  return make_tiered_store(std::move(t));
}

}  // namespace ebbtide::cache
