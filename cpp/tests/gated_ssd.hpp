// A store standing in for the SSD tier in the device tests: blobs in
// memory, each put held at a test::Gate (open by default) to stage races.
#pragma once

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::test {

class GatedSsd final : public cache::Store {
 public:
  explicit GatedSsd(test::Gate& gate) : gate_(gate) {}
  cache::Location put(const mem::Buffer& src, int) override {
    EBB_CHECK(!src.on_device(), "gated ssd: device put");
    gate_.pass();
    std::lock_guard<std::mutex> lock(mu_);
    blobs_[next_].assign(static_cast<const unsigned char*>(src.ptr), static_cast<const unsigned char*>(src.ptr) + src.nbytes);
    return next_++;
  }
  void get(cache::Location loc, const mem::Buffer& dst) override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto& b = blobs_.at(loc);
    EBB_CHECK(!dst.on_device() && dst.nbytes == b.size(), "gated ssd: bad get");
    std::memcpy(dst.ptr, b.data(), b.size());
  }
  void free(cache::Location loc) override {
    std::lock_guard<std::mutex> lock(mu_);
    EBB_CHECK_STATE(blobs_.erase(loc) == 1, "gated ssd: location ", loc, " freed twice");
  }
  cache::StoreStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    cache::StoreStats s;
    s.blobs = blobs_.size();
    for (const auto& [loc, b] : blobs_) s.bytes_held += b.size();
    return s;
  }
  std::string describe() const override { return "gated ssd"; }
  bool has_tier(int tier) const override { return tier == cache::kTierSsd; }
  int tier_of(cache::Location) const override { return cache::kTierSsd; }

 private:
  test::Gate& gate_;
  mutable std::mutex mu_;
  std::map<cache::Location, std::vector<unsigned char>> blobs_;
  cache::Location next_ = 1;
};

}  // namespace ebbtide::test
