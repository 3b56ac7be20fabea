// CodecCosts: per-codec encode and decode costs a + b n, read from JSON, fitted to `gradcomp
// bench codecs --json` output, and shipped as profiles/codec-costs.json.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <cmath>
#include <fstream>
#include <map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "gradcomp/json_text.h"
#include "gradcomp/model/cost_model.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/spec.h"

namespace gradcomp::model {
namespace {

using nlohmann::json;

[[noreturn]] void costs_field_error(const std::string& path, std::string_view what) {
  throw Error(fmt::format("codec costs: {}: {}", path, what));
}

double read_coefficient(const json& line, const std::string& path, const char* key) {
  const auto it = line.find(key);
  // An hour per call or per element is far beyond any codec, and keeps modelled times finite.
  constexpr std::string_view kExpected = "a number of seconds in 0 .. 3600";
  if (it == line.end())
    costs_field_error(path + "." + key, fmt::format("missing; expected {}", kExpected));
  if (!it->is_number() || !(it->get<double>() >= 0 && it->get<double>() <= 3600)) {
    costs_field_error(path + "." + key,
                      fmt::format("{} is not allowed; expected {}", it->dump(), kExpected));
  }
  return it->get<double>();
}

Linear read_linear(const json& entry, const std::string& path, const char* key) {
  const auto it = entry.find(key);
  if (it == entry.end())
    costs_field_error(path + "." + key, "missing; expected {\"a\": s, \"b\": s per element}");
  if (!it->is_object())
    costs_field_error(path + "." + key, "expected {\"a\": s, \"b\": s per element}");
  for (const auto& item : it->items()) {
    if (item.key() != "a" && item.key() != "b") {
      costs_field_error(path + "." + key,
                        fmt::format("unknown field '{}'; allowed: a, b", item.key()));
    }
  }
  const std::string where = path + "." + key;
  return {read_coefficient(*it, where, "a"), read_coefficient(*it, where, "b")};
}

CodecCost read_entry(const json& entry, const std::string& path) {
  if (!entry.is_object()) costs_field_error(path, "expected {\"encode\": .., \"decode\": ..}");
  for (const auto& item : entry.items()) {
    if (item.key() != "encode" && item.key() != "encode_ef" && item.key() != "decode") {
      costs_field_error(
          path, fmt::format("unknown field '{}'; allowed: encode, encode_ef, decode", item.key()));
    }
  }
  CodecCost cost;
  cost.encode = read_linear(entry, path, "encode");
  cost.encode_ef = entry.contains("encode_ef") ? read_linear(entry, path, "encode_ef") : cost.encode;
  cost.decode = read_linear(entry, path, "decode");
  return cost;
}

json linear_json(const Linear& l) { return {{"a", l.a}, {"b", l.b}}; }

// One measurement: seconds for `elements`.
struct Sample {
  double elements;
  double seconds;
};

// Least squares of a + b n on absolute seconds. A step's time adds absolute times, so the
// large buckets, where a codec costs milliseconds, must come out right; small sizes run from
// cache and are cheaper per element than a + b n can follow, which pulls the intercept below
// zero: then the line is refitted through zero.
Linear fit(const std::vector<Sample>& samples) {
  if (samples.empty()) return {};
  double scale = 0;  // n / scale keeps the normal equations well conditioned
  for (const Sample& s : samples) scale = std::max(scale, s.elements);
  double sw = 0, sx = 0, sxx = 0, st = 0, sxt = 0;
  for (const Sample& s : samples) {
    const double x = s.elements / scale;
    sw += 1, sx += x, sxx += x * x, st += s.seconds, sxt += x * s.seconds;
  }
  const double det = sw * sxx - sx * sx;
  if (samples.size() >= 2 && det > 1e-12 * sw * sxx) {
    const double a = (sxx * st - sx * sxt) / det, b = (sw * sxt - sx * st) / det;
    if (a >= 0 && b >= 0) return {a, b / scale};
    if (b < 0) return {st / sw, 0};  // no growth with n at all: a constant
  }
  return {0, sxt / sxx / scale};
}

double seconds_of(const json& row, const char* key, size_t index, double elements) {
  const auto it = row.find(key);
  if (it == row.end() || !it->is_number() || !(it->get<double>() > 0)) {
    throw Error(fmt::format("codec bench: results[{}].{}: missing or not a number > 0 (GB/s)",
                            index, key));
  }
  return 4 * elements / (it->get<double>() * 1e9);  // GB/s of float32 input
}

}  // namespace

CodecCosts CodecCosts::from_json(const json& json) {
  if (!json.is_object()) costs_field_error("(top level)", "expected an object of codec entries");
  const nlohmann::json* entries = &json;
  if (json.contains("codecs")) {
    for (const auto& item : json.items()) {
      if (item.key() != "codecs" && item.key() != "source" && item.key() != "command") {
        costs_field_error("(top level)",
                          fmt::format("unknown field '{}'; allowed next to 'codecs': "
                                      "source, command",
                                      item.key()));
      }
    }
    entries = &json["codecs"];
    if (!entries->is_object()) costs_field_error("codecs", "expected an object of codec entries");
  }
  CodecCosts costs;
  for (const auto& item : entries->items()) costs.set(item.key(), read_entry(item.value(), item.key()));
  return costs;
}

json CodecCosts::to_json() const {
  json out = json::object();
  for (const auto& [name, cost] : costs_) {
    out[name] = {{"encode", linear_json(cost.encode)}, {"encode_ef", linear_json(cost.encode_ef)},
                 {"decode", linear_json(cost.decode)}};
  }
  return out;
}

CodecCosts CodecCosts::fit_bench(const json& bench) {
  if (!bench.is_object() || !bench.contains("results") || !bench["results"].is_array()) {
    throw Error("codec bench: expected the JSON of `gradcomp bench codecs --json`, an object "
                "with a \"results\" array");
  }
  // Every spec measured gets an entry of its own; a codec's name gets the first spec listed
  // (the bench lists the recommended setting first), for the settings not measured.
  std::vector<std::pair<std::string, std::string>> listed;  // (name, spec), as first listed
  std::map<std::string, std::array<std::vector<Sample>, 3>> samples;  // by spec
  size_t index = 0;
  for (const json& row : bench["results"]) {
    if (!row.is_object() || !row.contains("codec") || !row["codec"].is_string() ||
        !row.contains("elements") || !row["elements"].is_number() ||
        !(row["elements"].get<double>() > 0)) {
      throw Error(fmt::format("codec bench: results[{}]: needs \"codec\" (a name) and "
                              "\"elements\" (> 0)", index));
    }
    if (row.contains("spec") && !row["spec"].is_string()) {
      throw Error(fmt::format("codec bench: results[{}]: \"spec\" must be a string (the "
                              "codec's spec, as `gradcomp bench codecs` writes it)", index));
    }
    const std::string name = row["codec"].get<std::string>();
    const std::string spec = row.value("spec", name);
    if (!samples.contains(spec)) listed.emplace_back(name, spec);
    const double n = row["elements"].get<double>();
    auto& s = samples[spec];
    s[0].push_back({n, seconds_of(row, "encode_gbps", index, n)});
    s[1].push_back({n, seconds_of(row, "encode_ef_gbps", index, n)});
    s[2].push_back({n, seconds_of(row, "decode_gbps", index, n)});
    ++index;
  }
  if (samples.empty()) throw Error("codec bench: \"results\" is empty; nothing to fit");
  CodecCosts costs;
  for (const auto& [name, spec] : listed) {
    const auto& s = samples.at(spec);
    costs.set_measured(name, spec, {fit(s[0]), fit(s[1]), fit(s[2])});
  }
  return costs;
}

CodecCosts CodecCosts::shipped() {
  const std::string path = profiles_directory() + "/codec-costs.json";
  std::ifstream in(path);
  if (!in) {
    throw Error(fmt::format("codec costs: cannot open '{}'; set GRADCOMP_PROFILES to the "
                            "directory that holds codec-costs.json",
                            path));
  }
  const json root = read_json_file(path, "codec costs file");
  return with_context(fmt::format("codec costs file '{}'", path), [&] { return from_json(root); });
}

const CodecCost& CodecCosts::of(const std::string& spec_or_name) const {
  if (const CodecCost* cost = find(spec_or_name)) return *cost;
  throw Error(
      fmt::format("codec costs: no entry for codec '{}'; entries: {} (measure it with "
                  "`gradcomp bench codecs` and fit, or give its costs)",
                  spec_or_name, fmt::join(names(), ", ")));
}

const CodecCost& CodecCosts::of(const Codec& codec) const {
  if (const CodecCost* cost = find(codec.spec())) return *cost;
  return of(codec.name());
}

const CodecCost* CodecCosts::find(const std::string& spec_or_name) const {
  const auto it = costs_.find(spec_or_name);
  return it == costs_.end() ? nullptr : &it->second;
}

std::vector<std::string> CodecCosts::names() const {
  std::vector<std::string> out;
  for (const auto& item : costs_) out.push_back(item.first);
  return out;
}

void CodecCosts::set(const std::string& spec_or_name, CodecCost cost) {
  costs_[spec_or_name] = cost;
}

void CodecCosts::set_measured(const std::string& name, const std::string& spec, CodecCost cost) {
  if (!costs_.contains(name)) set(name, cost);
  set(spec, cost);
}

CodecCosts CodecCosts::scaled(double factor) const {
  if (!(factor > 0) || !std::isfinite(factor)) {
    throw Error(fmt::format("codec costs: scale factor {} must be > 0", factor));
  }
  CodecCosts out;
  const auto scale = [factor](Linear l) { return Linear{l.a * factor, l.b * factor}; };
  for (const auto& [name, c] : costs_) {
    out.set(name, {scale(c.encode), scale(c.encode_ef), scale(c.decode)});
  }
  return out;
}

}  // namespace gradcomp::model
