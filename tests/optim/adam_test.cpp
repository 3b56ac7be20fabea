#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "common/parallel.h"
#include "gradcomp/error.h"
#include "optim/optim_testing.h"

namespace gradcomp {
namespace {

using testing::Layer;

TEST(AdamW, FollowsTheDecoupledUpdateOverManySteps) {
  Layer layer(777);
  layer.fill_param(1, 0.1f);
  std::vector<double> x(layer.param.begin(), layer.param.end()), m(x.size()), v(x.size());
  AdamHyper h;
  h.lr = 0.01;
  h.weight_decay = 0.1;
  for (int64_t t = 1; t <= 30; ++t) {
    layer.fill_grad(50 + static_cast<uint32_t>(t));
    adamw_step(layer.slot(), t, h);
    for (size_t i = 0; i < x.size(); ++i) {
      const double g = layer.grad[i];
      m[i] = h.beta1 * m[i] + (1 - h.beta1) * g;
      v[i] = h.beta2 * v[i] + (1 - h.beta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(h.beta1, double(t)));
      const double v_hat = v[i] / (1 - std::pow(h.beta2, double(t)));
      x[i] -= h.lr * (m_hat / (std::sqrt(v_hat) + h.eps) + h.weight_decay * x[i]);
    }
  }
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_NEAR(layer.param[i], x[i], 1e-5 * (1 + std::abs(x[i]))) << i;
    ASSERT_NEAR(layer.exp_avg[i], m[i], 1e-6) << i;
  }
}

TEST(FrozenAdam, StepsOnTheGivenMomentumWithTheFrozenVariance) {
  Layer layer(500);
  layer.fill_param(2);
  layer.fill_grad(3);
  for (size_t i = 0; i < layer.param.size(); ++i) {
    layer.exp_avg[i] = layer.grad[i];                       // this step's (averaged) momentum
    layer.exp_avg_sq[i] = layer.grad[i] * layer.grad[i] + 1e-9f;  // as frozen
  }
  const std::vector<float> before = layer.param, v = layer.exp_avg_sq, m = layer.exp_avg;
  AdamHyper h;
  h.lr = 0.005;
  h.weight_decay = 0.01;
  const int64_t step = 40, frozen_at = 12;
  frozen_adam_step({layer.param, {}, layer.exp_avg, layer.exp_avg_sq}, step, frozen_at, h);
  for (size_t i = 0; i < before.size(); ++i) {
    const double m_hat = m[i] / (1 - std::pow(h.beta1, double(step)));
    const double v_hat = v[i] / (1 - std::pow(h.beta2, double(frozen_at)));
    const double want = before[i] - h.lr * (m_hat / (std::sqrt(v_hat) + h.eps) +
                                            h.weight_decay * before[i]);
    ASSERT_NEAR(layer.param[i], want, 1e-6 * (1 + std::abs(want))) << i;
  }
  EXPECT_EQ(layer.exp_avg, m) << "the momentum is the caller's";
  EXPECT_EQ(layer.exp_avg_sq, v) << "the variance stays frozen";
}

TEST(FrozenAdam, ACoordinateWhoseVarianceFrozeAtZeroStepsNoFurtherThanAdamCould) {
  // An embedding row never seen in the warm-up: v = 0, and now a gradient arrives.
  Layer layer(3);
  layer.param = {1.0f, 1.0f, 1.0f};
  layer.exp_avg = {1e-3f, -1e-3f, 0.0f};
  layer.exp_avg_sq = {0.0f, 0.0f, 0.0f};
  AdamHyper h;
  h.lr = 0.01;
  h.weight_decay = 0;
  frozen_adam_step({layer.param, {}, layer.exp_avg, layer.exp_avg_sq}, 20, 10, h);
  const float bound = static_cast<float>((1 - h.beta1) / std::sqrt(1 - h.beta2));  // 3.16 > 1
  EXPECT_FLOAT_EQ(layer.param[0], 1.0f - 0.01f * bound);  // not 1 - 0.01 * 1e-3 / 1e-6
  EXPECT_FLOAT_EQ(layer.param[1], 1.0f + 0.01f * bound);
  EXPECT_EQ(layer.param[2], 1.0f);
}

TEST(FrozenAdam, GivesTheSameBytesOnAnyThreadCount) {
  const size_t n = 2 * kChunk + 3;
  Layer one(n), two(n);
  for (Layer* l : {&one, &two}) {
    l->fill_param(4);
    l->fill_grad(5);
    for (size_t i = 0; i < n; ++i) {
      l->exp_avg[i] = l->grad[i];
      l->exp_avg_sq[i] = l->grad[i] * l->grad[i];
    }
  }
  frozen_adam_step({one.param, {}, one.exp_avg, one.exp_avg_sq}, 9, 4, AdamHyper{}, 1);
  frozen_adam_step({two.param, {}, two.exp_avg, two.exp_avg_sq}, 9, 4, AdamHyper{}, 2);
  EXPECT_EQ(one.param, two.param);
}

TEST(FrozenAdam, RefusesMoreVarianceUpdatesThanSteps) {
  Layer layer(4);
  EXPECT_THROW(frozen_adam_step(layer.slot(), 5, 6, AdamHyper{}), Error);
  EXPECT_THROW(frozen_adam_step(layer.slot(), 5, 0, AdamHyper{}), Error);
  LayerSlot short_moment = layer.slot();
  short_moment.exp_avg_sq = short_moment.exp_avg_sq.first(3);
  EXPECT_THROW(frozen_adam_step(short_moment, 5, 2, AdamHyper{}), Error);
  EXPECT_THROW(frozen_adam_step(layer.slot(), 5, 2, {.beta1 = 2}), SpecError);
}

// 0/1 Adam's step over a schedule of exact and compressed steps, against the update in double.
TEST(ZeroOneAdam, UpdatesTheVarianceOnExactStepsOnlyAndCorrectsItByTheirCount) {
  Layer layer(333);
  layer.fill_param(6, 0.1f);
  std::vector<double> x(layer.param.begin(), layer.param.end()), m(x.size()), v(x.size());
  AdamHyper h;
  h.lr = 0.01;
  h.beta2 = 0.95;
  h.weight_decay = 0.1;
  const double bound = std::max(1.0, (1 - h.beta1) / std::sqrt(1 - h.beta2));
  int64_t updates = 0;
  for (int64_t t = 1; t <= 24; ++t) {
    const bool exact = t <= 3 || t % 5 == 0;
    updates += exact;
    layer.fill_grad(70 + static_cast<uint32_t>(t));
    zero_one_adam_step(layer.slot(), t, updates, exact, h);
    for (size_t i = 0; i < x.size(); ++i) {
      const double g = layer.grad[i];
      m[i] = h.beta1 * m[i] + (1 - h.beta1) * g;
      if (exact) v[i] = h.beta2 * v[i] + (1 - h.beta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(h.beta1, double(t)));
      const double v_hat = v[i] / (1 - std::pow(h.beta2, double(updates)));
      const double step = std::clamp(m_hat / (std::sqrt(v_hat) + h.eps), -bound, bound);
      x[i] -= h.lr * (step + h.weight_decay * x[i]);
    }
  }
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_NEAR(layer.param[i], x[i], 1e-5 * (1 + std::abs(x[i]))) << i;
    ASSERT_NEAR(layer.exp_avg[i], m[i], 1e-6) << i;
    ASSERT_NEAR(layer.exp_avg_sq[i], v[i], 1e-6 * v[i] + 1e-12) << i;
  }
}

TEST(ZeroOneAdam, GivesTheSameBytesOnAnyThreadCountAndRefusesBadCounts) {
  const size_t n = 2 * kChunk + 3;
  Layer one(n), two(n);
  for (Layer* l : {&one, &two}) {
    l->fill_param(8);
    l->fill_grad(9);
  }
  for (const bool exact : {true, false}) {
    zero_one_adam_step(one.slot(), 2, 1, exact, AdamHyper{}, 1);
    zero_one_adam_step(two.slot(), 2, 1, exact, AdamHyper{}, 2);
    EXPECT_EQ(one.param, two.param);
    EXPECT_EQ(one.exp_avg_sq, two.exp_avg_sq);
  }
  EXPECT_THROW(zero_one_adam_step(one.slot(), 3, 4, true, AdamHyper{}), Error);
  EXPECT_THROW(zero_one_adam_step(one.slot(), 3, 0, false, AdamHyper{}), Error);
  LayerSlot short_grad = one.slot();
  short_grad.grad = short_grad.grad.first(3);
  EXPECT_THROW(zero_one_adam_step(short_grad, 3, 1, false, AdamHyper{}), Error);
}

}  // namespace
}  // namespace gradcomp
