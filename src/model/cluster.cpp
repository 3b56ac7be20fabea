// Cluster: validation, the JSON form, and the units of rates and durations.
//
// JSON (every field named in errors by its path, "inter.bandwidth"):
//   {"workers": 64, "per_node": 8,
//    "inter": {"bandwidth": "25gbit", "latency": "10us"},
//    "intra": {"bandwidth": "100gbit", "latency": "5us"},
//    "servers": 64}
// A bandwidth is a string with a unit (parse_rate) or a number of bytes per second; a latency a
// string with a unit (parse_duration) or a number of seconds. per_node defaults to 1; "intra"
// may be left out only when per_node is 1 (no link inside a node is used then); "servers" (the
// dedicated parameter servers route 'servers' reaches) defaults to 0: none (the planner does not
// offer the route; a plan naming it is priced with as many as workers).
#include "gradcomp/model/cluster.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <optional>
#include <cmath>
#include <initializer_list>
#include <string_view>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"

namespace gradcomp::model {
namespace {

using nlohmann::json;

[[noreturn]] void cluster_field_error(std::string_view path, std::string_view what) {
  throw Error(fmt::format("cluster: {}: {}", path, what));
}

std::string cluster_path(std::string_view path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

// The ranges of cluster.h, checked wherever a rate or latency enters the model (JSON, flags,
// parse_rate, validate()); the negated comparisons also refuse NaN.
void check_rate(double bytes_per_s, std::string_view name) {
  if (!(bytes_per_s >= kMinBytesPerS && bytes_per_s <= kMaxBytesPerS)) {
    throw Error(fmt::format("{} = {:.4g} bytes per second is out of range; allowed: 1 kbit/s .. "
                            "1 Pbit/s ({} .. {} bytes per second)",
                            name, bytes_per_s, kMinBytesPerS, kMaxBytesPerS));
  }
}

void check_latency(double seconds, std::string_view name) {
  if (!(seconds >= 0 && seconds <= kMaxLatencyS)) {
    throw Error(fmt::format("{} = {:.4g} seconds is out of range; allowed: 0 .. {} s", name,
                            seconds, kMaxLatencyS));
  }
}

// A misspelt optional field ("per_nod") must be an error, not a silent default.
void check_cluster_keys(const json& object, std::string_view path,
                        std::initializer_list<std::string_view> allowed) {
  if (!object.is_object())
    cluster_field_error(path.empty() ? "(top level)" : path, "expected an object");
  for (const auto& item : object.items()) {
    if (std::find(allowed.begin(), allowed.end(), item.key()) == allowed.end()) {
      throw Error(fmt::format("cluster: {}: unknown field '{}'; allowed: {}",
                              path.empty() ? "(top level)" : path, item.key(),
                              fmt::join(allowed, ", ")));
    }
  }
}

int read_cluster_count(const json& object, std::string_view path, std::string_view key,
                       std::optional<int> fallback) {
  const auto it = object.find(key);
  const std::string where = cluster_path(path, key);
  if (it == object.end()) {
    if (!fallback) cluster_field_error(where, "missing; expected an integer >= 1");
    return *fallback;
  }
  if (!it->is_number_integer()) cluster_field_error(where, "expected an integer >= 1");
  const auto value = it->get<long long>();
  if (value < 1 || value > kMaxWorkers) {
    cluster_field_error(where,
                        fmt::format("{} is out of range; allowed: 1 .. {}", value, kMaxWorkers));
  }
  return static_cast<int>(value);
}

// A rate or duration: a number in the base unit, or a string parsed with `parse`.
double read_quantity(const json& object, std::string_view path, std::string_view key,
                     std::string_view expected, double (*parse)(const std::string&)) {
  const auto it = object.find(key);
  const std::string where = cluster_path(path, key);
  if (it == object.end()) cluster_field_error(where, fmt::format("missing; expected {}", expected));
  if (it->is_number()) return it->get<double>();
  if (!it->is_string()) cluster_field_error(where, fmt::format("expected {}", expected));
  try {
    return parse(it->get<std::string>());
  } catch (const Error& e) {
    cluster_field_error(where, e.what());
  }
}

Link read_link(const json& object, std::string_view key) {
  const json& link = object.at(key);
  check_cluster_keys(link, key, {"bandwidth", "latency"});
  const Link out{.bytes_per_s = read_quantity(link, key, "bandwidth",
                                              "a rate such as \"25gbit\" or a number of bytes "
                                              "per second",
                                              parse_rate),
                 .latency_s = read_quantity(link, key, "latency",
                                            "a duration such as \"10us\" or a number of seconds",
                                            parse_duration)};
  // Named here by the JSON field; validate() names the struct's.
  check_rate(out.bytes_per_s, fmt::format("cluster: {}", cluster_path(key, "bandwidth")));
  check_latency(out.latency_s, fmt::format("cluster: {}", cluster_path(key, "latency")));
  return out;
}

void check_link(const Link& link, std::string_view name) {
  check_rate(link.bytes_per_s, fmt::format("cluster: {}.bytes_per_s", name));
  check_latency(link.latency_s, fmt::format("cluster: {}.latency_s", name));
}

// ---- units

struct Unit {
  std::string_view name;
  double factor;  // to the base unit (bytes per second, or seconds)
};

// Rates: "bit" forms count bits per second, "/s" forms with "b" or "byte" count bytes.
constexpr Unit kRateUnits[] = {
    {"bit", 1 / 8.0},   {"kbit", 1e3 / 8},  {"mbit", 1e6 / 8},  {"gbit", 1e9 / 8},
    {"tbit", 1e12 / 8}, {"bps", 1 / 8.0},   {"kbps", 1e3 / 8},  {"mbps", 1e6 / 8},
    {"gbps", 1e9 / 8},  {"tbps", 1e12 / 8}, {"bit/s", 1 / 8.0}, {"kbit/s", 1e3 / 8},
    {"mbit/s", 1e6 / 8}, {"gbit/s", 1e9 / 8}, {"tbit/s", 1e12 / 8}, {"b/s", 1},
    {"kb/s", 1e3},      {"mb/s", 1e6},      {"gb/s", 1e9},      {"tb/s", 1e12},
};
constexpr std::string_view kRateForms =
    "a number with a unit: bits per second as 100mbit, 25gbit, 10gbps or 25gbit/s (k, m, g, t "
    "prefixes, powers of 1000), bytes per second as 3GB/s or 500MB/s";

constexpr Unit kTimeUnits[] = {{"ns", 1e-9}, {"us", 1e-6}, {"µs", 1e-6},
                               {"ms", 1e-3}, {"s", 1},     {"sec", 1}};
constexpr std::string_view kTimeForms = "a number with a unit: ns, us, ms or s (10us, 1.5ms), or 0";

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  return text;
}

// Splits "25gbit" into 25 and "gbit"; nullopt when it does not start with a number.
std::optional<std::pair<double, std::string>> split_number(std::string_view text) {
  text = trim(text);
  double value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || !std::isfinite(value)) return std::nullopt;
  return std::pair{value, lower(trim(std::string_view(end, text.data() + text.size())))};
}

template <size_t N>
double parse_with_units(const std::string& text, const Unit (&units)[N], std::string_view what,
                        std::string_view forms, bool bare_zero) {
  const auto parsed = split_number(text);
  if (!parsed) throw Error(fmt::format("{} '{}' is not a number; expected {}", what, text, forms));
  const auto& [value, unit] = *parsed;
  if (value < 0) throw Error(fmt::format("{} '{}' is negative; expected {}", what, text, forms));
  if (unit.empty()) {
    if (bare_zero && value == 0) return 0;
    throw Error(fmt::format("{} '{}' has no unit; expected {}", what, text, forms));
  }
  for (const Unit& u : units) {
    if (unit == u.name) return value * u.factor;
  }
  throw Error(fmt::format("{} '{}': unknown unit '{}'; expected {}", what, text, unit, forms));
}

}  // namespace

