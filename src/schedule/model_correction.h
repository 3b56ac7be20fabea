// What the trials teach the cost model: after each search the auto scheduler fits the four terms
// of a model::Correction (extra latency per message, compute slow-down, codec cost scale, step
// overhead) to the step times it measured, and the next search predicts with them: the next
// prediction is better than the last.
#pragma once

#include <utility>
#include <vector>

#include "gradcomp/model/cluster.h"
#include "gradcomp/model/correction.h"
#include "gradcomp/model/cost_model.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/plan.h"

namespace gradcomp::schedule {

// The correction (over a small grid of latencies, slow-downs and cost scales, the overhead in
// closed form) that brings the predictions of `trials` (plan, measured seconds) closest to the
// measurements, relative error; the identity when it does not help. Codec costs are scaled
// only when that halves the error the other terms leave, by more than a trial's noise.
model::Correction fit_correction(const model::Profile& profile, const model::Cluster& cluster,
                                 const model::CodecCosts& codecs,
                                 const std::vector<std::pair<Plan, double>>& trials);

}  // namespace gradcomp::schedule
