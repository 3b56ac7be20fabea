// What the auto scheduler's ranks agree on before they decide: each rank measures its own
// clock, and every decision is taken from the same numbers on every rank: the maximum over the
// ranks where the slowest rank sets the figure (a probe, a compute time, a CPU time), the mean
// where every rank measures the same thing with its own noise (a step's time).
#pragma once

#include <vector>

#include "gradcomp/transport.h"

namespace gradcomp::schedule {

// Element-wise maximum / mean over the ranks of `mine` (every rank passes as many values); the
// same result on every rank. A collective (one allgather).
std::vector<double> max_over_ranks(Transport& transport, std::vector<double> mine);
std::vector<double> mean_over_ranks(Transport& transport, std::vector<double> mine);

// Every rank's `mine` (as many values each), rank after rank: the same on every rank. A
// collective (one allgather).
std::vector<double> gather_over_ranks(Transport& transport, const std::vector<double>& mine);

// Element-wise maximum / mean over the `world` rows of a gathered vector (gather_over_ranks).
// The mean sums in rank order, so every rank gets the same bytes.
std::vector<double> rows_max(const std::vector<double>& gathered, size_t world);
std::vector<double> rows_mean(const std::vector<double>& gathered, size_t world);

// The median of `values` (the mean of the middle two when even); 0 when empty.
double median(std::vector<double> values);

// How far the median of `values` may lie from the true one: its standard error, from the
// median absolute deviation (robust to the odd slow step) as 1.2533 * 1.4826 * MAD / sqrt(n),
// which holds for normal noise. 0 for fewer than two values.
double median_uncertainty(const std::vector<double>& values);

}  // namespace gradcomp::schedule
