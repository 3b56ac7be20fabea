// Transport::stream: further communicators over the same ranks, split once per transport and
// shared by its users, so that collectives of different streams run at the same time.
#include <fmt/format.h>

#include "gradcomp/error.h"
#include "gradcomp/transport.h"

namespace gradcomp {

Transport& Transport::stream(size_t index) {
  if (index == 0) return *this;
  if (!can_split()) {
    throw Error(fmt::format("{} transport: stream {} needs a communicator split from this one, "
                            "and this backend cannot split",
                            name(), index));
  }
  // Held through the splits: two threads asking at once must not split twice.
  std::lock_guard lock(streams_mutex_);
  while (streams_.size() < index) streams_.push_back(split(0, rank()));
  return *streams_[index - 1];
}

}  // namespace gradcomp
