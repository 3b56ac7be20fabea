// dgc: momentum correction, local clipping and momentum-factor masking against a
// straightforward reference, step by step; state, length checks and spec errors.
#include <gtest/gtest.h>

#include <cmath>

#include "feedback/feedback_testing.h"

namespace gradcomp {
namespace {

using testing::gradient;

// The DGC memory written out plainly, one element at a time.
struct ReferenceDgc {
  float momentum;
  double clip;
  bool nesterov;
  std::vector<float> u, v;
  bool masking = true;

  std::vector<float> compensate(const std::vector<float>& g, uint32_t world) {
    if (u.empty()) u.assign(g.size(), 0.0f), v.assign(g.size(), 0.0f);
    float factor = 1.0f;
    if (clip > 0) {
      double norm2 = 0;
      for (float x : g) norm2 += double{x} * x;
      const double threshold = clip / std::sqrt(double(world));
      if (std::sqrt(norm2) > threshold) factor = static_cast<float>(threshold / std::sqrt(norm2));
    }
    for (size_t i = 0; i < g.size(); ++i) {
      const float gi = g[i] * factor;
      if (nesterov) {
        u[i] = (u[i] + gi) * momentum;
        v[i] = (v[i] + u[i]) + gi;
      } else {
        u[i] = std::fma(momentum, u[i], gi);
        v[i] = v[i] + u[i];
      }
    }
    return v;
  }
  // The codec left `residual`; where it sent something the momentum is masked.
  void commit(const std::vector<float>& residual) {
    for (size_t i = 0; i < u.size(); ++i) {
      if (masking && residual[i] != v[i]) u[i] = 0.0f;
    }
    v = residual;
  }
};

// Runs the feedback and the reference side by side with a stand-in sparsifier.
void compare(const std::string& spec, ReferenceDgc ref, uint32_t world, float grad_scale,
             bool exact) {
  SCOPED_TRACE(spec);
  auto fb = make_feedback(spec);
  const size_t n = 1000;
  for (uint64_t t = 0; t < 8; ++t) {
    const auto g = gradient(n, 300 + t, grad_scale);
    const auto p = fb->compensate(g, {.step = t, .world_size = world});
    const auto want = ref.compensate(g, world);
    for (size_t i = 0; i < n; ++i) {
      if (exact) {
        ASSERT_EQ(p[i], want[i]) << "step " << t << " element " << i;
      } else {
        ASSERT_NEAR(p[i], want[i], 1e-5f * (1 + std::fabs(want[i])))
            << "step " << t << " element " << i;
      }
    }
    const auto r = fb->residual();
    ASSERT_EQ(r.size(), n);
    ASSERT_NE(r.data(), p.data());  // a separate buffer
    testing::sparsify_into_residual(p, r, 1.5f * grad_scale);
    fb->commit();
    std::vector<float> ref_residual(n);  // the same stand-in codec on the reference's own v
    testing::sparsify_into_residual(ref.v, ref_residual, 1.5f * grad_scale);
    ref.commit(ref_residual);
  }
}

TEST(DgcFeedback, MomentumCorrectionAndMaskingMatchTheReference) {
  compare("dgc", {0.9f, 0, false, {}, {}}, 1, 1.0f, true);
  compare("dgc:momentum=0.5", {0.5f, 0, false, {}, {}}, 4, 1.0f, true);
  compare("dgc:nesterov=true", {0.9f, 0, true, {}, {}}, 1, 1.0f, true);
  compare("dgc:momentum=0", {0.0f, 0, false, {}, {}}, 1, 1.0f, true);
}

TEST(DgcFeedback, WithoutMaskingTheMomentumSurvivesWhereSent) {
  compare("dgc:masking=false", {0.9f, 0, false, {}, {}, false}, 1, 1.0f, true);
  compare("dgc:masking=false,nesterov=true", {0.9f, 0, true, {}, {}, false}, 1, 1.0f, true);
  // It differs from the masked run (the stand-in codec sends something every step).
  auto masked = make_feedback("dgc");
  auto kept = make_feedback("dgc:masking=false");
  const auto g = gradient(1000, 7);
  for (auto* fb : {masked.get(), kept.get()}) {
    const auto v = fb->compensate(g, {});
    const std::vector<float> sent(v.begin(), v.end());
    testing::sparsify_into_residual(sent, fb->residual(), 1.5f);
    fb->commit();
  }
  const auto a = masked->compensate(g, {.step = 1});
  const auto b = kept->compensate(g, {.step = 1});
  EXPECT_NE(std::vector<float>(a.begin(), a.end()), std::vector<float>(b.begin(), b.end()));
}

TEST(DgcFeedback, LocalClippingMatchesTheReference) {
  // ||g|| of 1000 N(0, 1) values is ~31.6: clip=20 at W=4 clips to 10, clip=100 at W=1 never.
  compare("dgc:clip=20", {0.9f, 20, false, {}, {}}, 4, 1.0f, false);
  compare("dgc:clip=20,nesterov=true", {0.9f, 20, true, {}, {}}, 4, 1.0f, false);
  compare("dgc:clip=100", {0.9f, 100, false, {}, {}}, 1, 1.0f, true);
}

TEST(DgcFeedback, ClippingThresholdScalesWithTheWorld) {
  for (uint32_t world : {1u, 4u, 16u}) {
    auto fb = make_feedback("dgc:clip=2");
    const auto g = gradient(500, 1);
    const auto v = fb->compensate(g, {.world_size = world});  // first step: v = u = clipped g
    double norm2 = 0;
    for (float x : v) norm2 += double{x} * x;
    EXPECT_NEAR(std::sqrt(norm2), 2.0 / std::sqrt(double(world)), 1e-5) << world;
  }
  // A non-finite gradient is not clipped to zero: the NaN flows through.
  auto fb = make_feedback("dgc:clip=1");
  auto g = gradient(10, 1);
  g[3] = std::numeric_limits<float>::quiet_NaN();
  const auto v = fb->compensate(g, {});
  EXPECT_TRUE(std::isnan(v[3]));
  EXPECT_EQ(v[0], g[0]);
}

TEST(DgcFeedback, MaskingZeroesMomentumWhereSent) {
  // Element 0 is sent (residual 0), element 1 is kept: only element 1 keeps its momentum.
  auto fb = make_feedback("dgc:momentum=0.5");
  const std::vector<float> g = {4.0f, 1.0f};
  auto v = fb->compensate(g, {});
  fb->residual()[0] = 0.0f;
  fb->residual()[1] = v[1];
  fb->commit();
  v = fb->compensate(g, {});
  EXPECT_EQ(v[0], 0.0f + 4.0f);           // u = 0.5 * 0 + 4, v = 0 + u
  EXPECT_EQ(v[1], 1.0f + (0.5f + 1.0f));  // u = 0.5 * 1 + 1, v = 1 + u
}

TEST(DgcFeedback, CommitNeedsACompensate) {
  auto fb = make_feedback("dgc");
  EXPECT_THROW(fb->commit(), Error);
  fb->compensate(gradient(4, 1), {});
  fb->commit();
  EXPECT_THROW(fb->commit(), Error);
}

TEST(DgcFeedback, StateRoundTripContinuesBitExactly) {
  const size_t n = 700;
  auto a = make_feedback("dgc:momentum=0.8,clip=5,nesterov=true");
  for (uint64_t t = 0; t < 3; ++t) {
    const auto p = a->compensate(gradient(n, t), {.world_size = 2});
    testing::sparsify_into_residual(p, a->residual(), 1.0f);
    a->commit();
  }
  const auto state = a->save_state();
  EXPECT_EQ(state.size(), 22 + 2 * 4 * n);  // u and v
  auto b = make_feedback("dgc:momentum=0.8,clip=5,nesterov=true");
  b->load_state(state);
  EXPECT_EQ(b->save_state(), state);
  for (uint64_t t = 3; t < 6; ++t) {
    const auto g = gradient(n, t);
    const auto pa = a->compensate(g, {.world_size = 2});
    const auto pb = b->compensate(g, {.world_size = 2});
    ASSERT_TRUE(std::equal(pa.begin(), pa.end(), pb.begin(), pb.end())) << t;
    testing::sparsify_into_residual(pa, a->residual(), 1.0f);
    testing::sparsify_into_residual(pb, b->residual(), 1.0f);
    a->commit();
    b->commit();
  }
  EXPECT_EQ(a->save_state(), b->save_state());
  EXPECT_THROW(b->load_state(std::span(state).first(state.size() - 1)), Error);
  EXPECT_THROW(make_feedback("ef")->load_state(state), Error);
}

TEST(DgcFeedback, GradientLengthMustNotChange) {
  auto fb = make_feedback("dgc");
  fb->compensate(gradient(10, 1), {});
  EXPECT_THROW(fb->compensate(gradient(11, 1), {}), Error);
}

TEST(DgcFeedback, SpecsAreCanonicalAndCheckedTheirRanges) {
  EXPECT_EQ(make_feedback("dgc")->spec(), "dgc:momentum=0.9,clip=0,nesterov=false");
  EXPECT_EQ(make_feedback("dgc:masking=false")->spec(),
            "dgc:momentum=0.9,clip=0,nesterov=false,masking=false");
  EXPECT_EQ(make_feedback("dgc:clip=0.5,nesterov=true,momentum=0.95")->spec(),
            "dgc:momentum=0.95,clip=0.5,nesterov=true");
  EXPECT_EQ(testing::feedback_spec_error("dgc:momentum=1"),
            "feedback 'dgc': parameter 'momentum' = 1 is out of range; allowed: [0, 1)");
  EXPECT_EQ(testing::feedback_spec_error("dgc:clip=-1"),
            "feedback 'dgc': parameter 'clip' = -1 is out of range; allowed: >= 0");
  EXPECT_NE(testing::feedback_spec_error("dgc:ratio=0.1").find("unknown parameter 'ratio'"),
            std::string::npos);
}

}  // namespace
}  // namespace gradcomp
