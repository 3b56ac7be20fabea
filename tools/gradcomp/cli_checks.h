// Checks every `gradcomp` command shares for its numeric and list options.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace gradcomp::tools {

// A finite number in [min, max]. CLI::Range and CLI::PositiveNumber let "nan" through (every
// comparison with NaN is false) and PositiveNumber lets "inf" through, so `launch --notice nan`
// or `--bucket-mb inf` reached the code; this refuses both and says what is allowed.
CLI::Validator finite_range(double min, double max);

// `text` split at `separator`. CLI11's own delimiter drops empty items, so `--codecs ';'` held
// no value and took the next flag ("--sizes") as its value; here an empty list or item is a
// CLI::ValidationError naming the option, the item and the form expected.
std::vector<std::string> split_list(const std::string& text, char separator,
                                    const std::string& option);

// A list option: its arguments ("a;b", or "a" "b") are taken as given, never a flag after
// them, each split with split_list, every item converted to T and checked with `check`.
// `items` keeps its default when the option is not given.
template <class T>
CLI::Option* add_list_option(CLI::App& command, const std::string& name, std::vector<T>& items,
                             const std::string& help, char separator,
                             CLI::Validator check = CLI::Validator()) {
  // Raw arguments, no CLI11 delimiter: CLI11 drops the empty items of a split, and an option
  // left with no value takes the next argument, even a flag.
  auto* option = command.add_option_function<std::vector<std::string>>(
      name,
      [&items, name, separator, check](const std::vector<std::string>& texts) mutable {
        items.clear();
        for (const std::string& text : texts) {
          for (std::string item : split_list(text, separator, name)) {
            if (std::string why = check(item); !why.empty()) throw CLI::ValidationError(name, why);
            T value{};
            if (!CLI::detail::lexical_cast(item, value)) throw CLI::ConversionError(name, item);
            items.push_back(value);
          }
        }
      },
      help + " (separated by '" + std::string(1, separator) + "')");
  return option->type_name("LIST");
}

}  // namespace gradcomp::tools
