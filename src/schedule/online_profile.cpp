#include "schedule/online_profile.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "schedule/agreement.h"

namespace gradcomp::schedule {

void OnlineProfile::add(const StepTimes& t) {
  ready_.resize(tensors_.size());
  const double backward = std::max(0.0, t.last_ready - t.first_ready);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const double at = i < t.ready.size() && t.ready[i] > 0 ? t.ready[i] - t.first_ready : backward;
    ready_[i].push_back(std::clamp(at, 0.0, backward));
  }
  backward_.push_back(backward);
  forward_.push_back(std::max(0.0, t.first_ready - t.step_start) +
                     std::max(0.0, t.step_end - t.exchange_end));
}

void OnlineProfile::clear() {
  ready_.clear();
  forward_.clear();
  backward_.clear();
}

model::Profile OnlineProfile::agreed(Transport& transport) const {
  std::vector<double> mine{median(forward_), median(backward_)};
  for (const auto& r : ready_) mine.push_back(median(r));
  mine.resize(2 + tensors_.size(), 0.0);
  const auto all = max_over_ranks(transport, std::move(mine));
  model::Profile profile;
  profile.model = "online";
  profile.source = "measured by compression=\"auto\" on this job";
  profile.batch_size = 1;  // not known here; the planner does not use it
  profile.forward_s = all[0];
  double ready = 0;  // backward order: each gradient at or after the one before
  for (size_t i = 0; i < tensors_.size(); ++i) {
    ready = std::max(ready, all[2 + i]);
    profile.tensors.push_back({tensors_[i].name, tensors_[i].elements, ready});
  }
  profile.backward_s = std::max(all[1], ready);
  // As its JSON holds it (times to the nanosecond, in milliseconds): the plans made from it
  // here and by `gradcomp plan` from the saved calibration are then the same, near ties too.
  return model::Profile::from_json(profile.to_json());
}

}  // namespace gradcomp::schedule
