// Spec strings: "name" or "name:key=value,key=value", e.g. "topk:ratio=0.01".
//
// A Spec is parsed once; the codec or feedback that consumes it reads each parameter through
// the typed getters, which check the range, and then calls finish(), which rejects any key it
// did not read. Errors name the component, the parameter and what is allowed.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace gradcomp {

class Spec {
 public:
  // Parses "name[:key=value[,key=value]...]". `what` names the kind in errors ("codec").
  static Spec parse(std::string_view text, std::string_view what = "codec");

  const std::string& name() const { return name_; }
  const std::string& what() const { return what_; }
  bool has(const std::string& key) const { return values_.count(key) != 0; }

  // Typed getters: return the value (or the default when absent) after checking its range.
  // Bounds are inclusive unless the *_open flag says otherwise.
  double get_double(const std::string& key, double fallback, double lo, double hi,
                    bool lo_open = false, bool hi_open = false);
  int64_t get_int(const std::string& key, int64_t fallback, int64_t lo, int64_t hi);
  bool get_bool(const std::string& key, bool fallback);
  std::string get_choice(const std::string& key, const std::string& fallback,
                         const std::vector<std::string>& allowed);
  // A required or optional parameter: nullopt when absent.
  std::optional<double> find_double(const std::string& key, double lo, double hi,
                                    bool lo_open = false, bool hi_open = false);
  std::optional<int64_t> find_int(const std::string& key, int64_t lo, int64_t hi);

  // Rejects keys no getter asked for, listing the keys this component takes.
  void finish() const;

  // A SpecError "<what> '<name>': <message>".
  [[noreturn]] void fail(const std::string& message) const;

 private:
  std::string raw(const std::string& key);
  std::string what_;
  std::string name_;
  std::map<std::string, std::string> values_;
  std::set<std::string> asked_;
};

// Formats a number the way canonical specs print it (shortest round-trip form).
std::string format_number(double value);

}  // namespace gradcomp
