#include "schedule/agreement.h"

#include <algorithm>
#include <cmath>
#include <span>

namespace gradcomp::schedule {

std::vector<double> gather_over_ranks(Transport& transport, const std::vector<double>& mine) {
  std::vector<double> all(mine.size() * static_cast<size_t>(transport.size()));
  transport.allgather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)))
      ->wait(transport.timeout());
  return all;
}

std::vector<double> rows_max(const std::vector<double>& gathered, size_t world) {
  const size_t n = gathered.size() / world;
  std::vector<double> most(gathered.begin(), gathered.begin() + static_cast<std::ptrdiff_t>(n));
  for (size_t r = 1; r < world; ++r) {
    for (size_t i = 0; i < n; ++i) most[i] = std::max(most[i], gathered[r * n + i]);
  }
  return most;
}

std::vector<double> rows_mean(const std::vector<double>& gathered, size_t world) {
  const size_t n = gathered.size() / world;
  std::vector<double> sum(n, 0.0);
  for (size_t r = 0; r < world; ++r) {
    for (size_t i = 0; i < n; ++i) sum[i] += gathered[r * n + i];
  }
  for (double& v : sum) v /= static_cast<double>(world);
  return sum;
}

std::vector<double> max_over_ranks(Transport& transport, std::vector<double> mine) {
  return rows_max(gather_over_ranks(transport, mine), static_cast<size_t>(transport.size()));
}

std::vector<double> mean_over_ranks(Transport& transport, std::vector<double> mine) {
  return rows_mean(gather_over_ranks(transport, mine), static_cast<size_t>(transport.size()));
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

double median_uncertainty(const std::vector<double>& values) {
  if (values.size() < 2) return 0;
  const double m = median(values);
  std::vector<double> deviations;
  deviations.reserve(values.size());
  for (double v : values) deviations.push_back(std::fabs(v - m));
  const double sigma = 1.4826 * median(std::move(deviations));  // the MAD as a normal sigma
  return 1.2533 * sigma / std::sqrt(static_cast<double>(values.size()));
}

}  // namespace gradcomp::schedule
