// Engine::set_plan in one process (a real Gloo transport of one rank): what the old routes held
// reaches the next mean, a step taken back hands it over again, a checkpoint keeps it, and bad
// plan changes are errors that leave the engine as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "gradcomp/engine.h"
#include "gradcomp/error.h"
#include "gradcomp/frame.h"
#include "engine_testing.h"
#include "support/single_rank.h"

namespace gradcomp {
namespace {

using testing::error_text;

using engine_testing::small_plan;
using engine_testing::step;

const Option kTopk{.codec = "topk:ratio=0.1", .feedback = "ef", .route = "allgather"};

// With one rank top-k sends part of g and keeps the rest (g - sent) as its residual: after a
// change to the uncompressed plan, that rest arrives with the next gradient, exactly.
TEST(PlanChange, TheResidualArrivesWithTheNextGradient) {
  Engine engine(testing::single_rank_transport(), small_plan(kTopk));
  const auto g1 = testing::gradient(1000, 1);
  const auto sent = step(engine, g1);
  engine.set_plan(small_plan());
  EXPECT_GT(engine.memory_bytes(), 0u);  // the carried residual
  const auto g2 = testing::gradient(1000, 2);
  const auto got = step(engine, g2);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], g2[i] + (g1[i] - sent[i])) << i;
  }
  // Delivered once: the step after gives its own gradient only.
  const auto g3 = testing::gradient(1000, 3);
  EXPECT_EQ(step(engine, g3), g3);
  EXPECT_EQ(engine.step(), 3u);
}

// w cut into 4 slices in buckets of their own (two of them together), with `option`.
Plan sliced_small_plan(const Option& option) {
  Plan plan = small_plan();
  plan.tensors[0].slices = 4;  // w: pieces 0-3; b: 4
  plan.buckets = {{{1, 0}, option}, {{3}, option}, {{2}, option}, {{4}, Option{}}};
  return plan;
}

// What top-k keeps per slice goes back to its place in the tensor: after a change to the
// uncompressed plan, and from whole tensors into slices.
TEST(PlanChange, TheResidualOfASliceArrivesWithItsTensor) {
  Engine engine(testing::single_rank_transport(), sliced_small_plan(kTopk));
  const auto g1 = testing::gradient(1000, 11);
  const auto sent = step(engine, g1);
  EXPECT_NE(sent, g1);
  engine.set_plan(small_plan(kTopk));
  const auto g2 = testing::gradient(1000, 12);
  const auto sent2 = step(engine, g2);  // g2 + the slices' residual, compressed whole
  engine.set_plan(sliced_small_plan({}));
  const auto g3 = testing::gradient(1000, 13);
  const auto got = step(engine, g3);
  for (size_t i = 0; i < got.size(); ++i) {
    const float held = (g2[i] + (g1[i] - sent[i])) - sent2[i];
    ASSERT_EQ(got[i], g3[i] + held) << i;
  }
  EXPECT_EQ(step(engine, g1), g1);  // delivered once
}

// A non-finite step (a loss scaler skips it) does not use the carried memory up; the loss scale
// it was kept in is brought to the next step's.
TEST(PlanChange, AStepTakenBackHandsTheCarriedMemoryOverAgain) {
  Engine engine(testing::single_rank_transport(), small_plan(kTopk));
  const auto g1 = testing::gradient(1000, 4);
  std::vector<float> g1_scaled(g1);
  for (float& x : g1_scaled) x *= 1024;
  const auto sent = step(engine, g1_scaled, 1024);
  engine.set_plan(small_plan());
  auto bad = testing::gradient(1000, 5);
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  step(engine, bad, 512);
  EXPECT_FALSE(engine.last_step().finite);
  const auto g3 = testing::gradient(1000, 6);
  std::vector<float> g3_scaled(g3);
  for (float& x : g3_scaled) x *= 256;
  const auto got = step(engine, g3_scaled, 256);
  EXPECT_TRUE(engine.last_step().finite);
  for (size_t i = 0; i < got.size(); ++i) {
    const double expected = g3[i] + (double{g1_scaled[i]} - sent[i]) / 1024;
    ASSERT_NEAR(got[i] / 256, expected, 1e-5 * (1 + std::fabs(expected))) << i;
  }
}

