#include "common/environment.h"

#include <fmt/format.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "gradcomp/error.h"

namespace gradcomp {

std::optional<std::string> env_text(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

std::optional<long> env_int(const char* name, long min, long max, const char* meaning) {
  auto text = env_text(name);
  if (!text) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text->c_str(), &end, 10);
  // strtol would skip leading blanks; a value with blanks is a typo, not a number.
  const bool blank_first = std::isspace(static_cast<unsigned char>(text->front())) != 0;
  if (blank_first || *end != '\0' || errno != 0 || value < min || value > max) {
    throw Error(
        fmt::format("environment variable {}='{}' must be a whole number from {} to {} "
                    "({})",
                    name, *text, min, max, meaning));
  }
  return value;
}

}  // namespace gradcomp
