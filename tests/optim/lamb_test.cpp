#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/parallel.h"
#include "gradcomp/error.h"
#include "optim/optim_testing.h"

namespace gradcomp {
namespace {

using testing::Layer;
using testing::Reference;
using testing::relative_gap;

TEST(Lamb, FollowsThePapersUpdateOverManySteps) {
  for (const bool bias_correction : {true, false}) {
    Layer layer(1000);
    layer.fill_param(1, 0.05f);
    Reference reference(layer);
    AdamHyper h;
    h.lr = 0.01;
    h.weight_decay = 0.01;
    h.bias_correction = bias_correction;
    for (int64_t t = 1; t <= 20; ++t) {
      layer.fill_grad(100 + static_cast<uint32_t>(t));
      lamb_step(layer.slot(), t, h);
      reference.step(layer.grad, t, h, /*lans=*/false, false);
    }
    EXPECT_LT(relative_gap(layer.param, reference.param), 1e-5) << bias_correction;
    EXPECT_LT(relative_gap(layer.exp_avg, reference.exp_avg), 1e-5);
    EXPECT_LT(relative_gap(layer.exp_avg_sq, reference.exp_avg_sq), 1e-5);
  }
}

TEST(Lamb, MovesEachLayerByLrTimesItsNorm) {
  // Whatever the gradient's scale, the step's norm is lr * ||x||: the trust ratio's purpose.
  for (const float grad_scale : {1e-6f, 1.0f, 1e4f}) {
    Layer layer(4097);
    layer.fill_param(2, 0.1f);
    layer.fill_grad(3, grad_scale);
    const std::vector<float> before = layer.param;
    AdamHyper h;
    h.lr = 0.02;
    const LayerStep s = lamb_step(layer.slot(), 1, h);
    double moved = 0, norm = 0;
    for (size_t i = 0; i < before.size(); ++i) {
      moved += std::pow(double(layer.param[i]) - before[i], 2);
      norm += double(before[i]) * before[i];
    }
    EXPECT_NEAR(std::sqrt(norm), s.param_norm, 1e-6 * s.param_norm);
    EXPECT_NEAR(std::sqrt(moved), h.lr * s.param_norm, 1e-4 * h.lr * s.param_norm) << grad_scale;
    EXPECT_EQ(s.grad_trust, 1.0);
  }
}

TEST(Lamb, AZeroLayerTakesAnAdamStep) {
  // ||x|| = 0 (a zero-initialised bias): the ratio is 1, so the step is lr * r.
  Layer layer(100);
  layer.fill_grad(4);
  AdamHyper h;
  h.lr = 0.1;
  const LayerStep s = lamb_step(layer.slot(), 1, h);
  EXPECT_EQ(s.trust_ratio, 1.0);
  for (size_t i = 0; i < layer.param.size(); ++i) {
    // m^ = g, v^ = g^2: r = g / (|g| + eps), so each coordinate moves by about lr.
    EXPECT_NEAR(layer.param[i], -h.lr * layer.grad[i] / (std::abs(layer.grad[i]) + h.eps), 1e-6);
  }
}

TEST(Lamb, GivesTheSameBytesOnAnyThreadCount) {
  const size_t n = 3 * kChunk + 17;  // several chunks and a ragged end
  Layer one(n), four(n);
  one.fill_param(5);
  four.fill_param(5);
  AdamHyper h;
  for (int64_t t = 1; t <= 3; ++t) {
    one.fill_grad(6 + static_cast<uint32_t>(t));
    four.fill_grad(6 + static_cast<uint32_t>(t));
    const LayerStep a = lamb_step(one.slot(), t, h, 1);
    const LayerStep b = lamb_step(four.slot(), t, h, 4);
    EXPECT_EQ(a.trust_ratio, b.trust_ratio);
  }
  EXPECT_EQ(one.param, four.param);
  EXPECT_EQ(one.exp_avg, four.exp_avg);
  EXPECT_EQ(one.exp_avg_sq, four.exp_avg_sq);
}

TEST(Lamb, AnEmptyLayerIsANoOp) {
  Layer layer(0);
  const LayerStep s = lamb_step(layer.slot(), 1, AdamHyper{});
  EXPECT_EQ(s.param_norm, 0.0);
  EXPECT_EQ(s.trust_ratio, 1.0);
}

TEST(Lamb, ANonFiniteGradientShowsInTheParameters) {
  // Never silently zeroed: a NaN gradient makes the layer non-finite, for the caller (or
  // DistributedOptimizer, which skips such steps) to see.
  Layer layer(64);
  layer.fill_param(7);
  layer.fill_grad(8);
  layer.grad[5] = std::numeric_limits<float>::quiet_NaN();
  lamb_step(layer.slot(), 1, AdamHyper{});
  EXPECT_FALSE(std::isfinite(layer.param[5]));
}

TEST(Lamb, RefusesMismatchedSpansAndAStepBeforeTheFirst) {
  Layer layer(10);
  LayerSlot slot = layer.slot();
  slot.exp_avg = slot.exp_avg.first(9);
  EXPECT_THROW(
      {
        try {
          lamb_step(slot, 1, AdamHyper{});
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("one length; got 10, 10, 9, 10"), std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  EXPECT_THROW(lamb_step(layer.slot(), 0, AdamHyper{}), Error);
}

TEST(AdamHyper, RefusesEachParameterOutOfRangeByName) {
  const auto refused = [](AdamHyper h, const std::string& what) {
    try {
      check_adam_hyper(h, "LAMB");
    } catch (const SpecError& e) {
      return std::string(e.what()).find("LAMB: " + what) != std::string::npos;
    }
    return false;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(refused({.lr = -1}, "lr is -1"));
  EXPECT_TRUE(refused({.lr = nan}, "lr is nan"));
  EXPECT_TRUE(refused({.beta1 = 1.0}, "beta1 is 1; allowed: 0 <= beta1 < 1"));
  EXPECT_TRUE(refused({.beta2 = -0.1}, "beta2"));
  EXPECT_TRUE(refused({.eps = 0}, "eps is 0"));
  EXPECT_TRUE(refused({.weight_decay = -0.5}, "weight_decay"));
  EXPECT_NO_THROW(check_adam_hyper(AdamHyper{}, "LAMB"));
  EXPECT_NO_THROW(check_adam_hyper({.beta1 = 0, .beta2 = 0, .weight_decay = 0}, "LAMB"));
  Layer layer(4);
  EXPECT_THROW(lamb_step(layer.slot(), 1, {.eps = -1}), SpecError);
}

}  // namespace
}  // namespace gradcomp
