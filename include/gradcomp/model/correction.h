// Correction: what measured steps teach the cost model. The model misses what
// docs/cluster-benchmark.md names as its errors: a cost per message beyond the link's latency,
// a link slower under a step's traffic than under the probes', compute slowed while the
// exchange runs, codecs slower than calibrated (workers that share cores), and time per step
// outside the model (the optimizer, the framework). The auto scheduler fits these terms to the
// step times of its trials (fit_correction below); the corrected model predicts its next search,
// and `gradcomp simulate --correction` replays it (`gradcomp correct` refits a saved report).
// JSON: {"extra_latency_s", "lambda", "bandwidth_scale", "cost_scale", "codec_lambdas",
// "step_overhead_s", "error_before", "error_after"} (bandwidth_scale, cost_scale optional: 1;
// codec_lambdas optional: none).
#pragma once

#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "gradcomp/model/cluster.h"
#include "gradcomp/model/cost_model.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/model/simulator.h"
#include "gradcomp/plan.h"

namespace gradcomp::model {

// The ranges a correction's JSON may hold: wider than any fit makes, narrow enough that every
// corrected time stays finite.
inline constexpr double kMaxLambda = 10;
inline constexpr double kMinCostScale = 1e-6;
inline constexpr double kMaxCostScale = 1e6;
inline constexpr double kMinBandwidthScale = 1e-3;
inline constexpr double kMaxBandwidthScale = 1e3;

struct Correction {
  double extra_latency_s = 0;  // added to every message's latency
  double lambda = 1;           // the simulator's compute slow-down while exchanging
  double bandwidth_scale = 1;  // multiplies both links' bandwidth: a step's rate, not a probe's
  double cost_scale = 1;       // multiplies every codec's costs (fitted before 2026-12-03)
  // The compute slow-down while a codec's buckets are exchanged, per codec name, in place of
  // lambda for the elements it compresses: a slowness measured on the trials of one codec (its
  // work on cores the ranks share, slowing the backward pass) stays with that codec.
  std::map<std::string, double> codec_lambdas{};
  double step_overhead_s = 0;  // added to the forward pass
  double error_before = 0;     // mean |predicted - measured| / measured, without the correction
  double error_after = 0;      // ... with it, on the same steps

  Cluster applied(Cluster cluster) const;
  Profile applied(Profile profile) const;
  CodecCosts applied(const CodecCosts& codecs) const { return codecs.scaled(cost_scale); }
  CostModel cost_model(const Cluster& cluster, const CodecCosts& codecs) const {
    return CostModel(applied(cluster), applied(codecs));
  }
  // The slow-down of `plan`'s compute: the mean over the gradient's elements of their bucket
  // codec's lambda (codec_lambdas), or lambda (uncompressed, or a codec without one).
  double lambda_of(const Plan& plan) const;
  // The same from a plan's elements per codec name ("none" included) and their total.
  double lambda_of(const std::map<std::string, double>& elements, double total) const;
  SimulatorSettings simulator(const Plan& plan) const { return {.lambda = lambda_of(plan)}; }

  // "+500 us a message, link rate x0.9, lambda 1, powersgd 2.5, codec costs x1, +1.2 ms a step
  // (fitted error 38.2% -> 1.3%)": what is not the identity, and the errors.
  std::string summary() const;

  nlohmann::json to_json() const;
  // Throws Error naming the field that is missing, unknown or out of range.
  static Correction from_json(const nlohmann::json& json);
};

// The elements of each codec's buckets in `plan`, by codec name ("none" included): what a
// plan's slow-down is weighed by (Correction::lambda_of).
std::map<std::string, double> elements_by_codec(const Plan& plan);

// What the trials teach the cost model: the correction that brings the predictions of `trials`
// (plan, measured seconds) closest to the measurements, relative error; the identity when it
// does not help. The link's rate (and its latency, when two trials tell it) on the uncompressed
// trials alone, then on all trials the latency per message and each tried codec's own slow-down
// (grids, by coordinate descent), then the step overhead in closed form. A codec gets a
// slow-down of its own only on evidence (it halves the error on the trials that run it, by more
// than a trial's noise), and a codec no trial ran gets none.
Correction fit_correction(const Profile& profile, const Cluster& cluster,
                          const CodecCosts& codecs,
                          const std::vector<std::pair<Plan, double>>& trials);

}  // namespace gradcomp::model
