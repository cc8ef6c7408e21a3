// Note [Store pool] (store_pool.cpp): idle stores kept for short-lived caches.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>

#include "ebbtide/cache/store.hpp"

namespace ebbtide::cache {

// A store for `spec`: an idle one of the same settings from the pool, else a
// new one (make_store). `give_back` receives a function that returns the
// store to the pool (CacheOptions::return_store).
std::unique_ptr<Store> take_pooled_store(const StoreSpec& spec,
                                         std::function<void(std::unique_ptr<Store>)>* give_back);

// Drops the idle stores (their files and threads); returns how many.
size_t release_pooled_stores();

}  // namespace ebbtide::cache
