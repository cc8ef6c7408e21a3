#include "ebbtide/util/config.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <type_traits>

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

namespace {

// The row for `name`, which must have kind `kind` (std::logic_error otherwise).
const Setting& row(std::string_view name, Kind kind) {
  const Setting& s = setting(name);
  if (s.kind != kind)
    throw std::logic_error("ebbtide: setting " + std::string(name) + " is read as " + std::string(to_string(kind)) +
                           " but the table says " + std::string(to_string(s.kind)));
  return s;
}

std::string variable(std::string_view name) { return "environment variable " + std::string(name); }

int64_t parse_int(const std::string& text, std::string_view what) {
  std::string t = trim(text);
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(t.c_str(), &end, 10);
  EBB_CHECK(errno == 0 && !t.empty() && *end == '\0', what, "='", text, "' is not an integer");
  return x;
}

void check_range(const Setting& s, double x, std::string_view what, std::string_view shown) {
  EBB_CHECK(std::isfinite(x), what, "=", shown, " is not a finite number");
  if (s.max >= 1e18) EBB_CHECK(x >= s.min, what, "=", shown, " must be >= ", s.min);
  else EBB_CHECK(x >= s.min && x <= s.max, what, "=", shown, " is out of range [", s.min, ", ", s.max, "]");
}

std::string check_choice(const Setting& s, const std::string& text, std::string_view what) {
  std::string t = lower(trim(text));
  for (const auto& c : s.choices)
    if (t == c) return t;
  std::string valid;
  for (const auto& c : s.choices) valid += (valid.empty() ? "" : ", ") + std::string(c);
  EBB_CHECK(false, what, "='", text, "' is not valid (valid: ", valid, ")");
  return t;
}

std::optional<bool> parse_bool(const std::string& text) {
  std::string t = lower(trim(text));
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  return std::nullopt;
}

}  // namespace

std::optional<std::string> env_string(std::string_view name) {
  setting(name);
  const char* v = std::getenv(std::string(name).c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::optional<uint64_t> env_bytes(std::string_view name) {
  row(name, Kind::kBytes);
  auto v = env_string(name);
  if (!v) return std::nullopt;
  return parse_bytes(*v, variable(name));
}

std::optional<int64_t> env_int(std::string_view name) {
  const Setting& s = row(name, Kind::kInt);
  auto v = env_string(name);
  if (!v) return std::nullopt;
  int64_t x = parse_int(*v, variable(name));
  check_range(s, static_cast<double>(x), variable(name), std::to_string(x));
  return x;
}

std::optional<double> env_float(std::string_view name) {
  const Setting& s = row(name, Kind::kFloat);
  auto v = env_string(name);
  if (!v) return std::nullopt;
  std::string t = trim(*v);
  char* end = nullptr;
  double x = std::strtod(t.c_str(), &end);
  EBB_CHECK(!t.empty() && *end == '\0', variable(name), "='", *v, "' is not a number");
  check_range(s, x, variable(name), t);
  return x;
}

std::optional<bool> env_bool(std::string_view name) {
  row(name, Kind::kBool);
  auto v = env_string(name);
  if (!v) return std::nullopt;
  auto b = parse_bool(*v);
  EBB_CHECK(b.has_value(), variable(name), "='", *v, "' is not a boolean (use 1/0, true/false, on/off)");
  return b;
}

std::optional<std::string> env_choice(std::string_view name) {
  const Setting& s = row(name, Kind::kChoice);
  auto v = env_string(name);
  if (!v) return std::nullopt;
  return check_choice(s, *v, variable(name));
}

namespace {

template <class T>
std::optional<Value> as_value(const std::optional<T>& v) {
  if (!v) return std::nullopt;
  if constexpr (std::is_same_v<T, uint64_t>) return Value(static_cast<int64_t>(*v));
  else return Value(*v);
}

}  // namespace

std::optional<Value> env_value(std::string_view name) {
  switch (setting(name).kind) {
    case Kind::kBytes: return as_value(env_bytes(name));
    case Kind::kInt: return as_value(env_int(name));
    case Kind::kFloat: return as_value(env_float(name));
    case Kind::kBool: return as_value(env_bool(name));
    case Kind::kChoice: return as_value(env_choice(name));
    case Kind::kText: return as_value(env_string(name));
  }
  return std::nullopt;
}

namespace {

// A value as Python would print it, for error messages.
std::string shown(const Value& value) {
  if (const auto* b = std::get_if<bool>(&value)) return *b ? "True" : "False";
  if (const auto* i = std::get_if<int64_t>(&value)) return std::to_string(*i);
  if (const auto* t = std::get_if<std::string>(&value)) return "'" + *t + "'";
  std::ostringstream out;
  out << std::get<double>(value);
  return out.str();
}

}  // namespace

Value check_argument(std::string_view name, const Value& value, std::string_view what) {
  const Setting& s = setting(name);
  const auto* i = std::get_if<int64_t>(&value);
  const auto* d = std::get_if<double>(&value);
  const auto* t = std::get_if<std::string>(&value);
  const std::string v = shown(value);
  switch (s.kind) {
    case Kind::kBytes:
      if (t) return Value(static_cast<int64_t>(parse_bytes(*t, what)));
      EBB_CHECK(i != nullptr && *i >= 0, what, "=", v, " must be >= 0 (a whole number of bytes)");
      return value;
    case Kind::kInt:
      EBB_CHECK(i != nullptr, what, "=", v, " must be an integer");
      check_range(s, static_cast<double>(*i), what, v);
      return value;
    case Kind::kFloat:
      EBB_CHECK(i != nullptr || d != nullptr, what, "=", v, " must be a number");
      check_range(s, i ? static_cast<double>(*i) : *d, what, v);
      return Value(i ? static_cast<double>(*i) : *d);
    case Kind::kBool:
      EBB_CHECK(std::holds_alternative<bool>(value), what, "=", v, " must be True or False");
      return value;
    case Kind::kChoice:
      EBB_CHECK(t != nullptr, what, "=", v, " must be a string");
      return Value(check_choice(s, *t, what));
    case Kind::kText:
      EBB_CHECK(t != nullptr, what, "=", v, " must be a string");
      return value;
  }
  return value;
}

}  // namespace ebbtide::config
