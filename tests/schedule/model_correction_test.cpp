// fit_correction: step times made by the model itself with a known per-message overhead,
// compute slow-down and step overhead are fitted back (the grid holds them), and the corrected
// model predicts them; without any of those, the correction is the identity.
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
    p.tensors.push_back({"t" + std::to_string(i), size_t{1} << (14 + i % 6), ready});
  }
  p.backward_s = ready + 0.001;
  return p;
}

model::CodecCosts codecs() {
  model::CodecCosts c;
  const model::Linear pass{1e-6, 2e-10};
  c.set("none", {pass, pass, pass});
  c.set("fp16", {{2e-6, 4e-10}, {2e-6, 5e-10}, {2e-6, 4e-10}});
  c.set("topk", {{5e-6, 3e-9}, {5e-6, 3e-9}, {2e-6, 1e-10}});
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

TEST(ModelCorrection, RecoversWhatTheModelMissed) {
  const ModelCorrection truth{.extra_latency_s = 2e-4, .lambda = 1.2, .step_overhead_s = 0.005};
  const model::CostModel actual(truth.applied(cluster()), codecs());
  std::vector<std::pair<Plan, double>> trials;
  for (const Plan& plan : plans(profile())) {
    trials.emplace_back(plan, model::simulate(truth.applied(profile()), plan, actual,
                                              truth.simulator()).iteration_s);
  }
  const ModelCorrection fit = fit_correction(profile(), cluster(), codecs(), trials);
  EXPECT_GT(fit.error_before, 0.05);
  EXPECT_LT(fit.error_after, 1e-6);
  EXPECT_DOUBLE_EQ(fit.extra_latency_s, 2e-4);
  EXPECT_NEAR(fit.lambda, 1.2, 1e-9);
  EXPECT_NEAR(fit.step_overhead_s, 0.005, 1e-9);
}

TEST(ModelCorrection, IsTheIdentityWhenTheModelIsRight) {
  const model::CostModel cost(cluster(), codecs());
  std::vector<std::pair<Plan, double>> trials;
  for (const Plan& plan : plans(profile())) {
    trials.emplace_back(plan, model::simulate(profile(), plan, cost).iteration_s);
  }
  const ModelCorrection fit = fit_correction(profile(), cluster(), codecs(), trials);
  EXPECT_EQ(fit.extra_latency_s, 0);
  EXPECT_EQ(fit.lambda, 1);
  EXPECT_NEAR(fit.step_overhead_s, 0, 1e-12);
  EXPECT_LT(fit.error_before, 1e-12);
  EXPECT_TRUE(fit_correction(profile(), cluster(), codecs(), {}).error_after == 0);
}

}  // namespace
}  // namespace gradcomp::schedule
