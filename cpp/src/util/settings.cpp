// The table of every EBBTIDE_* setting (config.hpp). docs/configuration.md
// lists the same rows; python/tests/test_settings.py fails when they differ.
#include <stdexcept>
#include <string>
#include <utility>

#include "ebbtide/util/config.hpp"

namespace ebbtide::config {

namespace {

constexpr double kNoMax = 1.8e19;

Setting make(std::string_view name, Kind kind, std::string_view section, std::string_view default_text,
             std::string_view meaning, double min = 0, double max = 0,
             std::vector<std::string_view> choices = {}) {
  Setting s{name, kind, section, default_text, meaning, min, max, std::move(choices)};
  return s;
}

std::vector<Setting> make_table() {
  using K = Kind;
  const std::string_view gen = "General", io = "Storage engine", cache = "Tensor cache", ckpt = "Checkpoints",
                         sw = "Without editing the script";
  return {
      make("EBBTIDE_LOG_LEVEL", K::kChoice, gen, "`warn`",
       "`error`, `warn`, `info` or `debug`. Fallbacks (buffered I/O on tmpfs, POSIX backend without io_uring, "
       "no CUDA driver) are logged once at `warn` or `info`.",
       0, 0, {"error", "warn", "info", "debug"}),
      make("EBBTIDE_CUDA", K::kBool, gen, "on",
       "`0` disables the CUDA driver shim: ebbtide then treats the machine as CPU-only."),
      make("EBBTIDE_CUFILE", K::kBool, gen, "auto",
       "unset: the cuFile (GPUDirect Storage) path is used when the nvidia-fs kernel module is loaded "
       "(`/proc/driver/nvidia-fs`); `1` forces it (cuFile compatibility mode without the module); `0` disables "
       "it. Otherwise device buffers go through pinned staging."),

      make("EBBTIDE_IO_BACKEND", K::kChoice, io, "`auto`", "`auto`, `uring` (or `io_uring`), `posix`.", 0, 0,
       {"auto", "uring", "io_uring", "posix"}),
      make("EBBTIDE_IO_CHUNK_BYTES", K::kBytes, io, "`1MiB`",
       "I/O unit and stripe unit; a multiple of the O_DIRECT alignment."),
      make("EBBTIDE_IO_QUEUE_DEPTH", K::kInt, io, "`16`", "chunks in flight per device (1-4096).", 1, 4096),
      make("EBBTIDE_IO_CHECKSUM", K::kBool, io, "off", "crc32c per chunk, verified on every read."),
      make("EBBTIDE_IO_DIRECT", K::kBool, io, "on", "`0` forces buffered I/O even where O_DIRECT works."),

      make("EBBTIDE_MIN_BYTES", K::kBytes, cache, "`64KiB`", "storages smaller than this stay resident."),
      make("EBBTIDE_PREFETCH_WINDOW", K::kBytes, cache, "auto",
       "bytes reloaded ahead of use during backward; auto = the largest block's offloaded bytes."),
      make("EBBTIDE_CACHE_WORKERS", K::kInt, cache, "`2`", "store/load worker threads (1-64).", 1, 64),
      make("EBBTIDE_MAX_INFLIGHT", K::kBytes, cache, "`0` (off)",
       "a pack waits while more bytes than this wait to be stored (host tensors; the worker path)."),
      make("EBBTIDE_DEVICE_INFLIGHT", K::kBytes, cache, "`1GiB`",
       "GPU: bytes of device-to-host copies the compute stream may run ahead of before it waits for the oldest "
       "(Note [Copy bound]); `0` = no bound."),
      make("EBBTIDE_STAGING_BYTES", K::kBytes, cache, "`1GiB`",
       "GPU with an SSD tier: page-locked bounce bytes held for tensors on their way to the SSD; past it a "
       "tensor stays on the GPU (Note [SSD below the link])."),
      make("EBBTIDE_ADAPTIVE", K::kBool, cache,
       "on for `target=\"auto\"` and for every target on a GPU, off otherwise",
       "`1`/`0` (`true`/`false`, `yes`/`no`, `on`/`off`): profile the first step and let the planner choose "
       "per block."),
      make("EBBTIDE_HOST_BUDGET", K::kBytes, cache, "a quarter of `MemAvailable` on CUDA, `0` on CPU",
       "host-memory tier of `target=\"auto\"` (bytes, e.g. `32GiB`)."),
      make("EBBTIDE_ACTIVATION_BUDGET", K::kBytes, cache, "`0` (none)",
       "bound on the step's peak of saved-activation bytes held in the training device's memory (bytes, e.g. "
       "`20GiB`); the planner keeps, offloads or recomputes each block to fit it at the least step time "
       "(Note [Budget plan]). Turns the cache adaptive."),
      make("EBBTIDE_MEMORY_BUDGET", K::kBytes, cache, "`0` (none)",
       "bound on the step's peak of the training device's allocator above the step's start (what "
       "`torch.cuda.max_memory_allocated()` shows: saved activations, gradients, temporaries; bytes, e.g. "
       "`60GiB`); the planner keeps, offloads or recomputes each block to fit it at the least step time "
       "(Note [Budget plan]). On a CPU device it bounds the resident saved bytes, as "
       "`EBBTIDE_ACTIVATION_BUDGET` does. Turns the cache adaptive."),
      make("EBBTIDE_MAX_WRITE_MBPS", K::kFloat, cache, "`0` (no cap)",
       "cap on SSD writes in MB/s (10^6 bytes/s); the planner plans with min(measured, cap).", 0, kNoMax),

      make("EBBTIDE_OFFLOAD", K::kChoice, sw, "unset (off)",
       "`cpu`, `ssd` or `auto`: every Python process of the environment (torchrun's and `accelerate launch`'s "
       "workers too) offloads the activations of the HF/TRL, Lightning and torchtune trainers it runs, with this "
       "target, as if the script added ebbtide's integration (`ebbtide run` sets it; docs/integrations.md).",
       0, 0, {"cpu", "ssd", "auto"}),
      make("EBBTIDE_OFFLOAD_PATH", K::kText, sw, "the temporary folder",
       "with `EBBTIDE_OFFLOAD=ssd` or `auto`: the folder for the offloaded activations' files."),

      make("EBBTIDE_CKPT_CHUNK", K::kBytes, ckpt, "`4MiB`", "checksum and compression unit, a multiple of 4 KiB."),
      make("EBBTIDE_CKPT_QUEUE_DEPTH", K::kInt, ckpt, "`8`",
       "writes in flight (safetensors files: reads and writes in flight; 1-1024).", 1, 1024),
      make("EBBTIDE_CKPT_THREADS", K::kInt, ckpt, "min(4, cores)",
       "snapshot copy and compression threads (0-256; 0 = the default).", 0, 256),
      make("EBBTIDE_CKPT_ZSTD_LEVEL", K::kInt, ckpt, "`1`", "zstd level for lossless compression (-7..19).", -7, 19),
      make("EBBTIDE_CKPT_DIRECT", K::kBool, ckpt, "on",
       "O_DIRECT where the filesystem allows it (checkpoints and safetensors files)."),
      make("EBBTIDE_CKPT_RING", K::kBytes, ckpt, "max(`64MiB`, two chunks per write in flight)",
       "buffer a synchronous checkpoint save copies through, reused round the ring (at least two chunks)."),
      make("EBBTIDE_DCP_TEST_PARK", K::kChoice, ckpt, "unset",
       "test hook: `before-commit` parks a DCP save (`ebbtide.dcp`) after its `.metadata` is written, before "
       "the rename, and writes `EBBTIDE_DCP_TEST_PARK_MARKER`; crash tests kill it there.",
       0, 0, {"before-commit"}),
      make("EBBTIDE_DCP_TEST_PARK_MARKER", K::kText, ckpt, "unset",
       "test hook: the file `EBBTIDE_DCP_TEST_PARK` writes once the save is parked."),
  };
}

}  // namespace

const std::vector<Setting>& settings() {
  static const std::vector<Setting> table = make_table();
  return table;
}

const Setting& setting(std::string_view name) {
  for (const Setting& s : settings())
    if (s.name == name) return s;
  throw std::logic_error("ebbtide: '" + std::string(name) +
                         "' is not a setting (every EBBTIDE_* variable is a row of config::settings())");
}

std::string_view to_string(Kind kind) {
  switch (kind) {
    case Kind::kBytes: return "bytes";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kBool: return "bool";
    case Kind::kChoice: return "choice";
    case Kind::kText: return "text";
  }
  return "?";
}

}  // namespace ebbtide::config
