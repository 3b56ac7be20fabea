#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/parallel.h"
#include "gradcomp/error.h"
#include "optim/optim_testing.h"

namespace gradcomp {
namespace {

using testing::Layer;

// One layer in the compression stage: v frozen, v' and m as they were after the last step.
struct Stage {
  Layer layer;
  std::vector<float> fresh;
  OneBitLambLayer state;

  Stage(size_t n, uint32_t seed) : layer(n), fresh(n) {
    layer.fill_param(seed, 0.1f);
    layer.fill_grad(seed + 1);
    for (size_t i = 0; i < n; ++i) {
      layer.exp_avg[i] = layer.grad[i];
      layer.exp_avg_sq[i] = layer.grad[i] * layer.grad[i] * 1.5f + 1e-10f;
      fresh[i] = layer.exp_avg_sq[i];
    }
    state.coeff = 0.8;
    state.fresh_exp_avg_sq = fresh;
  }
  // This step's averaged momentum, in layer.grad.
  void next_momentum(uint32_t seed, float scale = 1e-3f) { layer.fill_grad(seed, scale); }
  LayerStep step(int64_t t, int64_t frozen_at, const AdamHyper& h, const OneBitLambHyper& lh,
                 int threads = 1) {
    return onebit_lamb_step(layer.slot(), state, t, frozen_at, h, lh, threads);
  }
};

// The compression stage's step in double, from the definition in gradcomp/optimizer.h.
struct OneBitLambReference {
  std::vector<double> x, m, v, fresh;
  double factor = 1;

  explicit OneBitLambReference(const Stage& s)
      : x(s.layer.param.begin(), s.layer.param.end()),
        m(s.layer.exp_avg.begin(), s.layer.exp_avg.end()),
        v(s.layer.exp_avg_sq.begin(), s.layer.exp_avg_sq.end()),
        fresh(s.fresh.begin(), s.fresh.end()) {}

