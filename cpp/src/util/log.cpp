#include "ebbtide/util/log.hpp"

#include <cstdio>
#include <mutex>
#include <unordered_set>
#include <variant>

#include "ebbtide/util/config.hpp"

namespace ebbtide::log {
namespace {

struct State {
  std::mutex mu;
  Level level = Level::kWarn;
  std::unordered_set<std::string> once;
  std::function<void(Level, const std::string&)> sink;
};

Level parse_env_level() {
  auto v = config::env_choice("EBBTIDE_LOG_LEVEL");  // checked against the row's choices
  return v ? parse_level(*v, "EBBTIDE_LOG_LEVEL") : Level::kWarn;
}

State& state() {
  static State* s = [] {
    auto* st = new State();  // leaked on purpose: usable from static destructors
    st->level = parse_env_level();
    return st;
  }();
  return *s;
}

const char* level_name(Level l) {
  switch (l) {
    case Level::kError: return "error";
    case Level::kWarn: return "warning";
    case Level::kInfo: return "info";
    case Level::kDebug: return "debug";
  }
  return "?";
}

}  // namespace

Level level() { return state().level; }

Level parse_level(std::string_view name, std::string_view what) {
  // The row's choices are the levels in order, most severe first.
  const std::string v = std::get<std::string>(
      config::check_argument("EBBTIDE_LOG_LEVEL", std::string(name == "warning" ? "warn" : name), what));
  const auto& choices = config::setting("EBBTIDE_LOG_LEVEL").choices;
  for (size_t i = 0; i < choices.size(); ++i)
    if (choices[i] == v) return static_cast<Level>(i);
  return Level::kWarn;
}

void set_level(Level level) {
  std::lock_guard lock(state().mu);
  state().level = level;
}

void set_sink(std::function<void(Level, const std::string&)> sink) {
  std::lock_guard lock(state().mu);
  state().sink = std::move(sink);
}

void write(Level level, const std::string& msg) {
  std::function<void(Level, const std::string&)> sink;
  {
    std::lock_guard lock(state().mu);
    if (level > state().level) return;
    sink = state().sink;
  }
  if (sink) {
    sink(level, msg);
  } else {
    std::fprintf(stderr, "ebbtide %s: %s\n", level_name(level), msg.c_str());
  }
}

bool warn_once(const std::string& key, const std::string& msg) {
  {
    std::lock_guard lock(state().mu);
    if (!state().once.insert(key).second) return false;
  }
  write(Level::kWarn, msg);
  return true;
}

}  // namespace ebbtide::log
