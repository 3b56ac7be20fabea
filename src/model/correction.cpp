#include "gradcomp/model/correction.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "gradcomp/error.h"

namespace gradcomp::model {

using nlohmann::json;

Cluster Correction::applied(Cluster cluster) const {
  cluster.inter.latency_s = std::min(cluster.inter.latency_s + extra_latency_s, kMaxLatencyS);
  cluster.intra.latency_s = std::min(cluster.intra.latency_s + extra_latency_s, kMaxLatencyS);
  return cluster;
}

Profile Correction::applied(Profile profile) const {
  profile.forward_s += step_overhead_s;
  return profile;
}

json Correction::to_json() const {
  return {{"extra_latency_s", extra_latency_s}, {"lambda", lambda},
          {"cost_scale", cost_scale},           {"step_overhead_s", step_overhead_s},
          {"error_before", error_before},       {"error_after", error_after}};
}

namespace {

struct Field {
  const char* name;
  double Correction::*member;
  double min;
  double max;
  bool optional;
};

// Upper bounds keep every corrected time finite; an error is a mean relative error (any size).
constexpr double kMaxOverheadS = 3600;
constexpr double kMaxError = 1e6;
constexpr Field kFields[] = {
    {"extra_latency_s", &Correction::extra_latency_s, 0, kMaxLatencyS, false},
    {"lambda", &Correction::lambda, 1, kMaxLambda, false},
    {"cost_scale", &Correction::cost_scale, kMinCostScale, kMaxCostScale, true},
    {"step_overhead_s", &Correction::step_overhead_s, 0, kMaxOverheadS, false},
    {"error_before", &Correction::error_before, 0, kMaxError, false},
    {"error_after", &Correction::error_after, 0, kMaxError, false},
};

[[noreturn]] void field_error(const std::string& field, const std::string& what) {
  throw Error(fmt::format("model correction: '{}' {}", field, what));
}

}  // namespace

Correction Correction::from_json(const json& json) {
  if (!json.is_object()) field_error("(top level)", "must be an object");
  for (const auto& item : json.items()) {
    // A named string, not a structured binding: clang 14 (the sanitizer build) cannot capture
    // a binding in a lambda.
    const std::string& key = item.key();
    const bool known = std::any_of(std::begin(kFields), std::end(kFields),
                                   [&](const Field& f) { return key == f.name; });
    if (!known) {
      field_error(key, "is unknown; expected extra_latency_s, lambda, cost_scale, "
                       "step_overhead_s, error_before, error_after");
    }
  }
  Correction c;
  for (const Field& f : kFields) {
    const auto it = json.find(f.name);
    if (it == json.end()) {
      if (f.optional) continue;
      field_error(f.name, "is missing");
    }
    if (!it->is_number()) field_error(f.name, fmt::format("must be a number, not {}", it->dump()));
    const double v = it->get<double>();
    if (!(v >= f.min && v <= f.max)) {
      field_error(f.name, fmt::format("= {} must be from {:g} to {:g}", it->dump(), f.min, f.max));
    }
    c.*f.member = v;
  }
  return c;
}

}  // namespace gradcomp::model
