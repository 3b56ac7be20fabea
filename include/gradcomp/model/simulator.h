// Simulator: the timeline of one training step of a Plan on a Profile and a CostModel.
//
// Backward produces gradients at the profile's ready times, stretched by lambda (compute slows
// while communication runs; the utility study measured 1.04-1.1). A bucket is ready when its
// last tensor is. Then, as the engine does: the encoding lane (the engine's encoder thread, or
// the compute thread for EncodeOn::kCaller, which then delays every later gradient by the
// encoding time), the exchange lane (one bucket at a time, in plan order), the decoding lane.
// Each lane serves buckets in plan order. The step ends when backward and the last decode have
// ended; the iteration adds the forward pass.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gradcomp/model/cost_model.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/plan.h"

namespace gradcomp::model {

struct SimulatorSettings {
  double lambda = 1.0;  // compute slow-down while communicating (>= 1)
};

struct Span {
  std::string lane;  // "compute", "encode", "exchange", "decode"
  std::string name;  // "backward", "bucket 3 encode", "bucket 3 allreduce", ...
  int bucket = -1;
  double start_s = 0;
  double end_s = 0;
};

struct SimResult {
  double iteration_s = 0;      // forward + backward-and-exchange
  double backward_end_s = 0;   // when backward ends (after forward), lambda and caller encodes in
  double exchange_end_s = 0;   // when the last bucket is written back
  double bytes_sent = 0;       // per rank per step
  std::vector<Span> spans;     // empty unless asked for
  // A Chrome trace (JSON Array Format): one lane per thread of the simulated step.
  nlohmann::json chrome_trace() const;
};

// Throws Error if the plan's tensors are not the profile's (by name and size).
SimResult simulate(const Profile& profile, const Plan& plan, const CostModel& cost,
                   const SimulatorSettings& settings = {}, bool keep_spans = false);

// The compute-only bound: forward + backward with no communication at all (the iteration time
// free, instant compression would reach).
double compute_bound(const Profile& profile);

}  // namespace gradcomp::model
