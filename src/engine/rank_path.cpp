#include "engine/rank_path.h"

#include <fmt/format.h>

namespace gradcomp {

std::string rank_path(const std::string& path, int rank) {
  const std::string tag = "{rank}";
  if (auto at = path.find(tag); at != std::string::npos) {
    return path.substr(0, at) + std::to_string(rank) + path.substr(at + tag.size());
  }
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  const bool has_extension = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  const std::string suffix = fmt::format(".rank{}", rank);
  return has_extension ? path.substr(0, dot) + suffix + path.substr(dot) : path + suffix;
}

}  // namespace gradcomp
