// AutoSettings: compression="auto"'s settings, checked, and read from the JSON object a user
// gives (Python's auto= dict, the examples' --auto flag).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <type_traits>
#include <variant>

#include "gradcomp/error.h"
#include "gradcomp/option.h"
#include "gradcomp/scheduler.h"

namespace gradcomp {

using nlohmann::json;

namespace {

// A count of steps, plans or checks: a whole number, 0 or more (JSON 5, not 5.0 or "5").
uint64_t whole(const std::string& key, const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) return value.get<uint64_t>();
  throw SpecError(fmt::format("auto: {} is {}; a whole number, 0 or more", key, value.dump()));
}

double number(const std::string& key, const json& value) {
  if (!value.is_number()) {
    throw SpecError(fmt::format("auto: {} is {}; a number", key, value.dump()));
  }
  return value.get<double>();
}

bool flag(const std::string& key, const json& value) {
  if (!value.is_boolean()) {
    throw SpecError(fmt::format("auto: {} is {}; true or false", key, value.dump()));
  }
  return value.get<bool>();
}

std::vector<std::string> options(const std::string& key, const json& value) {
  const bool strings = value.is_array() && std::all_of(value.begin(), value.end(),
                                                       [](const json& v) { return v.is_string(); });
  if (!strings) {
    throw SpecError(
        fmt::format("auto: {} is {}; a list of options, \"codec[|feedback[|route]]\" "
                    "each (e.g. [\"powersgd:rank=4|ef\", \"fp16\"])",
                    key, value.dump()));
  }
  return value.get<std::vector<std::string>>();
}

using Field = std::variant<uint64_t AutoSettings::*, double AutoSettings::*, bool AutoSettings::*,
                           std::vector<std::string> AutoSettings::*>;

// The settings a user may give, by name; the others are the front end's (buckets, nodes) or a
// calibration's (link, codec costs).
const std::map<std::string, Field>& fields() {
  static const std::map<std::string, Field> table = {
      {"candidates", &AutoSettings::candidates},
      {"warmup_steps", &AutoSettings::warmup_steps},
      {"profile_steps", &AutoSettings::profile_steps},
      {"trial_steps", &AutoSettings::trial_steps},
      {"stop_after", &AutoSettings::stop_after},
      {"stop_margin", &AutoSettings::stop_margin},
      {"max_proposals", &AutoSettings::max_proposals},
      {"refine_proposals", &AutoSettings::refine_proposals},
      {"runoff", &AutoSettings::runoff},
      {"drift", &AutoSettings::drift},
      {"check_every", &AutoSettings::check_every},
      {"drift_checks", &AutoSettings::drift_checks},
      {"link_check_every", &AutoSettings::link_check_every},
      {"link_change", &AutoSettings::link_change},
      {"residual_growth", &AutoSettings::residual_growth},
      {"residual_checks", &AutoSettings::residual_checks},
      {"verbose", &AutoSettings::verbose},
  };
  return table;
}

// Sets the field `key` names to `value`, read as the field's type.
void set(AutoSettings& settings, const std::string& key, const json& value) {
  const auto field = fields().find(key);
  if (field == fields().end()) {
    throw SpecError(fmt::format("auto: unknown setting '{}'; known: {}", key,
                                fmt::join(AutoSettings::known_keys(), ", ")));
  }
  std::visit(
      [&](auto member) {
        using T = std::remove_reference_t<decltype(settings.*member)>;
        if constexpr (std::is_same_v<T, uint64_t>) settings.*member = whole(key, value);
        if constexpr (std::is_same_v<T, double>) settings.*member = number(key, value);
        if constexpr (std::is_same_v<T, bool>) settings.*member = flag(key, value);
        if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          settings.*member = options(key, value);
        }
      },
      field->second);
}

}  // namespace

AutoSettings AutoSettings::from_json(const json& given) { return from_json(given, {}); }

AutoSettings AutoSettings::from_json(const json& given, AutoSettings settings) {
  if (!given.is_object() && !given.is_null()) {
    throw SpecError(
        fmt::format("auto: the settings are {}; a JSON object of settings by name, "
                    "e.g. {{\"warmup_steps\": 20}}",
                    given.dump()));
  }
  if (given.is_object()) {
    for (const auto& [key, value] : given.items()) {
      set(settings, key, value);
    }
  }
  settings.validate();
  return settings;
}

std::vector<std::string> AutoSettings::known_keys() {
  std::vector<std::string> keys;
  for (const auto& [key, field] : fields()) keys.push_back(key);
  return keys;
}

std::vector<std::string> AutoSettings::steady_candidates() const {
  std::vector<std::string> out;
  for (const auto& text : candidates) {
    const Option option = parse_option(text);
    if (option.codec == "none") continue;
    // Without a route named, the planner tries every route the codec can take.
    out.push_back(option_names_route(text)
                      ? fmt::format("{}|{}|{}", option.codec, option.feedback, option.route)
                      : fmt::format("{}|{}", option.codec, option.feedback));
  }
  return out;
}

void AutoSettings::validate() const {
  for (const auto& c : candidates) parse_option(c);  // SpecError naming what is unknown
  if (profile_steps < 1 || warmup_steps < profile_steps) {
    throw SpecError(
        fmt::format("auto: warmup_steps ({}) must be at least profile_steps ({}), "
                    "which must be at least 1",
                    warmup_steps, profile_steps));
  }
  if (!(stop_margin >= 0 && stop_margin < 1e6)) {
    throw SpecError(
        fmt::format("auto: stop_margin is {}; a share of the step time, 0 or more", stop_margin));
  }
  if (trial_steps < 2) {
    throw SpecError(
        fmt::format("auto: trial_steps is {}; at least 2 (the first step of a "
                    "trial is not measured)",
                    trial_steps));
  }
  if (!(drift > 0 && drift < 10)) {
    throw SpecError(fmt::format("auto: drift is {}; a relative change in (0, 10)", drift));
  }
  if (check_every < 1 || drift_checks < 1 || residual_checks < 1) {
    throw SpecError("auto: check_every, drift_checks and residual_checks must be at least 1");
  }
  if (!(link_change > 1 && link_change < 1e6)) {
    throw SpecError(
        fmt::format("auto: link_change is {}; a factor above 1 (how many times faster "
                    "the link's probe must run to decide again)",
                    link_change));
  }
  if (local_size < 0 || local_size > (1 << 20)) {
    throw SpecError(
        fmt::format("auto: local_size is {}; ranks per node, or 0 for the "
                    "launcher's",
                    local_size));
  }
  if (!(residual_growth > 1 && residual_growth < 1e6)) {
    throw SpecError(fmt::format("auto: residual_growth is {}; a factor above 1", residual_growth));
  }
}

}  // namespace gradcomp
