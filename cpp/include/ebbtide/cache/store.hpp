// Where offloaded tensor bytes live: the Store interface of the tensor cache.
//
// A Store keeps byte blobs. put() copies a source (host memory, or device
// memory ordered on a CUDA stream) into new space and returns its location;
// get() copies a location back; free() returns the space. Calls block the
// calling thread until the bytes have moved (the cache calls them on its own
// worker threads; see Note [Store workers] in tensor_cache_workers.cpp). Thread safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ebbtide/mem/buffer.hpp"
#include "ebbtide/mem/cuda_shim.hpp"

namespace ebbtide::cache {

using Location = uint64_t;

// Tiers of a tiered store (make_tiered_store), in the order they are filled;
// kTierFirst asks a put() for the store's first tier.
constexpr int kTierFirst = -1;
constexpr int kTierCpu = 0;
constexpr int kTierSsd = 1;
constexpr int kTiers = 2;

// Cumulative traffic of one tier. *_seconds count wall time during which at
// least one put (get) of the tier was running, so bytes / seconds is the rate
// the tier delivered while busy, whatever the number of workers.
struct TierMeter {
  bool present = false;
  uint64_t bytes_held = 0;
  uint64_t bytes_written = 0;
  double write_seconds = 0;
  uint64_t bytes_read = 0;
  double read_seconds = 0;
  double write_limit_bps = 0;  // 0 = no cap
};

struct StoreStats {
  uint64_t bytes_held = 0;   // bytes currently stored (true lengths)
  uint64_t blobs = 0;        // live locations
  uint64_t capacity = 0;     // 0 = unlimited
  uint64_t bytes_staged = 0; // host bytes copied through staging buffers on their way (ssd)
  TierMeter tiers[kTiers];   // filled by tiered stores only
  uint64_t host_registrations = 0;  // cuMemHostRegister calls for host blobs so far (cpu)
};

// Host memory that a caller fills itself, e.g. with a device-to-host copy it
// enqueues and orders on its own stream (Note [Stream-ordered offload]).
struct HostSpace {
  Location loc = 0;
  void* ptr = nullptr;
  bool pinned = false;  // registered with the CUDA driver: async copies overlap compute
};

class Store {
 public:
  virtual ~Store() = default;
  // Copies src into new space, in `tier` for a tiered store (kTierFirst: its
  // first tier; other stores ignore it). A device src is copied on its stream
  // and the call returns once the copy has finished. IoError (ENOSPC when
  // full, EIO, ...) on failure; then nothing stays allocated.
  virtual Location put(const mem::Buffer& src, int tier) = 0;
  // Copies the blob at `loc` into dst (dst.nbytes == the blob's length).
  virtual void get(Location loc, const mem::Buffer& dst) = 0;
  // Returns the space. StateError for an unknown location.
  virtual void free(Location loc) = 0;
  virtual StoreStats stats() const = 0;
  virtual std::string describe() const = 0;
  // Space for `nbytes` in host memory at `loc`; the caller writes the bytes
  // before any get() of it and frees it like a put's. Unsupported without a
  // host tier; IoError(ENOSPC) when that tier is full.
  virtual HostSpace reserve_host(uint64_t nbytes);
  // Whether puts to `tier` land in that kind of space.
  virtual bool has_tier(int tier) const { return false; }
  // The tier (kTierCpu, kTierSsd) holding `loc`; -1 when the store has no tiers.
  virtual int tier_of(Location loc) const { return -1; }
  // Host buffers whose address matches the source's at put() modulo this
  // move without a staging copy at get() (1: any buffer does).
  virtual uint64_t io_alignment() const { return 1; }
  // Caps the write rate of `tier` (bytes/s, 0 = no cap). Unsupported unless
  // the store is tiered; InvalidArgument for a negative rate or absent tier.
  virtual void set_write_limit(int tier, double bytes_per_second);
};

struct HostStoreOptions {
  uint64_t capacity_bytes = 0;        // 0 = unlimited; a put beyond it fails with ENOSPC
  uint64_t staging_bytes = 8ull << 20; // per device copy chunk (pinned staging)
  mem::cuda::Driver* driver = nullptr; // needed for device buffers; nullptr = host only
};

// target "cpu": blobs in host memory (64-byte aligned). Device buffers go through
// pinned staging buffers and the driver's async copies.
std::unique_ptr<Store> make_host_store(HostStoreOptions options);

struct SsdStoreOptions {
  std::vector<std::string> dirs;      // one slab per directory; several stripe
  uint64_t capacity_bytes = 0;        // per directory; 0 = until the disk is full
  bool apply_env = true;              // EBBTIDE_IO_* overrides of the engine options
  bool cuda = true;                   // device tensors may be stored (staging registered with CUDA)
  mem::cuda::Driver* cuda_driver = nullptr;  // their driver; nullptr: the process's
};

// target "ssd": blobs in slab files through io::Engine (O_DIRECT, io_uring).
// Throws IoError naming the directory when it cannot be written.
std::unique_ptr<Store> make_ssd_store(SsdStoreOptions options);

struct TieredStoreOptions {
  std::unique_ptr<Store> cpu;         // host memory tier (may be null)
  std::unique_ptr<Store> ssd;         // SSD tier (may be null); at least one tier
  double ssd_max_write_bps = 0;       // token-bucket cap on SSD puts (0 = none)
};

// Routes each put by its tier (kTierFirst: the first tier present); a cpu put that
// fails with ENOSPC (host budget full) goes to the SSD tier when there is one.
// Meters every tier (StoreStats::tiers) and caps SSD writes (Note [Write cap]).
// describe() of a single-tier store is that tier's.
std::unique_ptr<Store> make_tiered_store(TieredStoreOptions options);

// The store a tensor cache asks for by target name: "cpu" (host memory of
// capacity_bytes), "ssd" (slabs in `dirs`, capacity_bytes each) or "auto"
// (the SSD behind host memory of host_budget_bytes; the SSD alone when that
// is 0). max_write_bps caps SSD writes (0: no cap). With no driver the store
// takes host memory only and never initialises CUDA.
struct StoreSpec {
  std::string target = "auto";
  std::vector<std::string> dirs;
  uint64_t capacity_bytes = 0;
  uint64_t host_budget_bytes = 0;
  double max_write_bps = 0;
  mem::cuda::Driver* driver = nullptr;
};

// Builds the tiers `spec` names, as a tiered store. Throws InvalidArgument
// naming an unknown target, IoError naming an SSD directory that cannot be
// written.
std::unique_ptr<Store> make_store(const StoreSpec& spec);

}  // namespace ebbtide::cache
