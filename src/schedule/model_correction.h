// What the trials teach the cost model. The model misses what docs/cluster-benchmark.md names
// as its errors: a cost per message beyond the link's latency, compute slowed while the
// exchange runs, and time per step outside the model (the optimizer, the framework). After each
// search the auto scheduler fits those three to the step times it measured, and the next
// search predicts with them: the next prediction is better than the last.
#pragma once

#include <utility>
#include <vector>

#include "gradcomp/model/cluster.h"
#include "gradcomp/model/cost_model.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/model/simulator.h"
#include "gradcomp/plan.h"

namespace gradcomp::schedule {

struct ModelCorrection {
  double extra_latency_s = 0;  // added to every message's latency
  double lambda = 1;           // the simulator's compute slow-down while exchanging
  double step_overhead_s = 0;  // added to the forward pass
  double error_before = 0;     // mean |predicted - measured| / measured, without the correction
  double error_after = 0;      // ... with it, on the same trials

  model::Cluster applied(model::Cluster cluster) const;
  model::Profile applied(model::Profile profile) const;
  model::SimulatorSettings simulator() const { return {.lambda = lambda}; }
};

// The correction (over a small grid of latencies and slow-downs, the overhead in closed form)
// that brings the predictions of `trials` (plan, measured seconds) closest to the measurements,
// relative error; the identity when it does not help.
ModelCorrection fit_correction(const model::Profile& profile, const model::Cluster& cluster,
                               const model::CodecCosts& codecs,
                               const std::vector<std::pair<Plan, double>>& trials);

}  // namespace gradcomp::schedule
