// fit_correction: step times made by the model itself with a known per-message overhead,
// compute slow-down, codec cost scale and step overhead are fitted back (the grid holds them),
// and the corrected model predicts them; slow codecs are told apart from slow messages; without
// any of those, the correction is the identity.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "schedule/model_correction.h"

namespace gradcomp::schedule {
namespace {

model::Profile profile() {
  model::Profile p;
  p.model = "test";
  p.batch_size = 1;
  p.forward_s = 0.02;
  double ready = 0;
  for (int i = 0; i < 12; ++i) {
    ready += 0.003;
    p.tensors.push_back({fmt::format("t{}", i), size_t{1} << (14 + i % 6), ready});
  }
  p.backward_s = ready + 0.001;
  return p;
}

model::CodecCosts codecs() {
  model::CodecCosts c;
  const model::Linear pass{1e-6, 2e-10};
  c.set("none", {pass, pass, pass});
  c.set("fp16", {{2e-6, 4e-10}, {2e-6, 5e-10}, {2e-6, 4e-10}});
  c.set("topk", {{5e-6, 3e-8}, {5e-6, 3e-8}, {2e-6, 1e-9}});
  return c;
}

std::vector<Plan> plans(const model::Profile& p) {
  std::vector<Plan> out;
  for (const char* option : {"none", "fp16", "topk:ratio=0.01|ef|allgather"}) {
    for (size_t bucket_bytes : {size_t{1} << 18, size_t{4} << 20}) {
      DefaultPlanSettings s;
      s.bucket_bytes = bucket_bytes;
      s.min_compress_elements = 1;
      s.compressed = parse_option(option);
      out.push_back(make_default_plan(p.tensor_infos(), s));
    }
  }
  return out;
}

model::Cluster cluster() {
  model::Cluster c;
  c.workers = 4;
  c.inter = {1e9 / 8, 50e-6};
  c.intra = c.inter;
  return c;
}

// Step times of the plans as the model with `truth` predicts them.
std::vector<std::pair<Plan, double>> measured_with(const model::Correction& truth) {
  const model::CostModel actual = truth.cost_model(cluster(), codecs());
  std::vector<std::pair<Plan, double>> trials;
  for (const Plan& plan : plans(profile())) {
    trials.emplace_back(plan, model::simulate(truth.applied(profile()), plan, actual,
                                              truth.simulator()).iteration_s);
  }
  return trials;
}

TEST(ModelCorrection, RecoversWhatTheModelMissed) {
  const model::Correction truth{
      .extra_latency_s = 2e-4, .lambda = 1.2, .cost_scale = 2, .step_overhead_s = 0.005};
  const model::Correction fit =
      fit_correction(profile(), cluster(), codecs(), measured_with(truth));
  EXPECT_GT(fit.error_before, 0.05);
  EXPECT_LT(fit.error_after, 1e-6);
  EXPECT_DOUBLE_EQ(fit.extra_latency_s, 2e-4);
  EXPECT_NEAR(fit.lambda, 1.2, 1e-9);
  EXPECT_DOUBLE_EQ(fit.cost_scale, 2);
  EXPECT_NEAR(fit.step_overhead_s, 0.005, 1e-9);
}

// Slow codecs and slow messages both make compressed plans slower; the uncompressed plans
// (codec "none" costs little) tell them apart.
TEST(ModelCorrection, TellsSlowCodecsFromSlowMessages) {
  const model::Correction slow_codecs =
      fit_correction(profile(), cluster(), codecs(), measured_with({.cost_scale = 3}));
  EXPECT_DOUBLE_EQ(slow_codecs.cost_scale, 3);
  EXPECT_EQ(slow_codecs.extra_latency_s, 0);
  EXPECT_LT(slow_codecs.error_after, 1e-6);
  const model::Correction slow_messages =
      fit_correction(profile(), cluster(), codecs(), measured_with({.extra_latency_s = 1e-3}));
  EXPECT_DOUBLE_EQ(slow_messages.extra_latency_s, 1e-3);
  EXPECT_EQ(slow_messages.cost_scale, 1);
  EXPECT_LT(slow_messages.error_after, 1e-6);
}

// Two trials (uncompressed in large buckets, fp16 in small ones) slowed by costly messages: a
// cost scale of 3 fits them closer than the grid's latencies do, by less than a trial's noise;
// that is no evidence of slow codecs.
TEST(ModelCorrection, ScalesCodecsOnlyOnEvidence) {
  const auto all = measured_with({.extra_latency_s = 7e-5});
  const model::Correction fit = fit_correction(profile(), cluster(), codecs(), {all[1], all[2]});
  EXPECT_EQ(fit.cost_scale, 1);
  EXPECT_DOUBLE_EQ(fit.extra_latency_s, 5e-5);
  EXPECT_LT(fit.error_after, 0.01);
}

// Time outside the model is in every step, the uncompressed plan's too: when only the
// compressed trials run slow (50 ms, far more than their codec costs, in a way none of the terms
// describes: on the emulated cluster, PowerSGD and dither) and the uncompressed trials are
// predicted exactly, the fit may not make that a step overhead (which would slow every plan,
// random-k's that was not tried too); uncompressed trials 2 ms slow bound it by 2 ms.
TEST(ModelCorrection, TheStepOverheadIsNoMoreThanTheUncompressedTrialsLeave) {
  const auto slow_compressed = [](double uncompressed_slow_s) {
    auto trials = measured_with({});
    for (auto& [plan, seconds] : trials) {
      seconds += plan.buckets[0].option.codec == "none" ? uncompressed_slow_s : 0.05;
    }
    return trials;
  };
  const auto overhead = [&](double uncompressed_slow_s) {
    return fit_correction(profile(), cluster(), codecs(), slow_compressed(uncompressed_slow_s))
        .step_overhead_s;
  };
  EXPECT_NEAR(overhead(0), 0, 1e-12);
  EXPECT_LE(overhead(0.002), 0.002 + 1e-12);
}

TEST(ModelCorrection, IsTheIdentityWhenTheModelIsRight) {
  const model::CostModel cost(cluster(), codecs());
  std::vector<std::pair<Plan, double>> trials;
  for (const Plan& plan : plans(profile())) {
    trials.emplace_back(plan, model::simulate(profile(), plan, cost).iteration_s);
  }
  const model::Correction fit = fit_correction(profile(), cluster(), codecs(), trials);
  EXPECT_EQ(fit.extra_latency_s, 0);
  EXPECT_EQ(fit.lambda, 1);
  EXPECT_EQ(fit.cost_scale, 1);
  EXPECT_NEAR(fit.step_overhead_s, 0, 1e-12);
  EXPECT_LT(fit.error_before, 1e-12);
  EXPECT_TRUE(fit_correction(profile(), cluster(), codecs(), {}).error_after == 0);
}

}  // namespace
}  // namespace gradcomp::schedule
