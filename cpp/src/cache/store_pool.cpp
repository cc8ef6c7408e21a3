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
// A forked child inherits the parent's idle stores, whose engine threads it
// does not have: it neither lends nor destroys them (Note [Objects across
// fork] in ebbtide/mem/fork_origin.hpp); each entry carries the fork
// generation that pooled it, and another generation's store is let go
// without its destructor. The pool's mutex is held across fork
// (LockedAcrossFork), so the child never finds it held.
#include "ebbtide/cache/store_pool.hpp"

#include <deque>
#include <mutex>
#include <string>
#include <utility>

#include "ebbtide/mem/fork_origin.hpp"
#include "ebbtide/mem/host_mapping.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::cache {
namespace {

constexpr size_t kPoolIdle = 2;

struct Idle {
  std::string key;
  uint64_t generation = 0;  // mem::fork_generation() when pooled
  std::unique_ptr<Store> store;
};

struct StorePool {
  std::mutex mu;
  mem::LockedAcrossFork fork_lock{mu};
  std::deque<Idle> idle;  // oldest first
};

// A store another process pooled is let go without its destructor.
void drop(Idle& e) {
  if (e.generation != mem::fork_generation()) (void)e.store.release();
  e.store.reset();
}

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
  Idle evicted;
  {
    std::lock_guard<std::mutex> lock(pool().mu);
    pool().idle.push_back({key, mem::fork_generation(), std::move(store)});
    if (pool().idle.size() > kPoolIdle) {
      evicted = std::move(pool().idle.front());
      pool().idle.pop_front();
    }
  }
  drop(evicted);  // outside the lock: a store's destructor joins its threads
}

}  // namespace

std::unique_ptr<Store> take_pooled_store(const StoreSpec& spec,
                                         std::function<void(std::unique_ptr<Store>)>* give_back) {
  std::string key = pool_key(spec);
  std::unique_ptr<Store> store;
  {
    std::lock_guard<std::mutex> lock(pool().mu);
    auto& idle = pool().idle;
    const uint64_t generation = mem::fork_generation();
    for (auto it = idle.rbegin(); it != idle.rend(); ++it) {
      if (it->key != key || it->generation != generation) continue;
      store = std::move(it->store);
      idle.erase(std::next(it).base());
      break;
    }
  }
  if (!store) store = make_store(spec);
  *give_back = [key, bps = spec.max_write_bps](std::unique_ptr<Store> st) { give(key, bps, std::move(st)); };
  return store;
}

size_t release_pooled_stores() {
  std::deque<Idle> released;
  {
    std::lock_guard<std::mutex> lock(pool().mu);
    released.swap(pool().idle);
  }
  for (auto& e : released) drop(e);
  return released.size();
}

}  // namespace ebbtide::cache
