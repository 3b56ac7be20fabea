#include "schedule/agreement.h"

#include <algorithm>
#include <cmath>
#include <span>

namespace gradcomp::schedule {

std::vector<double> max_over_ranks(Transport& transport, std::vector<double> mine) {
  const auto world = static_cast<size_t>(transport.size());
  std::vector<double> all(mine.size() * world);
  transport.allgather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)))
      ->wait(transport.timeout());
  for (size_t r = 0; r < world; ++r) {
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = std::max(mine[i], all[r * mine.size() + i]);
  }
  return mine;
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
