#include "gradcomp/model/correction.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"

namespace gradcomp::model {

using nlohmann::json;

namespace {

Link corrected(Link link, const Correction& c) {
  link.latency_s = std::min(link.latency_s + c.extra_latency_s, kMaxLatencyS);
  link.bytes_per_s = std::clamp(link.bytes_per_s * c.bandwidth_scale, kMinBytesPerS, kMaxBytesPerS);
  return link;
}

}  // namespace

Cluster Correction::applied(Cluster cluster) const {
  cluster.inter = corrected(cluster.inter, *this);
  cluster.intra = corrected(cluster.intra, *this);
  return cluster;
}

Profile Correction::applied(Profile profile) const {
  profile.forward_s += step_overhead_s;
  return profile;
}

std::map<std::string, double> elements_by_codec(const Plan& plan) {
  const std::vector<TensorPiece> pieces = plan.pieces();  // once: it copies every tensor
  std::map<std::string, double> out;
  for (const auto& bucket : plan.buckets) {
    const std::string& spec = bucket.option.codec;  // "name" or "name:param=value,..."
    double& n = out[spec.substr(0, spec.find(':'))];
    for (size_t t : bucket.tensors) {
      if (t < pieces.size()) n += static_cast<double>(pieces[t].info.elements);
    }
  }
  return out;
}

double Correction::lambda_of(const Plan& plan) const {
  if (codec_lambdas.empty()) return lambda;
  const auto elements = elements_by_codec(plan);
  double total = 0;
  for (const auto& [name, n] : elements) total += n;
  return lambda_of(elements, total);
}

double Correction::lambda_of(const std::map<std::string, double>& elements, double total) const {
  if (codec_lambdas.empty() || !(total > 0)) return lambda;
  double weighted = 0;
  for (const auto& [name, n] : elements) {
    const auto it = codec_lambdas.find(name);
    weighted += n * (it == codec_lambdas.end() ? lambda : it->second);
  }
  return weighted / total;
}

std::string Correction::summary() const {
  std::string out = fmt::format("+{:g} us a message, link rate x{:g}, lambda {:g}",
                                extra_latency_s * 1e6, bandwidth_scale, lambda);
  for (const auto& [name, slow_down] : codec_lambdas) {
    out += fmt::format(", {} {:g}", name, slow_down);
  }
  if (cost_scale != 1) out += fmt::format(", codec costs x{:g}", cost_scale);
  return out + fmt::format(", +{:.1f} ms a step (fitted error {:.1f}% -> {:.1f}%)",
                           step_overhead_s * 1e3, 100 * error_before, 100 * error_after);
}

json Correction::to_json() const {
  return {{"extra_latency_s", extra_latency_s}, {"lambda", lambda},
          {"bandwidth_scale", bandwidth_scale}, {"cost_scale", cost_scale},
          {"codec_lambdas", codec_lambdas},       {"step_overhead_s", step_overhead_s},
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
    {"bandwidth_scale", &Correction::bandwidth_scale, kMinBandwidthScale, kMaxBandwidthScale,
     true},
    {"cost_scale", &Correction::cost_scale, kMinCostScale, kMaxCostScale, true},
    {"step_overhead_s", &Correction::step_overhead_s, 0, kMaxOverheadS, false},
    {"error_before", &Correction::error_before, 0, kMaxError, false},
    {"error_after", &Correction::error_after, 0, kMaxError, false},
};
constexpr const char* kCodecLambdas = "codec_lambdas";

[[noreturn]] void correction_field_error(const std::string& field, const std::string& what) {
  throw Error(fmt::format("model correction: '{}' {}", field, what));
}

double checked_number(const std::string& field, const json& value, double min, double max) {
  if (!value.is_number())
    correction_field_error(field, fmt::format("must be a number, not {}", value.dump()));
  const double v = value.get<double>();
  if (!(v >= min && v <= max)) {
    correction_field_error(field,
                           fmt::format("= {} must be from {:g} to {:g}", value.dump(), min, max));
  }
  return v;
}

// {"codec name": lambda}: names of known codecs, slow-downs in lambda's range.
std::map<std::string, double> codec_lambdas_from(const json& value) {
  if (!value.is_object()) {
    correction_field_error(kCodecLambdas,
                           fmt::format("must be an object of codec names and slow-downs, "
                                       "not {}",
                                       value.dump()));
  }
  const auto names = codec_names();
  std::map<std::string, double> out;
  for (const auto& item : value.items()) {
    const std::string field = fmt::format("{}.{}", kCodecLambdas, item.key());
    if (std::find(names.begin(), names.end(), item.key()) == names.end()) {
      correction_field_error(
          field, fmt::format("is not a codec; expected one of {}", fmt::join(names, ", ")));
    }
    out[item.key()] = checked_number(field, item.value(), 1, kMaxLambda);
  }
  return out;
}

}  // namespace

Correction Correction::from_json(const json& json) {
  if (!json.is_object()) correction_field_error("(top level)", "must be an object");
  for (const auto& item : json.items()) {
    // A named string, not a structured binding: clang 14 (the sanitizer build) cannot capture
    // a binding in a lambda.
    const std::string& key = item.key();
    const bool known = key == kCodecLambdas ||
                       std::any_of(std::begin(kFields), std::end(kFields),
                                   [&](const Field& f) { return key == f.name; });
    if (!known) {
      correction_field_error(
          key,
          "is unknown; expected extra_latency_s, lambda, bandwidth_scale, "
          "cost_scale, codec_lambdas, step_overhead_s, error_before, error_after");
    }
  }
  Correction c;
  for (const Field& f : kFields) {
    const auto it = json.find(f.name);
    if (it == json.end()) {
      if (f.optional) continue;
      correction_field_error(f.name, "is missing");
    }
    c.*f.member = checked_number(f.name, *it, f.min, f.max);
  }
  if (const auto it = json.find(kCodecLambdas); it != json.end()) {
    c.codec_lambdas = codec_lambdas_from(*it);
  }
  return c;
}

}  // namespace gradcomp::model
