// exhaustive_plan: every contiguous partition of the tensors, every option per bucket, each
// plan simulated with simulate(): the reference the planner's search is tested against.
#include <fmt/format.h>

#include <chrono>
#include <limits>
#include <numeric>

#include "gradcomp/error.h"
#include "gradcomp/model/planner.h"

namespace gradcomp::model {
namespace {

class Enumerator {
 public:
  Enumerator(const Profile& profile, const CostModel& cost, const PlannerSettings& settings,
             std::vector<Option> options)
      : profile_(profile), cost_(cost), settings_(settings), options_(std::move(options)) {
    plan_.tensors = profile.tensor_infos();
  }

  void run(size_t start) {
    const size_t n = profile_.tensors.size();
    if (start == n) {
      evaluate();
      return;
    }
    size_t elements = 0;
    for (size_t end = start + 1; end <= n; ++end) {
      elements += profile_.tensors[end - 1].elements;
      if (elements * sizeof(float) > settings_.max_bucket_bytes && end > start + 1) break;
      Bucket b;
      b.tensors.resize(end - start);
      std::iota(b.tensors.begin(), b.tensors.end(), start);
      for (const Option& o : options_) {
        const bool lossy = o.codec != "none" || o.feedback != "none";
        if (lossy && elements < settings_.min_compress_elements) continue;
        b.option = o;
        plan_.buckets.push_back(b);
        run(end);
        plan_.buckets.pop_back();
      }
    }
  }

  Plan best_plan;
  double best_s = std::numeric_limits<double>::infinity();
  size_t evaluated = 0;

 private:
  void evaluate() {
    ++evaluated;
    const double t = simulate(profile_, plan_, cost_, settings_.simulator).iteration_s;
    if (t < best_s) {
      best_s = t;
      best_plan = plan_;
    }
  }

  const Profile& profile_;
  const CostModel& cost_;
  const PlannerSettings& settings_;
  std::vector<Option> options_;
  Plan plan_;
};

}  // namespace

PlanResult exhaustive_plan(const Profile& profile, const CostModel& cost,
                           const PlannerSettings& settings, size_t max_tensors) {
  const auto began = std::chrono::steady_clock::now();
  profile.validate();
  if (profile.tensors.size() > max_tensors) {
    throw Error(fmt::format("exhaustive_plan: {} tensors; brute force is limited to {}",
                            profile.tensors.size(), max_tensors));
  }
  const auto options = candidate_options(settings, cost.cluster());
  Enumerator all(profile, cost, settings, options);
  all.run(0);
  std::vector<Option> plain;
  for (const Option& o : options) {
    if (o.codec == "none" && o.feedback == "none") plain.push_back(o);
  }
  Enumerator uncompressed(profile, cost, settings, plain);
  uncompressed.run(0);

  PlanResult result;
  result.plan = all.best_plan;
  result.predicted = simulate(profile, result.plan, cost, settings.simulator);
  result.uncompressed_plan = uncompressed.best_plan;
  result.uncompressed_s = uncompressed.best_s;
  result.options_considered = all.evaluated + uncompressed.evaluated;
  result.decision_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  return result;
}

}  // namespace gradcomp::model
