// The first-step check that every rank registered the same tensors and loaded the same plan:
// a mismatch would otherwise pair up unrelated buffers across ranks, or hang.
#pragma once

#include "gradcomp/plan.h"
#include "gradcomp/transport.h"

namespace gradcomp {

// Settings outside the plan that every rank must share.
struct SharedSettings {
  uint64_t seed = 0;        // keys the codecs' (shared) randomness
  uint64_t local_size = 0;  // ranks per node (hierarchical plans; 0 otherwise)
  uint64_t streams = 1;     // buckets exchanged at once (EngineOptions::streams)
};

// A collective over `world`. Returns when all ranks agree; otherwise throws CommError naming the
// first tensor (or bucket, or setting) in which this rank differs from another.
void check_consistency(Transport& world, const Plan& plan, const SharedSettings& settings,
                       Milliseconds timeout);

}  // namespace gradcomp
