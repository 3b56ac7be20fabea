// fit_correction: step times made by the model itself with a known per-message overhead,
// compute slow-down, link rate, codecs' own slow-downs and step overhead are fitted back (the
// grids hold them), and the corrected model predicts them; slow codecs are told apart from
// slow messages and from each other, and a codec no trial ran gets no slow-down of another's;
// without any of those, the correction is the identity.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "gradcomp/model/correction.h"

namespace gradcomp::model {
namespace {

Profile fit_profile() {
  Profile p;
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

CodecCosts codecs() {
  CodecCosts c;
  const Linear pass{1e-6, 2e-10};
  c.set("none", {pass, pass, pass});
  c.set("fp16", {{2e-6, 4e-10}, {2e-6, 5e-10}, {2e-6, 4e-10}});
  c.set("topk", {{5e-6, 3e-8}, {5e-6, 3e-8}, {2e-6, 1e-9}});
  return c;
}

std::vector<Plan> plans(const Profile& p) {
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

Cluster fit_cluster() {
  Cluster c;
  c.workers = 4;
  c.inter = {1e9 / 8, 50e-6};
  c.intra = c.inter;
  return c;
}

// Step times of the plans as the model with `truth` predicts them.
std::vector<std::pair<Plan, double>> measured_with(const Correction& truth) {
  const CostModel actual = truth.cost_model(fit_cluster(), codecs());
  std::vector<std::pair<Plan, double>> trials;
  for (const Plan& plan : plans(fit_profile())) {
    trials.emplace_back(
        plan,
        simulate(truth.applied(fit_profile()), plan, actual, truth.simulator(plan)).iteration_s);
  }
  return trials;
}

TEST(ModelCorrection, RecoversWhatTheModelMissed) {
  const Correction truth{.extra_latency_s = 2e-4,
                         .bandwidth_scale = 0.8,
                         .codec_lambdas = {{"fp16", 1.5}, {"topk", 2}}};
  const Correction fit =
      fit_correction(fit_profile(), fit_cluster(), codecs(), measured_with(truth));
  EXPECT_GT(fit.error_before, 0.05);
  EXPECT_LT(fit.error_after, 1e-6);
  EXPECT_DOUBLE_EQ(fit.extra_latency_s, 2e-4);
  EXPECT_DOUBLE_EQ(fit.bandwidth_scale, 0.8);
  EXPECT_EQ(fit.codec_lambdas, truth.codec_lambdas);
  EXPECT_EQ(fit.lambda, 1);
  EXPECT_EQ(fit.cost_scale, 1);
  EXPECT_NEAR(fit.step_overhead_s, 0, 1e-9);
}

// Slow codecs and slow messages both make compressed plans slower; the uncompressed plans
// (codec "none" costs little) tell them apart.
TEST(ModelCorrection, TellsSlowCodecsFromSlowMessages) {
  const Correction slow_codecs = fit_correction(fit_profile(), fit_cluster(), codecs(),
                                                measured_with({.codec_lambdas = {{"topk", 3}}}));
  EXPECT_EQ(slow_codecs.codec_lambdas, (std::map<std::string, double>{{"topk", 3}}));
  EXPECT_EQ(slow_codecs.extra_latency_s, 0);
  EXPECT_LT(slow_codecs.error_after, 1e-6);
  const Correction slow_messages = fit_correction(fit_profile(), fit_cluster(), codecs(),
                                                  measured_with({.extra_latency_s = 1e-3}));
  EXPECT_DOUBLE_EQ(slow_messages.extra_latency_s, 1e-3);
  EXPECT_TRUE(slow_messages.codec_lambdas.empty());
  EXPECT_LT(slow_messages.error_after, 1e-6);
}

// fp16's trials half a percent slower than the truth (within a step's noise) and top-k's as
// the truth: neither gets a slow-down of its own; top-k's trials 20% slower: top-k does.
TEST(ModelCorrection, GivesACodecItsOwnSlowDownOnlyOnEvidence) {
  const auto slower = [](const std::string& codec, double factor) {
    auto trials = measured_with({.bandwidth_scale = 0.9});
    for (auto& [plan, seconds] : trials) {
      if (plan.buckets[0].option.codec.rfind(codec, 0) == 0) seconds *= factor;
    }
    return trials;
  };
  const Correction noise =
      fit_correction(fit_profile(), fit_cluster(), codecs(), slower("fp16", 1.005));
  EXPECT_TRUE(noise.codec_lambdas.empty());
  EXPECT_DOUBLE_EQ(noise.bandwidth_scale, 0.9);
  const Correction slow =
      fit_correction(fit_profile(), fit_cluster(), codecs(), slower("topk", 1.2));
  EXPECT_EQ(slow.codec_lambdas.size(), 1u);
  EXPECT_TRUE(slow.codec_lambdas.contains("topk"));
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
    return fit_correction(fit_profile(), fit_cluster(), codecs(),
                          slow_compressed(uncompressed_slow_s))
        .step_overhead_s;
  };
  EXPECT_NEAR(overhead(0), 0, 1e-12);
  EXPECT_LE(overhead(0.002), 0.002 + 1e-12);
}

// A link slower under a step's long transfers than the probes saw: the uncompressed trials
// (all bytes, few codec costs) tell it apart from slow messages and slow codecs.
TEST(ModelCorrection, FitsTheLinkRateAStepGets) {
  const Correction fit = fit_correction(fit_profile(), fit_cluster(), codecs(),
                                        measured_with({.bandwidth_scale = 0.85}));
  EXPECT_DOUBLE_EQ(fit.bandwidth_scale, 0.85);
  EXPECT_EQ(fit.extra_latency_s, 0);
  EXPECT_TRUE(fit.codec_lambdas.empty());
  EXPECT_LT(fit.error_after, 1e-6);
}

// One codec that slows the backward pass (top-k, 2.5x) among trials of three: the slow-down
// stays with it. A codec the trials never ran (fp16 here) gets none, and the corrected model
// predicts its plans as the truth does, where a global term would have slowed them too.
TEST(ModelCorrection, ACodecsSlowDownStaysWithIt) {
  const Correction truth{.codec_lambdas = {{"topk", 2.5}}};
  auto trials = measured_with(truth);
  const auto fp16_trials = std::vector(trials.begin() + 2, trials.begin() + 4);
  trials.erase(trials.begin() + 2, trials.begin() + 4);  // the fp16 plans: not tried
  const Correction fit = fit_correction(fit_profile(), fit_cluster(), codecs(), trials);
  EXPECT_EQ(fit.codec_lambdas, truth.codec_lambdas);
  EXPECT_LT(fit.error_after, 1e-6);
  const CostModel corrected = fit.cost_model(fit_cluster(), codecs());
  for (const auto& [plan, seconds] : fp16_trials) {
    ASSERT_EQ(plan.buckets[0].option.codec.rfind("fp16", 0), 0u);
    EXPECT_NEAR(
        simulate(fit.applied(fit_profile()), plan, corrected, fit.simulator(plan)).iteration_s,
        seconds, 1e-9 * seconds);
  }
}

TEST(ModelCorrection, IsTheIdentityWhenTheModelIsRight) {
  const CostModel cost(fit_cluster(), codecs());
  std::vector<std::pair<Plan, double>> trials;
  for (const Plan& plan : plans(fit_profile())) {
    trials.emplace_back(plan, simulate(fit_profile(), plan, cost).iteration_s);
  }
  const Correction fit = fit_correction(fit_profile(), fit_cluster(), codecs(), trials);
  EXPECT_EQ(fit.extra_latency_s, 0);
  EXPECT_EQ(fit.lambda, 1);
  EXPECT_EQ(fit.bandwidth_scale, 1);
  EXPECT_TRUE(fit.codec_lambdas.empty());
  EXPECT_NEAR(fit.step_overhead_s, 0, 1e-12);
  EXPECT_LT(fit.error_before, 1e-12);
  EXPECT_TRUE(fit_correction(fit_profile(), fit_cluster(), codecs(), {}).error_after == 0);
}

}  // namespace
}  // namespace gradcomp::model
