// Note [Store pool]
// ebbtide.offload() makes a cache per step, as save_on_cpu is used; building
// its store each time costs a slab file, its fallocate and the engine's
// threads (tens of ms). Such caches borrow an idle store of the same settings
// from this pool and give it back at close(), every entry's space freed, so
// that after the first step entering and leaving costs well under a
// millisecond. At most kPoolIdle idle stores are kept in all, the most
// recently returned (their files and threads live on while idle:
// ebbtide.release_pooled_stores() drops them). Never destroyed (leaked like
// the CUDA shim): static destructors at exit would run after the
// interpreter, in an unspecified order.
#include "ebbtide/cache/store_pool.hpp"

#include <deque>
#include <mutex>
#include <string>
#include <utility>

#include "ebbtide/util/error.hpp"

namespace ebbtide::cache {
namespace {

constexpr size_t kPoolIdle = 2;

struct StorePool {
  std::mutex mu;
  std::deque<std::pair<std::string, std::unique_ptr<Store>>> idle;  // oldest first
};

StorePool& pool() {
  static auto* p = new StorePool();
  return *p;
}

// Stores of equal keys are interchangeable: same tiers, bounds, directories
// and driver. The write cap is set again when a store comes back.
std::string pool_key(const StoreSpec& s) {
  std::string key = detail::concat(s.target, '|', s.capacity_bytes, '|', s.host_budget_bytes, '|', s.max_write_bps,
                                   '|', s.driver != nullptr);
  for (const auto& d : s.dirs) key += "|" + d;
  return key;
}

void give(const std::string& key, double max_write_bps, std::unique_ptr<Store> store) {
  if (store->stats().blobs != 0) return;  // not clean: destroyed here
  if (store->has_tier(kTierSsd)) store->set_write_limit(kTierSsd, max_write_bps);
  std::unique_ptr<Store> evicted;  // destroyed outside the lock (joins its threads)
  std::lock_guard<std::mutex> lock(pool().mu);
  pool().idle.emplace_back(key, std::move(store));
  if (pool().idle.size() > kPoolIdle) {
    evicted = std::move(pool().idle.front().second);
    pool().idle.pop_front();
  }
}

}  // namespace

std::unique_ptr<Store> take_pooled_store(const StoreSpec& spec,
                                         std::function<void(std::unique_ptr<Store>)>* give_back) {
  std::string key = pool_key(spec);
  std::unique_ptr<Store> store;
  {
    std::lock_guard<std::mutex> lock(pool().mu);
    auto& idle = pool().idle;
    for (auto it = idle.rbegin(); it != idle.rend(); ++it) {
      if (it->first != key) continue;
      store = std::move(it->second);
      idle.erase(std::next(it).base());
      break;
    }
  }
  if (!store) store = make_store(spec);
  *give_back = [key, bps = spec.max_write_bps](std::unique_ptr<Store> st) { give(key, bps, std::move(st)); };
  return store;
}

size_t release_pooled_stores() {
  std::deque<std::pair<std::string, std::unique_ptr<Store>>> drop;
  {
    std::lock_guard<std::mutex> lock(pool().mu);
    drop.swap(pool().idle);
  }
  return drop.size();
}

}  // namespace ebbtide::cache
