#include "engine/nodes.h"

#include <fmt/format.h>

#include "gradcomp/error.h"

namespace gradcomp {

Nodes split_nodes(Transport& world, int local_size) {
  if (local_size <= 0) local_size = launch_info_from_environment().local_size;
  if (world.size() % local_size != 0) {
    throw Error(fmt::format(
        "hierarchical route: {} ranks cannot be grouped into nodes of {} (the local size, from "
        "LOCAL_WORLD_SIZE, mpirun, GRADCOMP_LOCAL_SIZE or EngineOptions::local_size); every "
        "node must hold the same number of ranks",
        world.size(), local_size));
  }
  const int rank = world.rank();
  Nodes nodes;
  nodes.intra = world.split(rank / local_size, rank);
  nodes.cross = world.split(rank % local_size, rank);
  return nodes;
}

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