// A checkpoint taken right after a plan change holds the carried memory: an engine built with
// the new plan and loaded from it gives the same next step, bit for bit.
TEST(PlanChange, ACheckpointKeepsTheCarriedMemory) {
  Engine engine(testing::single_rank_transport(), small_plan(kTopk));
  step(engine, testing::gradient(1000, 7));
  const Plan next = small_plan({.codec = "fp16", .feedback = "ef"});
  engine.set_plan(next);
  const auto state = engine.save_state();
  Engine resumed(testing::single_rank_transport(), next);
  resumed.load_state(state);
  EXPECT_EQ(resumed.save_state(), state);
  EXPECT_EQ(step(resumed, testing::gradient(1000, 8)), step(engine, testing::gradient(1000, 8)));
  // A state that claims to carry a tensor the plan does not have is refused.
  Engine other(testing::single_rank_transport(), next);
  auto bad = state;
  const size_t at = bad.size() - 4 - 4000 - 8 - 8 - 8;  // the carried entry's tensor index
  bad[at] = std::byte{9};
  const uint32_t crc = crc32(std::span(bad).first(bad.size() - 4));
  std::memcpy(bad.data() + bad.size() - 4, &crc, 4);
  EXPECT_NE(error_text([&] { other.load_state(bad); }).find("not a tensor of the plan"),
            std::string::npos);
}

// A trial plan without feedback (compression="auto"'s uncompressed trial) leaves the residual
// waiting instead of handing it over at once; the plan kept after it, here the same plan no
// longer a trial, delivers it with the next gradient, once.
TEST(PlanChange, ATrialWithoutFeedbackHoldsTheResidualUntilThePlanIsKept) {
  Engine engine(testing::single_rank_transport(), small_plan(kTopk));
  const auto g1 = testing::gradient(1000, 21);
  const auto sent = step(engine, g1);
  engine.set_plan(small_plan(), /*trial=*/true);
  const auto g2 = testing::gradient(1000, 22);
  EXPECT_EQ(step(engine, g2), g2);
  const auto g3 = testing::gradient(1000, 23);
  EXPECT_EQ(step(engine, g3), g3);
  EXPECT_GT(engine.memory_bytes(), Engine(testing::single_rank_transport(), small_plan())
                                       .memory_bytes());  // still held
  engine.set_plan(small_plan());  // the same plan, kept
  const auto g4 = testing::gradient(1000, 24);
  const auto got = step(engine, g4);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], g4[i] + (g1[i] - sent[i])) << i;
  EXPECT_EQ(step(engine, g1), g1);  // delivered once
}

// A trial plan whose buckets have feedback takes the residual into that feedback's memory,
// exactly as a plan change that is not a trial; memory an earlier trial held back, too, in the
// loss scale of the step that takes it.
TEST(PlanChange, ATrialWithFeedbackTakesTheResidualAsAnyChange) {
  const Option half{.codec = "topk:ratio=0.5", .feedback = "ef", .route = "allgather"};
  std::vector<std::vector<float>> means[2];
  for (bool trial : {false, true}) {
    Engine engine(testing::single_rank_transport(), small_plan(kTopk));
    auto& got = means[trial ? 1 : 0];
    std::vector<float> g1 = testing::gradient(1000, 31);
    for (float& x : g1) x *= 1024;
    step(engine, g1, 1024);
    if (trial) {  // held through an uncompressed trial first, in another loss scale
      engine.set_plan(small_plan(), true);
      std::vector<float> g2 = testing::gradient(1000, 32);
      for (float& x : g2) x *= 512;
      got.push_back(step(engine, g2, 512));
    }
    engine.set_plan(small_plan(half), trial);
    std::vector<float> g3 = testing::gradient(1000, 33);
    for (float& x : g3) x *= 256;
    got.push_back(step(engine, g3, 256));
    engine.set_plan(small_plan());  // kept: what top-k holds arrives
    got.push_back(step(engine, testing::gradient(1000, 34)));
  }
  const auto plain = testing::gradient(1000, 32);
  for (size_t i = 0; i < plain.size(); ++i) ASSERT_EQ(means[1][0][i], plain[i] * 512) << i;
  // From the change to top-k 50% on, the trial run gives what the plain changes give (the
  // scales are powers of two: the same bits).
  for (size_t s = 0; s < 2; ++s) EXPECT_EQ(means[1][s + 1], means[0][s]) << "step " << s;
}

