// Logging to stderr with a level from EBBTIDE_LOG_LEVEL (error, warn, info,
// debug; default warn). warn_once() says a thing once per process per key,
// for fallbacks ("O_DIRECT refused on tmpfs: buffered I/O"). Thread safe.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "ebbtide/util/error.hpp"

namespace ebbtide::log {

enum class Level { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

Level level();
void set_level(Level level);
// A level by name: a choice of the EBBTIDE_LOG_LEVEL row of the settings
// table ("warning" too), else InvalidArgument naming `what` and the value.
Level parse_level(std::string_view name, std::string_view what);
void write(Level level, const std::string& msg);
// Returns true the first time `key` is seen, and logs msg at kWarn then.
bool warn_once(const std::string& key, const std::string& msg);

// A sink replacing stderr (the Python binding routes to the `logging` module);
// nullptr restores stderr.
void set_sink(std::function<void(Level, const std::string&)> sink);

template <typename... Args>
void error(Args&&... args) { if (level() >= Level::kError) write(Level::kError, detail::concat(std::forward<Args>(args)...)); }
template <typename... Args>
void warn(Args&&... args) { if (level() >= Level::kWarn) write(Level::kWarn, detail::concat(std::forward<Args>(args)...)); }
template <typename... Args>
void info(Args&&... args) { if (level() >= Level::kInfo) write(Level::kInfo, detail::concat(std::forward<Args>(args)...)); }
template <typename... Args>
void debug(Args&&... args) { if (level() >= Level::kDebug) write(Level::kDebug, detail::concat(std::forward<Args>(args)...)); }

}  // namespace ebbtide::log
