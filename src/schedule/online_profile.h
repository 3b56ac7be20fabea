// The auto scheduler's profile of the running model: when each gradient becomes ready after
// backward starts, and the compute around backward, from the front end's clock of a few steps
// (medians), agreed over the ranks (the slowest rank's), as a model::Profile the planner and
// the simulator take.
#pragma once

#include <vector>

#include "gradcomp/model/profile.h"
#include "gradcomp/plan.h"
#include "gradcomp/scheduler.h"
#include "gradcomp/transport.h"

namespace gradcomp::schedule {

class OnlineProfile {
 public:
  explicit OnlineProfile(std::vector<TensorInfo> tensors) : tensors_(std::move(tensors)) {}

  // One timed step. Backward starts at the first gradient (its own compute is not seen);
  // forward_s is everything else on the compute thread: from the step's start to that first
  // gradient (data, forward) and from the exchange's end to the step's end (the optimizer).
  // A tensor that got no gradient in backward counts as ready when backward ends.
  void add(const StepTimes& times);
  size_t steps() const { return forward_.size(); }
  void clear();

  // The profile of the steps added (medians), the slowest rank's: a collective.
  model::Profile agreed(Transport& transport) const;

 private:
  std::vector<TensorInfo> tensors_;
  std::vector<std::vector<double>> ready_;  // per tensor, per step: seconds after backward began
  std::vector<double> forward_, backward_;
};

}  // namespace gradcomp::schedule
