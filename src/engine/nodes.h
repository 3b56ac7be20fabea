// The node structure the hierarchical route needs: one transport per node, one of node leaders.
#pragma once

#include <memory>
#include <string>

#include "gradcomp/transport.h"

namespace gradcomp {

struct Nodes {
  std::unique_ptr<Transport> intra;    // this node's ranks; intra rank 0 is the leader
  std::unique_ptr<Transport> leaders;  // the leaders of all nodes; nullptr on other ranks
};

// Groups consecutive ranks into nodes of `local_size` ranks (0: from the launcher's
// environment, see transport.h), as launchers place them. A collective over `world`. Throws
// Error when the world size is not a multiple of the local size.
Nodes split_nodes(Transport& world, int local_size);

// The timeline file of `rank`: "{rank}" in `path` is replaced by the rank; without it,
// ".rank<R>" goes before the extension ("trace.json" -> "trace.rank3.json").
std::string rank_path(const std::string& path, int rank);

}  // namespace gradcomp
