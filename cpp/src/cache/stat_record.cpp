// The names of the cache's statistics (stat_record in tensor_cache.hpp).
#include "ebbtide/cache/tensor_cache.hpp"

namespace ebbtide::cache {
namespace {

StatRecord counters_record(const Counters& c) {
  return {
      {"bytes_offloaded", c.bytes_offloaded},
      {"bytes_reloaded", c.bytes_reloaded},
      {"tensors_saved", c.tensors_saved},
      {"tensors_deduped", c.tensors_deduped},
      {"tensors_offloaded", c.tensors_offloaded},
      {"tensors_forwarded", c.tensors_forwarded},
      {"tensors_kept", c.tensors_kept},
      {"tensors_reloaded", c.tensors_reloaded},
      {"tensors_reused", c.tensors_reused},
      {"bytes_reused", c.bytes_reused},
      {"bytes_discarded", c.bytes_discarded},
      {"store_failures", c.store_failures},
      {"load_failures", c.load_failures},
      {"copy_waits", c.copy_waits},
      {"tensors_in_capture", c.tensors_in_capture},
      {"saved_bytes_total", c.saved_bytes_total},
      {"peak_resident_bytes", c.peak_resident_bytes},
      {"stall_seconds", c.stall_seconds},
      {"device_wait_seconds", c.device_wait_seconds},
      {"copy_wait_seconds", c.copy_wait_seconds},
      {"load_wait_seconds", c.load_wait_seconds},
  };
}

// One record per tier present, named "cpu" or "ssd".
std::vector<StatRecord> tier_records(const StoreStats& s) {
  constexpr std::string_view kNames[kTiers] = {"cpu", "ssd"};
  std::vector<StatRecord> out;
  for (int t = 0; t < kTiers; ++t) {
    const TierMeter& m = s.tiers[t];
    if (!m.present) continue;
    out.push_back({
        {"tier", kNames[t]},
        {"bytes_held", m.bytes_held},
        {"bytes_written", m.bytes_written},
        {"write_seconds", m.write_seconds},
        {"bytes_read", m.bytes_read},
        {"read_seconds", m.read_seconds},
        {"write_limit_bps", m.write_limit_bps},
    });
  }
  return out;
}

}  // namespace

StatRecord stat_record(const CacheStats& s) {
  return {
      {"step", counters_record(s.step)},
      {"total", counters_record(s.total)},
      {"steps", s.steps},
      {"resident_bytes", s.resident_bytes},
      {"window_bytes", s.window_bytes},
      {"inflight_bytes", s.inflight_bytes},
      {"entries", s.entries},
      {"queued_stores", s.queued_stores},
      {"queued_loads", s.queued_loads},
      {"store_bytes_held", s.store.bytes_held},
      {"store_blobs", s.store.blobs},
      {"store_bytes_staged", s.store.bytes_staged},
      {"store_host_registrations", s.store.host_registrations},
      {"tiers", tier_records(s.store)},
  };
}

}  // namespace ebbtide::cache
