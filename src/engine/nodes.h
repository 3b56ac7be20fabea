// The node structure the routes that need nodes use: one transport per node, and one across the
// nodes per local index (that of local rank 0 is the node leaders').
#pragma once

#include <memory>
#include <string>

#include "gradcomp/transport.h"

namespace gradcomp {

struct Nodes {
  std::unique_ptr<Transport> intra;  // this node's ranks; intra rank 0 is the leader
  std::unique_ptr<Transport> cross;  // the ranks of this local index on every node
  // The node leaders' transport (the hierarchical route's): `cross` on leaders, else nullptr.
  Transport* leaders() const { return intra->rank() == 0 ? cross.get() : nullptr; }
};

// Groups consecutive ranks into nodes of `local_size` ranks (0: from the launcher's
// environment, see transport.h), as launchers place them. A collective over `world`. Throws
// Error when the world size is not a multiple of the local size.
Nodes split_nodes(Transport& world, int local_size);

// The timeline file of `rank`: "{rank}" in `path` is replaced by the rank; without it,
// ".rank<R>" goes before the extension ("trace.json" -> "trace.rank3.json").
std::string rank_path(const std::string& path, int rank);

}  // namespace gradcomp
