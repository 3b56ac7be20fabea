// The first-step check that every rank registered the same tensors and loaded the same plan:
// a mismatch would otherwise pair up unrelated buffers across ranks, or hang.
#pragma once

#include "gradcomp/plan.h"
#include "gradcomp/transport.h"

namespace gradcomp {

// A collective over `world`. Returns when all ranks agree; otherwise throws CommError naming the
// first tensor (or bucket) in which this rank differs from another.
void check_consistency(Transport& world, const Plan& plan, Milliseconds timeout);

}  // namespace gradcomp
