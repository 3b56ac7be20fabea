#include "gradcomp/spec.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <cmath>
#include <limits>

#include "gradcomp/error.h"

namespace gradcomp {
namespace {

std::string trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t");
  return std::string(s.substr(first, last - first + 1));
}

std::string bound_text(double lo, double hi, bool lo_open, bool hi_open) {
  const bool lo_inf = std::isinf(lo), hi_inf = std::isinf(hi);
  if (lo_inf && hi_inf) return "any number";
  if (hi_inf) return fmt::format("{} {}", lo_open ? ">" : ">=", format_number(lo));
  if (lo_inf) return fmt::format("{} {}", hi_open ? "<" : "<=", format_number(hi));
  return fmt::format("{}{}, {}{}", lo_open ? "(" : "[", format_number(lo), format_number(hi),
                     hi_open ? ")" : "]");
}

}  // namespace

std::string format_number(double value) {
  // Integral values print as integers (1000000, not 1e+06) so integer getters read them back.
  if (value == std::trunc(value) && std::fabs(value) < 0x1.0p53) {
    return fmt::format("{}", static_cast<int64_t>(value));
  }
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, value);
  return ec == std::errc{} ? std::string(buf, end) : fmt::format("{}", value);
}

Spec Spec::parse(std::string_view text, std::string_view what) {
  Spec spec;
  spec.what_ = std::string(what);
  const auto colon = text.find(':');
  spec.name_ = trim(text.substr(0, colon));
  if (spec.name_.empty()) {
    throw SpecError(fmt::format("{} spec '{}' has no name; expected 'name' or "
                                "'name:key=value,...'", what, text));
  }
  if (colon == std::string_view::npos) return spec;
  std::string_view rest = text.substr(colon + 1);
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string item = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const auto eq = item.find('=');
    if (item.empty() || eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      spec.fail(fmt::format("malformed parameter '{}'; expected key=value", item));
    }
    const std::string key = trim(std::string_view(item).substr(0, eq));
    if (!spec.values_.emplace(key, trim(std::string_view(item).substr(eq + 1))).second) {
      spec.fail(fmt::format("parameter '{}' is given twice", key));
    }
  }
  return spec;
}

void Spec::fail(const std::string& message) const {
  throw SpecError(fmt::format("{} '{}': {}", what_, name_, message));
}

std::string Spec::raw(const std::string& key) {
  asked_.insert(key);
  return values_.at(key);
}

std::optional<double> Spec::find_double(const std::string& key, double lo, double hi,
                                        bool lo_open, bool hi_open) {
  asked_.insert(key);
  if (!has(key)) return std::nullopt;
  const std::string text = raw(key);
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  const std::string allowed = bound_text(lo, hi, lo_open, hi_open);
  if (ec != std::errc{} || end != text.data() + text.size() || std::isnan(value)) {
    fail(fmt::format("parameter '{}' = '{}' is not a number; allowed: {}", key, text, allowed));
  }
  const bool below = lo_open ? value <= lo : value < lo;
  const bool above = hi_open ? value >= hi : value > hi;
  if (below || above) {
    fail(fmt::format("parameter '{}' = {} is out of range; allowed: {}", key, text, allowed));
  }
  return value;
}

double Spec::get_double(const std::string& key, double fallback, double lo, double hi,
                        bool lo_open, bool hi_open) {
  return find_double(key, lo, hi, lo_open, hi_open).value_or(fallback);
}

std::optional<int64_t> Spec::find_int(const std::string& key, int64_t lo, int64_t hi) {
  asked_.insert(key);
  if (!has(key)) return std::nullopt;
  const std::string text = raw(key);
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  const std::string allowed =
      hi == std::numeric_limits<int64_t>::max()
          ? fmt::format("an integer >= {}", lo)
          : fmt::format("an integer in [{}, {}]", lo, hi);
  if (ec != std::errc{} || end != text.data() + text.size()) {
    fail(fmt::format("parameter '{}' = '{}' is not an integer; allowed: {}", key, text, allowed));
  }
  if (value < lo || value > hi) {
    fail(fmt::format("parameter '{}' = {} is out of range; allowed: {}", key, text, allowed));
  }
  return value;
}

int64_t Spec::get_int(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) {
  return find_int(key, lo, hi).value_or(fallback);
}

bool Spec::get_bool(const std::string& key, bool fallback) {
  return get_choice(key, fallback ? "true" : "false", {"true", "false", "1", "0"}) == "true" ||
         (has(key) && values_.at(key) == "1");
}

std::string Spec::get_choice(const std::string& key, const std::string& fallback,
                             const std::vector<std::string>& allowed) {
  asked_.insert(key);
  if (!has(key)) return fallback;
  std::string value = raw(key);
  for (const auto& a : allowed) {
    if (a == value) return value;
  }
  fail(fmt::format("parameter '{}' = '{}' is not allowed; allowed: {}", key, value,
                   fmt::join(allowed, ", ")));
}

void Spec::finish() const {
  for (const auto& [key, value] : values_) {
    if (asked_.count(key) == 0) {
      fail(fmt::format("unknown parameter '{}'; allowed: {}", key,
                       asked_.empty() ? std::string("none") : fmt::format("{}", fmt::join(asked_, ", "))));
    }
  }
}

}  // namespace gradcomp
