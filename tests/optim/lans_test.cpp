#include <gtest/gtest.h>

#include <cmath>

#include "common/parallel.h"
#include "gradcomp/error.h"
#include "optim/optim_testing.h"

namespace gradcomp {
namespace {

using testing::Layer;
using testing::Reference;
using testing::relative_gap;

TEST(Lans, FollowsThePapersUpdateOverManySteps) {
  for (const bool normalize : {true, false}) {
    Layer layer(1500);
    layer.fill_param(1, 0.05f);
    Reference reference(layer);
    AdamHyper h;
    h.lr = 0.01;
    for (int64_t t = 1; t <= 20; ++t) {
      layer.fill_grad(200 + static_cast<uint32_t>(t));
      lans_step(layer.slot(), t, h, normalize);
      reference.step(layer.grad, t, h, /*lans=*/true, normalize);
    }
    EXPECT_LT(relative_gap(layer.param, reference.param), 1e-5) << normalize;
    EXPECT_LT(relative_gap(layer.exp_avg, reference.exp_avg), 1e-5);
    EXPECT_LT(relative_gap(layer.exp_avg_sq, reference.exp_avg_sq), 1e-5);
  }
}

TEST(Lans, NormalisedGradientsMakeTheStepIndependentOfTheirScale) {
  // A codec that scales a layer's gradient (a 1-bit code's scale, a top-k's lost mass) leaves
  // the moments and the step alone: g / ||g|| is the same.
  Layer small(3000), large(3000);
  small.fill_param(2);
  large.fill_param(2);
  AdamHyper h;
  for (int64_t t = 1; t <= 5; ++t) {
    small.fill_grad(10 + static_cast<uint32_t>(t), 1e-4f);
    large.fill_grad(10 + static_cast<uint32_t>(t), 1e-4f);
    for (float& g : large.grad) g *= 4096.0f;  // a power of two: g / ||g|| is unchanged exactly
    lans_step(small.slot(), t, h);
    lans_step(large.slot(), t, h);
  }
  EXPECT_EQ(small.param, large.param);
  EXPECT_EQ(small.exp_avg_sq, large.exp_avg_sq);
}

TEST(Lans, BlendsTwoDirectionsEachWithItsOwnTrustRatio) {
  Layer layer(2048);
  layer.fill_param(3, 0.2f);
  layer.fill_grad(4);
  AdamHyper h;
  h.lr = 0.05;
  h.beta1 = 0.8;
  const std::vector<float> before = layer.param;
  const LayerStep s = lans_step(layer.slot(), 1, h);
  // At step 1, m^ = g' so r = c: both ratios are equal and the step is lr * ratio * r, whose
  // norm is lr * ||x||.
  EXPECT_NEAR(s.trust_ratio, s.grad_trust, 1e-6 * s.trust_ratio);
  double moved = 0;
  for (size_t i = 0; i < before.size(); ++i) moved += std::pow(double(layer.param[i]) - before[i], 2);
  EXPECT_NEAR(std::sqrt(moved), h.lr * s.param_norm, 1e-4 * h.lr * s.param_norm);
  // Later the two directions differ, and so do their ratios.
  layer.fill_grad(5);
  const LayerStep later = lans_step(layer.slot(), 2, h);
  EXPECT_GT(std::abs(later.trust_ratio - later.grad_trust), 1e-3 * later.trust_ratio);
}

TEST(Lans, AnAllZeroGradientStaysZeroAndOnlyWeightDecayMoves) {
  Layer layer(256);
  layer.fill_param(6);
  AdamHyper h;
  h.weight_decay = 0.1;
  const std::vector<float> before = layer.param;
  lans_step(layer.slot(), 1, h);
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(layer.exp_avg[i], 0.0f);
    // r = c = wd x, trust ratio 1 / wd: x shrinks by lr * ||x|| along x.
    EXPECT_NEAR(layer.param[i], before[i] * (1 - h.lr), 1e-6);
  }
}

TEST(Lans, GivesTheSameBytesOnAnyThreadCount) {
  const size_t n = 2 * kChunk + 5;
  Layer one(n), three(n);
  one.fill_param(7);
  three.fill_param(7);
  for (int64_t t = 1; t <= 3; ++t) {
    one.fill_grad(20 + static_cast<uint32_t>(t));
    three.fill_grad(20 + static_cast<uint32_t>(t));
    lans_step(one.slot(), t, AdamHyper{}, true, 1);
    lans_step(three.slot(), t, AdamHyper{}, true, 3);
  }
  EXPECT_EQ(one.param, three.param);
  EXPECT_EQ(one.exp_avg, three.exp_avg);
}

TEST(Lans, RefusesBadInputByName) {
  Layer layer(8);
  LayerSlot slot = layer.slot();
  slot.grad = slot.grad.first(7);
  EXPECT_THROW(lans_step(slot, 1, AdamHyper{}), Error);
  try {
    lans_step(layer.slot(), 1, {.beta2 = 1.5});
    ADD_FAILURE() << "beta2 = 1.5 was accepted";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("LANS: beta2 is 1.5"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gradcomp
