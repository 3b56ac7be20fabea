// Feedback::discard and Codec::discard (a step whose aggregate was not finite): every feedback
// kind and every stateful codec goes back to its state before the step bit for bit, including
// a discarded first step, and the next clean step gives the bytes of a run that never saw the
// bad step. The loss-scale correction keeps the memory in the units of the current gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "feedback/feedback_testing.h"

namespace gradcomp {
namespace {

using testing::gradient;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A feedback and a codec of one bucket, stepped as a route of one rank steps them (every round,
// the last one absorbed too: PowerSGD keeps the reduced Q there).
struct Bucket {
  std::unique_ptr<Feedback> fb;
  std::unique_ptr<Codec> codec;

  Bucket(const std::string& feedback, const std::string& codec_spec)
      : fb(make_feedback(feedback)), codec(make_codec(codec_spec)) {}

  // One step: the frame it sends.
  std::vector<std::byte> step(const std::vector<float>& g, uint64_t t, const StepInfo& info) {
    const Context ctx{.seed = 5, .bucket = 2, .step = t};
    const auto x = fb->compensate(g, info);
    auto frame = testing::encode_all_rounds(*codec, x, ctx, fb->residual());
    fb->commit();
    const int last = codec->traits().rounds - 1;
    if (last > 0) codec->absorb_round(last, frame, ctx);
    return frame;
  }
  std::vector<std::byte> step(const std::vector<float>& g, uint64_t t) {
    return step(g, t, {.step = t, .lr = 0.1, .prev_lr = 0.1});
  }
  void discard() {
    fb->discard();
    codec->discard();
  }
  std::pair<std::vector<std::byte>, std::vector<std::byte>> state() const {
    return {fb->save_state(), codec->save_state()};
  }
};

std::vector<float> poisoned(size_t n, uint64_t seed, float bad) {
  auto g = gradient(n, seed);
  g[3] = bad;
  g[n / 2] = -bad;
  return g;
}

struct Case {
  std::string feedback, codec;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.feedback << " / " << c.codec; }

class Discard : public ::testing::TestWithParam<Case> {};

// Steps 0, 1 (NaN or Inf, discarded), 2, 3 against steps 0, 2, 3 of a run without step 1.
TEST_P(Discard, RestoresTheStateAndLaterStepsAreAsIfTheStepNeverHappened) {
  const size_t n = 1031;
  for (const float bad : {kNaN, kInf}) {
    SCOPED_TRACE(bad);
    Bucket a(GetParam().feedback, GetParam().codec), b(GetParam().feedback, GetParam().codec);
    a.step(gradient(n, 10), 0);
    b.step(gradient(n, 10), 0);
    const auto before = a.state();
    a.step(poisoned(n, 11, bad), 1);
    a.discard();
    EXPECT_EQ(a.state(), before) << "the state after discard differs from the one before the step";
    for (uint64_t t = 2; t < 4; ++t) {
      const auto g = gradient(n, 10 + t);
      EXPECT_EQ(a.step(g, t), b.step(g, t)) << "frame of step " << t;
      EXPECT_EQ(a.state(), b.state()) << "state after step " << t;
    }
  }
}

// A discarded first step leaves the never-stepped state (unsized memory, no codec state).
TEST_P(Discard, OfTheFirstStepLeavesTheInitialState) {
  const size_t n = 517;
  Bucket a(GetParam().feedback, GetParam().codec), b(GetParam().feedback, GetParam().codec);
  const auto initial = a.state();
  a.step(poisoned(n, 20, kNaN), 0);
  a.discard();
  EXPECT_EQ(a.state(), initial);
  const auto g = gradient(n, 21);
  EXPECT_EQ(a.step(g, 1), b.step(g, 1));
  EXPECT_EQ(a.state(), b.state());
}

// A state loaded from a checkpoint is not a step to take back; neither is a discarded one.
TEST_P(Discard, WithoutAStepIsAClearError) {
  Bucket a(GetParam().feedback, GetParam().codec);
  const bool fb_memory = a.fb->has_memory();
  if (fb_memory) {
    EXPECT_THROW(a.fb->discard(), Error);
  }
  a.step(gradient(64, 1), 0);
  a.discard();
  if (fb_memory) {
    EXPECT_TRUE(testing::contains(testing::error_text([&] { a.fb->discard(); }),
                                  "without a step to take back"));
  }
  if (a.codec->traits().stateful) {
    EXPECT_THROW(a.codec->discard(), Error);
  }
  a.step(gradient(64, 2), 1);
  Bucket loaded(GetParam().feedback, GetParam().codec);
  loaded.fb->load_state(a.fb->save_state());
  loaded.codec->load_state(a.codec->save_state());
  if (fb_memory) {
    EXPECT_THROW(loaded.fb->discard(), Error);
  }
  if (a.codec->traits().stateful) {
    EXPECT_THROW(loaded.codec->discard(), Error);
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* fb : {"ef", "ef:decay=0.5,lr_correction=true", "dgc", "dgc:nesterov=true,clip=1",
                         "nesterov", "nesterov:ef=true"}) {
    for (const char* c : {"topk:ratio=0.1", "qsgd", "fp16", "powersgd:rank=2", "signum"}) {
      v.push_back({fb, c});
    }
  }
  // Codec state alone: PowerSGD's warm start (and its fresh draw without it), Signum's momentum.
  for (const char* c : {"powersgd", "powersgd:warm_start=false", "signum", "intq"}) v.push_back({"none", c});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Kinds, Discard, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string s = info.param.feedback + "_" + info.param.codec;
  for (char& ch : s) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return s;
});

// The spare buffers of discard() are memory too: ef keeps e and its spare, dgc u, v, r and two
// spares, nesterov m and its spare plus p (and e's spare with ef).
TEST(Discard, MemoryBytesCountTheSpares) {
  const size_t n = 100;
  const std::vector<std::pair<std::string, size_t>> arrays = {
      {"none", 0}, {"ef", 2}, {"dgc", 5}, {"nesterov", 3}, {"nesterov:ef=true", 4}};
  for (const auto& [spec, count] : arrays) {
    auto fb = make_feedback(spec);
    fb->compensate(gradient(n, 1), {});
    EXPECT_EQ(fb->memory_bytes(), count * n * sizeof(float)) << spec;
  }
}

// Loss scaling: step t's gradient carries scale s_t. The memory, accumulated under s_{t-1}, is
// brought to s_t by the feedback, so the frames decode to s_t times those of an unscaled run
// (random-k sends exact values at indices that do not depend on them, so only the arithmetic
// rounds). Without the correction the memory would be off by s_t / s_{t-1}, far outside this.
TEST(LossScale, MemoryFollowsTheScaleAsIfItWereUnscaled) {
  const size_t n = 2000;
  const double scales[] = {1024, 1024, 512, 3000, 3000, 7.5, 65536};
  for (const char* spec : {"ef", "ef:lr_correction=true", "dgc", "dgc:clip=1,nesterov=true",
                           "nesterov", "nesterov:ef=true"}) {
    SCOPED_TRACE(spec);
    Bucket scaled(spec, "randomk:ratio=0.05"), plain(spec, "randomk:ratio=0.05");
    for (uint64_t t = 0; t < std::size(scales); ++t) {
      const double s = scales[t];
      const double prev = t == 0 ? 1.0 : scales[t - 1];
      const auto g = gradient(n, 40 + t);
      std::vector<float> gs(g);
      for (float& x : gs) x = static_cast<float>(x * s);
      const StepInfo base{.step = t, .lr = 0.1, .prev_lr = 0.1, .world_size = 4};
      StepInfo with_scale = base;
      with_scale.scale = s;
      with_scale.prev_scale = prev;
      const auto a = testing::decode(*scaled.codec, scaled.step(gs, t, with_scale), n,
                                     {.seed = 5, .bucket = 2, .step = t});
      const auto b = testing::decode(*plain.codec, plain.step(g, t, base), n,
                                     {.seed = 5, .bucket = 2, .step = t});
      float largest = 0;
      for (float x : b) largest = std::max(largest, std::fabs(x));
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(a[i] / s, b[i], 2e-6 * largest) << "step " << t << " element " << i;
      }
    }
  }
}

// Equal scales are exactly no correction: the same bits as the defaults.
TEST(LossScale, EqualScalesChangeNoBit) {
  for (const char* spec : {"ef", "dgc", "nesterov:ef=true"}) {
    Bucket a(spec, "topk:ratio=0.1"), b(spec, "topk:ratio=0.1");
    for (uint64_t t = 0; t < 3; ++t) {
      const auto g = gradient(300, 60 + t);
      StepInfo scaled{.step = t};
      scaled.scale = 256;
      scaled.prev_scale = 256;
      EXPECT_EQ(a.step(g, t, scaled), b.step(g, t, {.step = t})) << spec;
    }
  }
}

}  // namespace
}  // namespace gradcomp
