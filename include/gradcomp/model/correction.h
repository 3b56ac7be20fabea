// Correction: what measured steps teach the cost model. The model misses what
// docs/cluster-benchmark.md names as its errors: a cost per message beyond the link's latency,
// compute slowed while the exchange runs, codecs slower than calibrated (workers that share
// cores), and time per step outside the model (the optimizer, the framework). The auto scheduler
// fits these four terms to the step times of its trials (schedule/model_correction.h); the
// corrected model predicts its next search, and `gradcomp simulate --correction` replays it.
// JSON: {"extra_latency_s", "lambda", "cost_scale", "step_overhead_s", "error_before",
// "error_after"} (cost_scale optional: 1).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include "gradcomp/model/cluster.h"
#include "gradcomp/model/cost_model.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/model/simulator.h"

namespace gradcomp::model {

// The ranges a correction's JSON may hold: wider than any fit makes, narrow enough that every
// corrected time stays finite.
inline constexpr double kMaxLambda = 10;
inline constexpr double kMinCostScale = 1e-6;
inline constexpr double kMaxCostScale = 1e6;

struct Correction {
  double extra_latency_s = 0;  // added to every message's latency
  double lambda = 1;           // the simulator's compute slow-down while exchanging
  double cost_scale = 1;       // multiplies every codec cost
  double step_overhead_s = 0;  // added to the forward pass
  double error_before = 0;     // mean |predicted - measured| / measured, without the correction
  double error_after = 0;      // ... with it, on the same steps

  Cluster applied(Cluster cluster) const;
  Profile applied(Profile profile) const;
  CodecCosts applied(const CodecCosts& codecs) const { return codecs.scaled(cost_scale); }
  CostModel cost_model(const Cluster& cluster, const CodecCosts& codecs) const {
    return CostModel(applied(cluster), applied(codecs));
  }
  SimulatorSettings simulator() const { return {.lambda = lambda}; }

  nlohmann::json to_json() const;
  // Throws Error naming the field that is missing, unknown or out of range.
  static Correction from_json(const nlohmann::json& json);
};

}  // namespace gradcomp::model
