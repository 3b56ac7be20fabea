// Nodes of 2 consecutive ranks for the hierarchical route in multi-process tests; built once
// (split is a collective every rank calls in order).
#pragma once

#include <memory>

#include "support/mp_test.h"

namespace gradcomp::testing {

struct Nodes {
  std::unique_ptr<Transport> intra, leaders, cross;  // cross: this local index on every node
};

inline const Nodes& nodes() {
  static const Nodes n = [] {
    Nodes out;
    const int rank = world()->rank();
    out.intra = world()->split(rank / 2, rank);
    out.leaders = world()->split(rank % 2 == 0 ? 0 : -1, rank);
    out.cross = world()->split(rank % 2, rank);
    return out;
  }();
  return n;
}

}  // namespace gradcomp::testing
