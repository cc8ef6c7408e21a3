// Settings: constructor arguments first, then EBBTIDE_* environment variables,
// all parsed here. A bad value throws InvalidArgument naming the variable and
// the value. Every variable is documented in docs/configuration.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ebbtide::config {

// "4GiB", "1MiB", "512k", "4096", "1.5G" -> bytes. Binary units (K=KiB).
// `what` names the setting in the error message.
uint64_t parse_bytes(std::string_view text, std::string_view what);
// Formats bytes for people: 1536 -> "1.5 KiB".
std::string format_bytes(double bytes);

std::optional<std::string> env_string(const char* name);
std::optional<uint64_t> env_bytes(const char* name);
std::optional<int64_t> env_int(const char* name, int64_t min_value, int64_t max_value);
std::optional<bool> env_bool(const char* name);
// One of `choices` (case-insensitive), returned lower-cased.
std::optional<std::string> env_choice(const char* name, const std::vector<std::string>& choices);

}  // namespace ebbtide::config
