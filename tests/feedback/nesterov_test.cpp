// nesterov: m = mu m + g, p = g + mu m (BytePS), optionally with error feedback on top;
// checked against the formulas step by step; state, length checks and spec errors.
#include <gtest/gtest.h>

#include <cmath>

#include "feedback/feedback_testing.h"

namespace gradcomp {
namespace {

using testing::gradient;

void check_nesterov_formula(const std::string& spec, float mu, bool ef) {
  SCOPED_TRACE(spec);
  auto fb = make_feedback(spec);
  const size_t n = 300;
  std::vector<float> m(n, 0.0f), e(n, 0.0f);
  for (uint64_t t = 0; t < 6; ++t) {
    const auto g = gradient(n, 70 + t);
    const auto p = fb->compensate(g, {.step = t});
    for (size_t i = 0; i < n; ++i) {
      m[i] = std::fma(mu, m[i], g[i]);
      const float want = ef ? std::fma(mu, m[i], g[i]) + e[i] : std::fma(mu, m[i], g[i]);
      ASSERT_EQ(p[i], want) << "step " << t << " element " << i;
    }
    if (ef) {
      ASSERT_EQ(fb->residual().data(), p.data());  // the new e is written over p
      testing::sparsify_into_residual(p, fb->residual(), 1.0f);
      e.assign(fb->residual().begin(), fb->residual().end());
    } else {
      ASSERT_TRUE(fb->residual().empty());
    }
    fb->commit();
  }
}

TEST(NesterovFeedback, MatchesTheFormulas) {
  check_nesterov_formula("nesterov", 0.9f, false);
  check_nesterov_formula("nesterov:momentum=0.5", 0.5f, false);
  check_nesterov_formula("nesterov:momentum=0", 0.0f, false);
  check_nesterov_formula("nesterov:ef=true", 0.9f, true);
  check_nesterov_formula("nesterov:momentum=0.99,ef=true", 0.99f, true);
}

TEST(NesterovFeedback, FirstStepsByHand) {
  auto fb = make_feedback("nesterov:momentum=0.5");
  const std::vector<float> g = {2.0f};
  EXPECT_EQ(fb->compensate(g, {})[0], 3.0f);  // m = 2, p = 2 + 0.5 * 2
  EXPECT_EQ(fb->compensate(g, {})[0], 3.5f);  // m = 3, p = 2 + 0.5 * 3
}

TEST(NesterovFeedback, StateRoundTripContinuesBitExactly) {
  for (const std::string spec : {"nesterov:momentum=0.7", "nesterov:momentum=0.7,ef=true"}) {
    const bool ef = spec.find("ef=true") != std::string::npos;
    const size_t n = 400;
    auto a = make_feedback(spec);
    for (uint64_t t = 0; t < 3; ++t) {
      const auto p = a->compensate(gradient(n, t), {});
      if (ef) testing::sparsify_into_residual(p, a->residual(), 1.0f);
    }
    const auto state = a->save_state();
    EXPECT_EQ(state.size(), 22 + (ef ? 2 : 1) * 4 * n) << spec;
    auto b = make_feedback(spec);
    b->load_state(state);
    for (uint64_t t = 3; t < 5; ++t) {
      const auto g = gradient(n, t);
      const auto pa = a->compensate(g, {});
      const auto pb = b->compensate(g, {});
      ASSERT_TRUE(std::equal(pa.begin(), pa.end(), pb.begin(), pb.end())) << spec << " " << t;
      if (ef) {
        testing::sparsify_into_residual(pa, a->residual(), 1.0f);
        testing::sparsify_into_residual(pb, b->residual(), 1.0f);
      }
    }
    EXPECT_EQ(a->save_state(), b->save_state()) << spec;
  }
  // A state with the error buffer does not fit a configuration without it, and back.
  auto with_ef = make_feedback("nesterov:ef=true");
  with_ef->compensate(gradient(10, 1), {});
  try {
    make_feedback("nesterov")->load_state(with_ef->save_state());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 arrays, this configuration keeps 1"), std::string::npos)
        << e.what();
  }
}

TEST(NesterovFeedback, GradientLengthMustNotChange) {
  auto fb = make_feedback("nesterov");
  fb->compensate(gradient(10, 1), {});
  EXPECT_THROW(fb->compensate(gradient(9, 1), {}), Error);
}

TEST(NesterovFeedback, SpecsAreCanonicalAndCheckedTheirRanges) {
  EXPECT_EQ(make_feedback("nesterov")->spec(), "nesterov:momentum=0.9,ef=false");
  EXPECT_EQ(make_feedback("nesterov:ef=1,momentum=0.5")->spec(), "nesterov:momentum=0.5,ef=true");
  EXPECT_EQ(testing::feedback_spec_error("nesterov:momentum=-0.1"),
            "feedback 'nesterov': parameter 'momentum' = -0.1 is out of range; allowed: [0, 1)");
  EXPECT_NE(testing::feedback_spec_error("nesterov:mu=0.9").find("unknown parameter 'mu'"),
            std::string::npos);
}

}  // namespace
}  // namespace gradcomp
