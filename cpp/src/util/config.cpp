#include "ebbtide/util/config.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "ebbtide/util/error.hpp"

namespace ebbtide::config {

namespace {
std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}
std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}
}  // namespace

uint64_t parse_bytes(std::string_view text, std::string_view what) {
  std::string t = trim(text);
  EBB_CHECK(!t.empty(), what, ": empty size");
  size_t pos = 0;
  while (pos < t.size() && (std::isdigit(static_cast<unsigned char>(t[pos])) || t[pos] == '.')) ++pos;
  EBB_CHECK(pos > 0, what, ": '", t, "' is not a size (examples: 4096, 512KiB, 1MiB, 4GiB)");
  double number = 0;
  try {
    number = std::stod(t.substr(0, pos));
  } catch (const std::exception&) {
    EBB_CHECK(false, what, ": '", t, "' is not a size");
  }
  std::string unit = lower(trim(t.substr(pos)));
  if (!unit.empty() && unit.back() == 'b') unit.pop_back();      // "kb", "kib", "b"
  if (!unit.empty() && unit.back() == 'i') unit.pop_back();      // "ki"
  double mult = 1;
  if (unit.empty()) mult = 1;
  else if (unit == "k") mult = 1024.0;
  else if (unit == "m") mult = 1024.0 * 1024;
  else if (unit == "g") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t") mult = 1024.0 * 1024 * 1024 * 1024;
  else EBB_CHECK(false, what, ": unknown unit in '", t, "' (valid: B, KiB, MiB, GiB, TiB)");
  double bytes = number * mult;
  EBB_CHECK(std::isfinite(bytes) && bytes < 1.8e19, what, ": '", t, "' is too large");
  EBB_CHECK(bytes == std::floor(bytes), what, ": '", t, "' is not a whole number of bytes");
  return static_cast<uint64_t>(bytes);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  if (u == 0) std::snprintf(buf, sizeof buf, "%.0f B", v);
  else std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

std::optional<std::string> env_string(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::optional<uint64_t> env_bytes(const char* name) {
  auto v = env_string(name);
  if (!v) return std::nullopt;
  return parse_bytes(*v, std::string("environment variable ") + name);
}

std::optional<int64_t> env_int(const char* name, int64_t min_value, int64_t max_value) {
  auto v = env_string(name);
  if (!v) return std::nullopt;
  std::string t = trim(*v);
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(t.c_str(), &end, 10);
  EBB_CHECK(errno == 0 && end != t.c_str() && *end == '\0', "environment variable ", name, "='", *v,
            "' is not an integer");
  EBB_CHECK(x >= min_value && x <= max_value, "environment variable ", name, "=", x,
            " is out of range [", min_value, ", ", max_value, "]");
  return x;
}

std::optional<bool> env_bool(const char* name) {
  auto v = env_string(name);
  if (!v) return std::nullopt;
  std::string t = lower(trim(*v));
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  EBB_CHECK(false, "environment variable ", name, "='", *v, "' is not a boolean (use 1/0, true/false, on/off)");
  return false;
}

std::optional<std::string> env_choice(const char* name, const std::vector<std::string>& choices) {
  auto v = env_string(name);
  if (!v) return std::nullopt;
  std::string t = lower(trim(*v));
  for (const auto& c : choices)
    if (t == c) return t;
  std::string valid;
  for (const auto& c : choices) valid += (valid.empty() ? "" : ", ") + c;
  EBB_CHECK(false, "environment variable ", name, "='", *v, "' is not valid (valid: ", valid, ")");
  return std::nullopt;
}

}  // namespace ebbtide::config
