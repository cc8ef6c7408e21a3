// Settings: constructor arguments first, then EBBTIDE_* environment variables.
// Every variable is a row of one table (settings(), cpp/src/util/settings.cpp)
// with its kind, its range or choices, its default and its meaning; the
// readers below are the only code that reads EBBTIDE_* variables, and they
// refuse names that are not in the table. A bad value throws InvalidArgument
// naming the variable (or the argument) and the value. docs/configuration.md
// is checked against the table by a test.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace ebbtide::config {

// "4GiB", "1MiB", "512k", "4096", "1.5G" -> bytes. Binary units (K=KiB).
// `what` names the setting in the error message.
uint64_t parse_bytes(std::string_view text, std::string_view what);
// Formats bytes for people: 1536 -> "1.5 KiB".
std::string format_bytes(double bytes);

enum class Kind { kBytes, kInt, kFloat, kBool, kChoice, kText };
std::string_view to_string(Kind kind);

struct Setting {
  std::string_view name;          // EBBTIDE_...
  Kind kind;
  std::string_view section;       // the heading of docs/configuration.md it is listed under
  std::string_view default_text;  // as documented
  std::string_view meaning;       // as documented
  double min = 0, max = 0;        // kInt and kFloat: the valid range, inclusive
  std::vector<std::string_view> choices;  // kChoice: valid values, lower case
};

// The table, in documentation order.
const std::vector<Setting>& settings();
// The row named `name`; std::logic_error when there is none (a programming error).
const Setting& setting(std::string_view name);

// Typed readers: nullopt when the variable is unset or empty. Each checks that
// `name` is in the table with that kind (std::logic_error otherwise).
std::optional<std::string> env_string(std::string_view name);  // any kind, raw text
std::optional<uint64_t> env_bytes(std::string_view name);
std::optional<int64_t> env_int(std::string_view name);
std::optional<double> env_float(std::string_view name);
std::optional<bool> env_bool(std::string_view name);
std::optional<std::string> env_choice(std::string_view name);  // lower-cased

// A value given as an argument, checked against the row of the setting it
// backs; `what` names the argument in errors ("ebbtide.TensorCache: workers").
using Value = std::variant<bool, int64_t, double, std::string>;
Value check_argument(std::string_view name, const Value& value, std::string_view what);
// The variable's value, parsed and checked as its kind; nullopt when unset.
std::optional<Value> env_value(std::string_view name);

}  // namespace ebbtide::config
