#include "schedule/model_correction.h"

#include <algorithm>
#include <cmath>

namespace gradcomp::schedule {

model::Cluster ModelCorrection::applied(model::Cluster cluster) const {
  cluster.inter.latency_s = std::min(cluster.inter.latency_s + extra_latency_s, model::kMaxLatencyS);
  cluster.intra.latency_s = std::min(cluster.intra.latency_s + extra_latency_s, model::kMaxLatencyS);
  return cluster;
}

model::Profile ModelCorrection::applied(model::Profile profile) const {
  profile.forward_s += step_overhead_s;
  return profile;
}

namespace {

// Mean relative error of predictions + overhead against the measurements.
double relative_error(const std::vector<double>& predicted, const std::vector<double>& measured,
                      double overhead) {
  double sum = 0;
  for (size_t i = 0; i < predicted.size(); ++i) {
    sum += std::fabs(predicted[i] + overhead - measured[i]) / measured[i];
  }
  return sum / static_cast<double>(predicted.size());
}

}  // namespace

ModelCorrection fit_correction(const model::Profile& profile, const model::Cluster& cluster,
                               const model::CodecCosts& codecs,
                               const std::vector<std::pair<Plan, double>>& trials) {
  ModelCorrection best;
  std::vector<double> measured;
  for (const auto& [plan, seconds] : trials) measured.push_back(seconds);
  if (trials.empty() || *std::min_element(measured.begin(), measured.end()) <= 0) return best;
  const auto predictions = [&](double extra, double lambda) {
    const model::CostModel cost(ModelCorrection{.extra_latency_s = extra}.applied(cluster), codecs);
    std::vector<double> out;
    for (const auto& [plan, seconds] : trials) {
      out.push_back(model::simulate(profile, plan, cost, {.lambda = lambda}).iteration_s);
    }
    return out;
  };
  best.error_before = best.error_after = relative_error(predictions(0, 1), measured, 0);
  for (double extra : {0.0, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2}) {
    for (double lambda = 1.0; lambda <= 1.5 + 1e-9; lambda += 0.05) {
      const auto predicted = predictions(extra, lambda);
      // The overhead that fits best in the mean, never negative (the model's compute is a
      // measurement of this job: only time outside it is missing).
      double overhead = 0;
      for (size_t i = 0; i < predicted.size(); ++i) overhead += measured[i] - predicted[i];
      overhead = std::max(0.0, overhead / static_cast<double>(predicted.size()));
      const double error = relative_error(predicted, measured, overhead);
      if (error < best.error_after - 1e-12) {
        best.extra_latency_s = extra;
        best.lambda = lambda;
        best.step_overhead_s = overhead;
        best.error_after = error;
      }
    }
  }
  return best;
}

}  // namespace gradcomp::schedule
