// EngineOptions: environment overrides (docs/configuration.md).
#include "ebbtide/io/engine.hpp"
#include "ebbtide/util/config.hpp"

namespace ebbtide::io {

EngineOptions EngineOptions::with_env() const {
  EngineOptions o = *this;
  if (auto v = config::env_choice("EBBTIDE_IO_BACKEND"))
    o.backend = parse_backend(*v);
  if (auto v = config::env_bytes("EBBTIDE_IO_CHUNK_BYTES")) o.chunk_bytes = *v;
  if (auto v = config::env_int("EBBTIDE_IO_QUEUE_DEPTH")) o.queue_depth = static_cast<unsigned>(*v);
  if (auto v = config::env_bool("EBBTIDE_IO_CHECKSUM")) o.checksum = *v;
  if (auto v = config::env_bool("EBBTIDE_IO_DIRECT")) o.direct = *v;
  return o;
}

}  // namespace ebbtide::io