void Cluster::validate() const {
  if (workers < 1 || workers > kMaxWorkers) {
    throw Error(fmt::format("cluster: workers = {} must be >= 1 and at most {}", workers,
                            kMaxWorkers));
  }
  if (per_node < 1 || per_node > workers || workers % per_node != 0) {
    throw Error(fmt::format("cluster: per_node = {} must divide workers = {} (nodes of equal "
                            "size, as the hierarchical route needs)",
                            per_node, workers));
  }
  check_link(inter, "inter");
  check_link(intra, "intra");
  if (servers < 0 || servers > kMaxWorkers) {
    throw Error(fmt::format("cluster: servers = {} must be from 0 (as many as workers) to {}",
                            servers, kMaxWorkers));
  }
}

Cluster Cluster::from_json(const json& json) {
  check_cluster_keys(json, "", {"workers", "per_node", "inter", "intra", "servers"});
  Cluster c;
  c.workers = read_cluster_count(json, "", "workers", std::nullopt);
  c.per_node = read_cluster_count(json, "", "per_node", 1);
  if (json.contains("servers")) c.servers = read_cluster_count(json, "", "servers", std::nullopt);
  if (!json.contains("inter")) {
    cluster_field_error("inter",
                        "missing; expected {\"bandwidth\": \"25gbit\", \"latency\": \"10us\"}");
  }
  c.inter = read_link(json, "inter");
  if (json.contains("intra")) {
    c.intra = read_link(json, "intra");
  } else if (c.per_node > 1) {
    cluster_field_error("intra",
                        "missing; needed when per_node > 1, e.g. {\"bandwidth\": \"100gbit\", "
                        "\"latency\": \"5us\"}");
  }
  c.validate();
  return c;
}

json Cluster::to_json() const {
  // Numbers in base units: exact round trip (the strings are for people writing files).
  const auto link = [](const Link& l) {
    return json{{"bandwidth", l.bytes_per_s}, {"latency", l.latency_s}};
  };
  json out{{"workers", workers}, {"per_node", per_node}, {"inter", link(inter)},
            {"intra", link(intra)}};
  if (servers > 0) out["servers"] = servers;
  return out;
}

double parse_rate(const std::string& text) {
  const double bytes_per_s = parse_with_units(text, kRateUnits, "rate", kRateForms, false);
  check_rate(bytes_per_s, fmt::format("rate '{}'", text));
  return bytes_per_s;
}

double parse_duration(const std::string& text) {
  const double seconds = parse_with_units(text, kTimeUnits, "duration", kTimeForms, true);
  check_latency(seconds, fmt::format("duration '{}'", text));
  return seconds;
}

std::string format_rate(double bytes_per_s) {
  const double bits = 8 * bytes_per_s;
  constexpr std::pair<double, const char*> kScales[] = {
      {1e12, "Tbit/s"}, {1e9, "Gbit/s"}, {1e6, "Mbit/s"}, {1e3, "kbit/s"}};
  for (const auto& [scale, unit] : kScales) {
    if (bits >= scale) return fmt::format("{:.4g} {}", bits / scale, unit);
  }
  return fmt::format("{:.4g} bit/s", bits);
}

}  // namespace gradcomp::model