// Memory held back through a trial meets, at the next change, what the trial's feedback kept
// for another slice of the same tensor: the held part is first brought to the loss scale of the
// newer (the scales are powers of two, so the expected bits are exact).
TEST(PlanChange, HeldMemoryMeetingALaterResidualIsBroughtToItsLossScale) {
  const Option half{.codec = "topk:ratio=0.5", .feedback = "ef", .route = "allgather"};
  Plan mixed = small_plan();
  mixed.tensors[0].slices = 2;  // w: pieces 0 (uncompressed: w is held) and 1 (top-k); b: 2
  mixed.buckets = {{{0}, Option{}}, {{1}, half}, {{2}, Option{}}};
  Engine engine(testing::single_rank_transport(), small_plan(kTopk));
  const auto scaled = [](uint64_t seed, float scale) {
    std::vector<float> g = testing::gradient(1000, seed);
    for (float& x : g) x *= scale;
    return g;
  };
  const auto g1 = scaled(41, 1024);
  const auto sent1 = step(engine, g1, 1024);
  engine.set_plan(mixed, /*trial=*/true);
  const auto g2 = scaled(42, 512);
  const auto sent2 = step(engine, g2, 512);
  for (size_t i = 0; i < 500; ++i) ASSERT_EQ(sent2[i], g2[i]) << i;  // nothing added: held
  engine.set_plan(small_plan());  // kept: top-k's residual joins the held memory
  const auto g3 = scaled(43, 256);
  const auto got = step(engine, g3, 256);
  for (size_t i = 0; i < got.size(); ++i) {
    const float held = (g1[i] - sent1[i]) * 0.5f + (i < 500 ? 0.0f : g2[i] - sent2[i]);
    ASSERT_EQ(got[i], std::fma(0.5f, held, g3[i])) << i;
  }
}

TEST(PlanChange, BadChangesAreErrorsAndChangeNothing) {
  Engine engine(testing::single_rank_transport(), small_plan(kTopk));
  step(engine, testing::gradient(1000, 9));
  const auto state = engine.save_state();
  DefaultPlanSettings settings;
  const Plan others = make_default_plan({{"w", 1000}, {"c", 10}}, settings);
  EXPECT_NE(error_text([&] { engine.set_plan(others); }).find("tensor 1 is 'c'"),
            std::string::npos);
  const Plan fewer = make_default_plan({{"w", 1000}}, settings);
  EXPECT_NE(error_text([&] { engine.set_plan(fewer); }).find("registers 1 tensors"),
            std::string::npos);
  Plan invalid = small_plan();
  invalid.buckets.pop_back();
  EXPECT_NE(error_text([&] { engine.set_plan(invalid); }), "no error");
  std::vector<float> w(1000, 1.0f);
  engine.ready("w", w);
  EXPECT_NE(error_text([&] { engine.set_plan(small_plan()); }).find("a step is in flight"),
            std::string::npos);
  std::vector<float> b(10, 1.0f);
  engine.ready("b", b);
  engine.synchronize();
  // Still the top-k plan, and it steps on.
  EXPECT_EQ(engine.plan().buckets.size(), small_plan(kTopk).buckets.size());
  EXPECT_EQ(engine.plan().hash(), small_plan(kTopk).hash());
  EXPECT_NO_THROW(step(engine, testing::gradient(1000, 10)));
}

}  // namespace
}  // namespace gradcomp
