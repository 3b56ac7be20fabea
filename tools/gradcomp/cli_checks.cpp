#include "cli_checks.h"

#include <fmt/format.h>

#include <cmath>

namespace gradcomp::tools {

CLI::Validator finite_range(double min, double max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(text, value)) {
          return fmt::format("'{}' is not a number; allowed: a number in {} .. {}", text, min, max);
        }
        if (!(value >= min && value <= max)) {  // NaN fails both comparisons
          return fmt::format("{} is not allowed; allowed: a finite number in {} .. {}", text,
                             min, max);
        }
        return {};
      },
      fmt::format("NUMBER in {} .. {}", min, max));
}

std::vector<std::string> split_list(const std::string& text, char separator,
                                    const std::string& option) {
  std::vector<std::string> items;
  size_t begin = 0;
  while (true) {
    const size_t end = text.find(separator, begin);
    std::string item = text.substr(begin, end == std::string::npos ? end : end - begin);
    if (item.empty()) {
      throw CLI::ValidationError(
          option, fmt::format("item {} of '{}' is empty; give one or more items separated by "
                              "'{}'",
                              items.size() + 1, text, separator));
    }
    items.push_back(std::move(item));
    if (end == std::string::npos) return items;
    begin = end + 1;
  }
}

}  // namespace gradcomp::tools
