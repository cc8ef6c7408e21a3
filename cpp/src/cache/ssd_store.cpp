// target "ssd": offloaded bytes in slab files through the storage engine.
#include <cerrno>

#include "ebbtide/cache/store.hpp"
#include "ebbtide/io/engine.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::cache {
namespace {

// Note [SSD store]: one slot per blob. put() and get() wait for their engine
// request (the cache calls them on its workers, several at a time); the
// engine splits each request into chunks and keeps its queue depth busy.
// Device spans go to the engine as device buffers on the worker's side
// stream, already ordered after the producing compute work.
class SsdStore final : public Store {
 public:
  explicit SsdStore(io::EngineOptions o) : engine_(std::move(o)) {}
  ~SsdStore() override {
    try {
      engine_.close();
    } catch (...) {
    }
  }

  Location put(const mem::Buffer& src, int /*tier*/) override {
    EBB_CHECK(src.nbytes > 0, "ssd store: empty put");
    // Host data: lay the slot out after the source's address, so that O_DIRECT
    // writes it in place (Note [Slot phase] in io/striping.cpp).
    io::SlotId slot = engine_.allocate(src.nbytes, src.on_device() ? nullptr : src.ptr);
    try {
      engine_.write(slot, src).wait();
    } catch (...) {
      try {
        engine_.free(slot);
      } catch (...) {
      }
      throw;
    }
    return slot;
  }

  void get(Location loc, const mem::Buffer& dst) override { engine_.read(loc, dst).wait(); }

  void free(Location loc) override { engine_.free(loc); }

  StoreStats stats() const override {
    auto s = engine_.stats();
    return StoreStats{s.bytes_stored, s.slots_live, engine_.options().capacity_bytes, s.bytes_staged, {}};
  }

  std::string describe() const override { return "ssd: " + engine_.describe(); }

  uint64_t io_alignment() const override { return engine_.io_alignment(); }
  bool has_tier(int tier) const override { return tier == kTierSsd; }

 private:
  io::Engine engine_;
};

}  // namespace

std::unique_ptr<Store> make_ssd_store(SsdStoreOptions options) {
  EBB_CHECK(!options.dirs.empty(), "ssd store: no directory given");
  io::EngineOptions eo;
  eo.dirs = options.dirs;
  eo.capacity_bytes = options.capacity_bytes;
  if (options.apply_env) eo = eo.with_env();
  eo.cuda_register = options.cuda;
  eo.cuda_driver = options.cuda ? options.cuda_driver : nullptr;
  return std::make_unique<SsdStore>(std::move(eo));
}

}  // namespace ebbtide::cache
