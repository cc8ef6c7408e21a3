// Internal: what the files of the performance model share: model.cpp (the
// configuration, FLOPs, parameters), model_activations.cpp (activation bytes),
// model_catalog.cpp (the model, GPU and SSD catalogs) and model_plan.cpp
// (make_plan, communication).
#pragma once

#include <cctype>
#include <string>
#include <string_view>

namespace ebbtide::plan {

inline std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace ebbtide::plan
