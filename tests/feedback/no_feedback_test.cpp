// none: the gradient passes through untouched, no residual, no state.
#include <gtest/gtest.h>

#include "feedback/feedback_testing.h"

namespace gradcomp {
namespace {

TEST(NoFeedback, PassesTheGradientThrough) {
  auto fb = make_feedback("none");
  EXPECT_EQ(fb->spec(), "none");
  const auto g = testing::gradient(100, 1);
  const auto p = fb->compensate(g, {});
  EXPECT_EQ(p.data(), g.data());  // no copy
  EXPECT_EQ(p.size(), g.size());
  EXPECT_TRUE(fb->residual().empty());
  fb->commit();
  // Any length, any time: there is no memory to size.
  EXPECT_EQ(fb->compensate(testing::gradient(7, 2), {}).size(), 7u);
}

TEST(NoFeedback, KeepsNoState) {
  auto fb = make_feedback("none");
  EXPECT_TRUE(fb->save_state().empty());
  fb->load_state({});
  const std::vector<std::byte> junk(4);
  try {
    fb->load_state(junk);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("feedback 'none'"), std::string::npos) << e.what();
  }
}

TEST(NoFeedback, TakesNoParameters) {
  EXPECT_NE(testing::feedback_spec_error("none:decay=1")
                .find("feedback 'none': unknown parameter 'decay'"),
            std::string::npos);
}

TEST(NoFeedback, WorksAroundACodecWithoutResidual) {
  auto fb = make_feedback("none");
  auto codec = make_codec("intq:bits=8");
  const auto g = testing::gradient(1000, 3);
  const auto p = fb->compensate(g, {});
  const auto frame = testing::encode_all_rounds(*codec, p, Context{}, fb->residual());
  const auto d = testing::decode(*codec, frame, g.size());
  for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(d[i], g[i], 0.05f) << i;
}

}  // namespace
}  // namespace gradcomp
