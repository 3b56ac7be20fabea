// What the auto scheduler's ranks agree on before they decide: each rank measures its own
// clock, and every decision is taken from the same numbers on every rank, the maximum over the
// ranks (the slowest rank sets the step).
#pragma once

#include <vector>

#include "gradcomp/transport.h"

namespace gradcomp::schedule {

// Element-wise maximum over the ranks of `mine` (every rank passes as many values); the same
// result on every rank. A collective (one allgather).
std::vector<double> max_over_ranks(Transport& transport, std::vector<double> mine);

// The median of `values` (the mean of the middle two when even); 0 when empty.
double median(std::vector<double> values);

// How far the median of `values` may lie from the true one: its standard error, from the
// median absolute deviation (robust to the odd slow step) as 1.2533 * 1.4826 * MAD / sqrt(n),
// which holds for normal noise. 0 for fewer than two values.
double median_uncertainty(const std::vector<double>& values);

}  // namespace gradcomp::schedule
