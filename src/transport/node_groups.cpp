// Transport::nodes: the node groups split once per transport and shared by its users.
#include <fmt/format.h>

#include "gradcomp/error.h"
#include "gradcomp/transport.h"

namespace gradcomp {

Transport* NodeGroups::leaders() const { return intra->rank() == 0 ? cross.get() : nullptr; }

std::shared_ptr<const NodeGroups> Transport::nodes(int local_size) {
  if (local_size <= 0) local_size = launch_info_from_environment().local_size;
  if (size() % local_size != 0) {
    throw Error(fmt::format(
        "routes over nodes: {} ranks cannot be grouped into nodes of {} (the local size, from "
        "LOCAL_WORLD_SIZE, mpirun, GRADCOMP_LOCAL_SIZE or EngineOptions::local_size); every "
        "node must hold the same number of ranks",
        size(), local_size));
  }
  // Held through the split: two threads asking at once must not split twice.
  std::lock_guard lock(nodes_mutex_);
  std::shared_ptr<const NodeGroups>& kept = nodes_[local_size];
  if (!kept) {
    auto groups = std::make_shared<NodeGroups>();
    groups->intra = split(rank() / local_size, rank());
    groups->cross = split(rank() % local_size, rank());
    kept = std::move(groups);
  }
  return kept;
}

}  // namespace gradcomp
