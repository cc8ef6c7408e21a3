// Host memory in front of the SSD: one Store routing each put by tier.
#include <cerrno>
#include <chrono>
#include <mutex>

#include "ebbtide/cache/rate_limiter.hpp"
#include "ebbtide/cache/store.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::cache {

HostSpace Store::reserve_host(uint64_t) {
  throw Unsupported(detail::concat("store '", describe(), "' keeps no host memory"));
}

void Store::set_write_limit(int tier, double bytes_per_second) {
  throw Unsupported(detail::concat("store '", describe(), "' has no write cap (only tiered stores do)"));
}

namespace {

using Clock = std::chrono::steady_clock;

// Wall time during which at least one transfer ran (Note [Tier meters]).
class BusyMeter {
 public:
  void begin() {
    std::lock_guard<std::mutex> lock(mu_);
    if (active_++ == 0) since_ = Clock::now();
  }
  void end(uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_ += bytes;
    if (--active_ == 0) seconds_ += std::chrono::duration<double>(Clock::now() - since_).count();
  }
  void read(uint64_t& bytes, double& seconds) const {
    std::lock_guard<std::mutex> lock(mu_);
    bytes = bytes_;
    seconds = seconds_ + (active_ ? std::chrono::duration<double>(Clock::now() - since_).count() : 0.0);
  }

 private:
  mutable std::mutex mu_;
  int active_ = 0;
  Clock::time_point since_{};
  uint64_t bytes_ = 0;
  double seconds_ = 0;
};

// Note [Tier meters]
// The planner needs the bandwidth a tier delivers, not the one the step asked
// for: bytes / busy time, where busy time is the union of the intervals with a
// transfer running (several workers overlap). A capped tier's token-bucket
// sleep counts as busy (Note [Write cap]). Failed transfers count their time
// but no bytes. Locations carry the tier in their top bit.
constexpr Location kSsdBit = Location{1} << 63;

class TieredStore final : public Store {
 public:
  explicit TieredStore(TieredStoreOptions o) : limiter_(o.ssd_max_write_bps) {
    EBB_CHECK(o.cpu || o.ssd, "tiered store: no tier given");
    tiers_[kTierCpu] = std::move(o.cpu);
    tiers_[kTierSsd] = std::move(o.ssd);
  }

  Location put(const mem::Buffer& src, int tier) override {
    EBB_CHECK(tier >= kTierFirst && tier < kTiers, "tiered store: tier ", tier, " is not valid (valid: -1, 0 cpu, 1 ssd)");
    if (tier == kTierFirst || !tiers_[tier]) tier = tiers_[kTierCpu] ? kTierCpu : kTierSsd;
    if (tier == kTierCpu) {
      try {
        return put_to(kTierCpu, src);
      } catch (const IoError& e) {
        if (e.err() != ENOSPC || !tiers_[kTierSsd]) throw;
      }
      tier = kTierSsd;  // host budget full: spill to the SSD
    }
    return put_to(kTierSsd, src) | kSsdBit;
  }

  bool has_tier(int tier) const override { return tier >= 0 && tier < kTiers && tiers_[tier] != nullptr; }
  int tier_of(Location loc) const override { return (loc & kSsdBit) ? kTierSsd : kTierCpu; }

  HostSpace reserve_host(uint64_t nbytes) override {
    if (!tiers_[kTierCpu]) return Store::reserve_host(nbytes);
    HostSpace h = tiers_[kTierCpu]->reserve_host(nbytes);
    EBB_CHECK_STATE((h.loc & kSsdBit) == 0, "tiered store: location ", h.loc, " of the host tier too large");
    meters_[kTierCpu][0].begin();  // filled by the caller's copy: bytes, no time here
    meters_[kTierCpu][0].end(nbytes);
    return h;
  }

  void get(Location loc, const mem::Buffer& dst) override {
    const int tier = (loc & kSsdBit) ? kTierSsd : kTierCpu;
    Store& s = at(tier, loc);
    meters_[tier][1].begin();
    bool ok = false;
    try {
      s.get(loc & ~kSsdBit, dst);
      ok = true;
    } catch (...) {
      meters_[tier][1].end(0);
      throw;
    }
    meters_[tier][1].end(ok ? dst.nbytes : 0);
  }

  void free(Location loc) override {
    const int tier = (loc & kSsdBit) ? kTierSsd : kTierCpu;
    at(tier, loc).free(loc & ~kSsdBit);
  }

  StoreStats stats() const override {
    StoreStats out;
    bool unlimited = false;
    for (int t = 0; t < kTiers; ++t) {
      if (!tiers_[t]) continue;
      const StoreStats s = tiers_[t]->stats();
      out.bytes_held += s.bytes_held;
      out.blobs += s.blobs;
      out.bytes_staged += s.bytes_staged;
      out.host_registrations += s.host_registrations;
      unlimited = unlimited || s.capacity == 0;
      out.capacity = unlimited ? 0 : out.capacity + s.capacity;
      TierMeter& m = out.tiers[t];
      m.present = true;
      m.bytes_held = s.bytes_held;
      meters_[t][0].read(m.bytes_written, m.write_seconds);
      meters_[t][1].read(m.bytes_read, m.read_seconds);
      m.write_limit_bps = t == kTierSsd ? limiter_.rate() : 0;
    }
    return out;
  }

  std::string describe() const override {
    if (!tiers_[kTierSsd]) return tiers_[kTierCpu]->describe();
    std::string cap = limiter_.rate() > 0 ? detail::concat(", write cap ", limiter_.rate() / 1e6, " MB/s") : "";
    if (!tiers_[kTierCpu]) return tiers_[kTierSsd]->describe() + cap;
    return "auto: " + tiers_[kTierCpu]->describe() + ", then " + tiers_[kTierSsd]->describe() + cap;
  }

  uint64_t io_alignment() const override {
    return tiers_[kTierSsd] ? tiers_[kTierSsd]->io_alignment() : 1;
  }

  void set_write_limit(int tier, double bytes_per_second) override {
    EBB_CHECK(tier == kTierSsd && tiers_[kTierSsd], "write cap: tier ", tier,
              " is not an SSD tier of this store (only the SSD tier is capped)");
    limiter_.set_rate(bytes_per_second);
  }

 private:
  Store& at(int tier, Location loc) {
    EBB_CHECK_STATE(tiers_[tier] != nullptr, "tiered store: location ", loc, " names an absent tier");
    return *tiers_[tier];
  }

  Location put_to(int tier, const mem::Buffer& src) {
    BusyMeter& m = meters_[tier][0];
    m.begin();
    try {
      if (tier == kTierSsd) limiter_.acquire(src.nbytes);
      const Location loc = tiers_[tier]->put(src, tier);
      m.end(src.nbytes);
      EBB_CHECK_STATE((loc & kSsdBit) == 0, "tiered store: location ", loc, " of tier ", tier, " too large");
      return loc;
    } catch (...) {
      m.end(0);
      throw;
    }
  }

  std::unique_ptr<Store> tiers_[kTiers];
  mutable BusyMeter meters_[kTiers][2];  // [tier][0 write, 1 read]
  RateLimiter limiter_;
};

}  // namespace

std::unique_ptr<Store> make_tiered_store(TieredStoreOptions options) {
  return std::make_unique<TieredStore>(std::move(options));
}

}  // namespace ebbtide::cache