  void step(const std::vector<float>& momentum, double coeff, int64_t t, int64_t frozen_at,
            const AdamHyper& h, const OneBitLambHyper& lh) {
    const size_t n = x.size();
    const double c1 = 1 - std::pow(h.beta1, double(t));
    const double frozen_c2 = 1 - std::pow(h.beta2, double(frozen_at));
    const double fresh_c2 = 1 - std::pow(h.beta2, double(t));
    const double bound = std::max(1.0, (1 - h.beta1) / std::sqrt(1 - h.beta2));
    std::vector<double> d(n);
    double ratio = 0, direction = 0, step = 0;
    for (size_t i = 0; i < n; ++i) {
      const double g = (momentum[i] - h.beta1 * m[i]) / (1 - h.beta1);
      fresh[i] = h.beta2 * fresh[i] + (1 - h.beta2) * g * g;
      m[i] = momentum[i];
      const double frozen_denominator = std::sqrt(v[i] / frozen_c2) + h.eps;
      ratio = std::max(ratio, frozen_denominator / (std::sqrt(fresh[i] / fresh_c2) + h.eps));
      const double u = std::clamp(m[i] / c1 / frozen_denominator, -bound, bound);
      d[i] = u + h.weight_decay * x[i];
      direction += u * u;
      step += d[i] * d[i];
    }
    const double share = std::min(1.0, std::sqrt(direction / step));
    double f = std::clamp(ratio * share + 1 - share, lh.factor_min, lh.factor_max);
    factor = std::clamp(f, factor * (1 - lh.factor_threshold), factor * (1 + lh.factor_threshold));
    for (size_t i = 0; i < n; ++i) x[i] -= h.lr * coeff * factor * d[i];
  }
};

double gap(const std::vector<float>& a, const std::vector<double>& b) {
  return testing::relative_gap(a, b);
}

TEST(OneBitLamb, FollowsItsDefinitionOverSeveralSteps) {
  Stage stage(700, 1);
  OneBitLambReference reference(stage);
  AdamHyper h;
  h.lr = 0.01;
  h.weight_decay = 0.01;
  const OneBitLambHyper lh;
  const int64_t frozen_at = 30;
  for (int64_t t = frozen_at + 1; t <= frozen_at + 12; ++t) {
    // The gradients' scale falls step by step: the fresh variance follows, the factor rises.
    stage.next_momentum(100 + static_cast<uint32_t>(t), 1e-3f * std::pow(0.8f, float(t - 30)));
    const std::vector<float> momentum = stage.layer.grad;
    const LayerStep s = stage.step(t, frozen_at, h, lh);
    reference.step(momentum, stage.state.coeff, t, frozen_at, h, lh);
    ASSERT_NEAR(stage.state.factor, reference.factor, 1e-5 * reference.factor) << t;
    EXPECT_DOUBLE_EQ(s.trust_ratio, stage.state.coeff * stage.state.factor);
    EXPECT_LT(gap(stage.layer.param, reference.x), 1e-5) << t;
    EXPECT_EQ(stage.layer.exp_avg, momentum) << "m takes the averaged momentum";
  }
  EXPECT_LT(gap(stage.fresh, reference.fresh), 1e-5);
  EXPECT_GT(stage.state.factor, 1.1) << "a falling gradient scale must raise the factor";
}

TEST(OneBitLamb, TheFactorMovesByAtMostTheThresholdPerStepWithinItsBounds) {
  Stage stage(256, 2);
  std::fill(stage.layer.exp_avg.begin(), stage.layer.exp_avg.end(), 0.0f);
  AdamHyper h;
  h.beta2 = 0.5;  // a fresh variance that moves by far more than 10% a step
  h.weight_decay = 0;
  OneBitLambHyper lh;
  double last = stage.state.factor;
  int held_back = 0;
  for (int64_t t = 11; t <= 40; ++t) {
    stage.next_momentum(7, 1e-9f);  // the gradients all but vanish: the fresh variance decays
    stage.step(t, 10, h, lh);
    const double f = stage.state.factor;
    EXPECT_LE(f, last * (1 + lh.factor_threshold) * (1 + 1e-12)) << t;
    EXPECT_LE(f, lh.factor_max) << t;
    held_back += f == last * (1 + lh.factor_threshold);
    last = f;
  }
  EXPECT_GT(held_back, 5) << "the threshold, not the ratio, must have set the pace";
  EXPECT_DOUBLE_EQ(last, lh.factor_max);
  for (int64_t t = 41; t <= 80; ++t) {
    // Now far larger than at the freeze on every coordinate (the factor takes the largest
    // ratio: one small coordinate would hold it up).
    std::fill(stage.layer.grad.begin(), stage.layer.grad.end(), 1.0f);
    stage.step(t, 10, h, lh);
    EXPECT_GE(stage.state.factor, last * (1 - lh.factor_threshold) * (1 - 1e-12)) << t;
    EXPECT_GE(stage.state.factor, lh.factor_min) << t;
    last = stage.state.factor;
  }
  EXPECT_DOUBLE_EQ(last, lh.factor_min);
}

TEST(OneBitLamb, MovesTheLayerByLrTimesTheCoefficientTimesTheBoundedStep) {
  // The factor held at 1 (threshold 0): the step is lr * coeff * d exactly.
  Stage stage(300, 3);
  const std::vector<float> x0 = stage.layer.param;
  AdamHyper h;
  h.lr = 0.02;
  h.weight_decay = 0.1;
  OneBitLambHyper lh;
  lh.factor_threshold = 0;
  stage.next_momentum(9);
  const std::vector<float> momentum = stage.layer.grad, v = stage.layer.exp_avg_sq;
  const LayerStep s = stage.step(50, 20, h, lh);
  EXPECT_EQ(stage.state.factor, 1.0);
  EXPECT_DOUBLE_EQ(s.trust_ratio, stage.state.coeff);
  const double c1 = 1 - std::pow(h.beta1, 50.0), c2 = 1 - std::pow(h.beta2, 20.0);
  const double bound = (1 - h.beta1) / std::sqrt(1 - h.beta2);  // 3.16
  for (size_t i = 0; i < x0.size(); ++i) {
    const double u = std::clamp(momentum[i] / c1 / (std::sqrt(v[i] / c2) + h.eps), -bound, bound);
    const double d = u + h.weight_decay * x0[i];
    const double want = x0[i] - h.lr * stage.state.coeff * d;
    ASSERT_NEAR(stage.layer.param[i], want, 1e-6 * (1 + std::abs(want))) << i;
  }
  EXPECT_EQ(stage.layer.exp_avg_sq, v) << "the variance stays frozen";
}

TEST(OneBitLamb, GivesTheSameBytesOnAnyThreadCount) {
  const size_t n = 2 * kChunk + 77;
  Stage one(n, 4), two(n, 4);
  for (int64_t t = 6; t <= 8; ++t) {
    one.next_momentum(20 + static_cast<uint32_t>(t));
    two.next_momentum(20 + static_cast<uint32_t>(t));
    one.step(t, 5, AdamHyper{}, OneBitLambHyper{}, 1);
    two.step(t, 5, AdamHyper{}, OneBitLambHyper{}, 2);
  }
  EXPECT_EQ(one.layer.param, two.layer.param);
  EXPECT_EQ(one.fresh, two.fresh);
  EXPECT_EQ(one.state.factor, two.state.factor);
}

TEST(OneBitLamb, RefusesBadCountsLengthsStateAndHyperParameters) {
  Stage stage(8, 5);
  const AdamHyper h;
  const OneBitLambHyper lh;
  EXPECT_THROW(stage.step(5, 6, h, lh), Error);
  EXPECT_THROW(stage.step(5, 0, h, lh), Error);
  OneBitLambLayer short_fresh = stage.state;
  short_fresh.fresh_exp_avg_sq = short_fresh.fresh_exp_avg_sq.first(7);
  EXPECT_THROW(onebit_lamb_step(stage.layer.slot(), short_fresh, 5, 2, h, lh), Error);
  for (const double bad : {0.0, -1.0, double(NAN), double(INFINITY)}) {
    OneBitLambLayer s = stage.state;
    s.coeff = bad;
    EXPECT_THROW(onebit_lamb_step(stage.layer.slot(), s, 5, 2, h, lh), Error) << bad;
    s = stage.state;
    s.factor = bad;
    EXPECT_THROW(onebit_lamb_step(stage.layer.slot(), s, 5, 2, h, lh), Error) << bad;
  }
  const std::vector<float> untouched = stage.layer.param;
  EXPECT_THROW(stage.step(5, 2, h, {.coeff_beta = 1}), SpecError);
  EXPECT_THROW(stage.step(5, 2, h, {.max_coeff = 0.001}), SpecError);  // below min_coeff
  EXPECT_THROW(stage.step(5, 2, h, {.min_coeff = 0}), SpecError);
  EXPECT_THROW(stage.step(5, 2, h, {.factor_max = 0.9}), SpecError);
  EXPECT_THROW(stage.step(5, 2, h, {.factor_min = 1.5}), SpecError);
  EXPECT_THROW(stage.step(5, 2, h, {.factor_threshold = -0.1}), SpecError);
  EXPECT_THROW(stage.step(5, 2, {.eps = 0}, lh), SpecError);
  EXPECT_EQ(stage.layer.param, untouched) << "a refused step changes nothing";
}

}  // namespace
}  // namespace gradcomp
