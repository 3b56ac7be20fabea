// ef: the invariant with real codecs, the decay and learning-rate-correction formulas, state
// round trip, length checks and spec errors. The invariant runs for the other kinds with a
// residual (dgc, nesterov:ef=true) too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "feedback/feedback_testing.h"

namespace gradcomp {
namespace {

using testing::gradient;

struct InvariantCase {
  std::string feedback, codec;
};
void PrintTo(const InvariantCase& c, std::ostream* os) { *os << c.feedback << " / " << c.codec; }

class ErrorFeedbackInvariant : public ::testing::TestWithParam<InvariantCase> {};

TEST_P(ErrorFeedbackInvariant, SentPlusResidualIsTheCompensatedVector) {
  auto codec = make_codec(GetParam().codec);
  auto fb = make_feedback(GetParam().feedback);
  const size_t n = 4099;
  for (uint64_t step = 0; step < 4; ++step) {
    const auto g = gradient(n, 50 + step, 0.01f);
    const Context ctx{.seed = 8, .step = step};
    testing::step_and_check_invariant(*fb, *codec, g,
                                      StepInfo{.step = step, .lr = 0.1, .prev_lr = 0.1}, ctx);
    if (HasFatalFailure()) return;
  }
}

std::vector<InvariantCase> invariant_cases() {
  std::vector<InvariantCase> v;
  for (const char* fb : {"ef", "ef:decay=0.5,lr_correction=true", "nesterov:ef=true", "dgc"}) {
    for (const char* c : {"none", "powersgd:rank=2", "intq:bits=8", "intq:bits=4",
                          "topk:ratio=0.01", "qsgd:levels=16"}) {
      v.push_back({fb, c});
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Codecs, ErrorFeedbackInvariant, ::testing::ValuesIn(invariant_cases()),
                         [](const auto& info) {
                           std::string s = info.param.feedback + "_" + info.param.codec;
                           for (char& ch : s)
                             ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return s;
                         });

// p_t = g_t + alpha_t e_{t-1} with alpha_t = decay * (prev_lr / lr when corrected), checked
// step by step against the formula, with a stand-in codec that keeps |p| <= 0.5.
void check_feedback_formula(const std::string& spec, double decay, bool corrected) {
  SCOPED_TRACE(spec);
  auto fb = make_feedback(spec);
  const size_t n = 257;
  std::vector<float> e(n, 0.0f);
  const double lrs[] = {0.1, 0.1, 0.05, 0.2, 0.2, 0.0, 0.1};
  for (size_t t = 0; t < std::size(lrs); ++t) {
    const StepInfo info{.step = t, .lr = lrs[t], .prev_lr = t == 0 ? 0.0 : lrs[t - 1]};
    const auto g = gradient(n, 900 + t);
    const auto p = fb->compensate(g, info);
    const bool rescale = corrected && info.prev_lr > 0 && info.lr > 0;
    const auto alpha = static_cast<float>(decay * (rescale ? info.prev_lr / info.lr : 1.0));
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(p[i], std::fma(alpha, e[i], g[i])) << "step " << t << " element " << i;
    ASSERT_EQ(fb->residual().data(), p.data());  // the codec writes the new e over p
    testing::sparsify_into_residual(p, fb->residual(), 0.5f);
    fb->commit();
    e.assign(fb->residual().begin(), fb->residual().end());
  }
}

TEST(ErrorFeedback, DecayAndLearningRateCorrection) {
  check_feedback_formula("ef", 1.0, false);
  check_feedback_formula("ef:decay=0.9", 0.9, false);
  check_feedback_formula("ef:lr_correction=true", 1.0, true);
  check_feedback_formula("ef:decay=0.5,lr_correction=true", 0.5, true);
  check_feedback_formula("ef:decay=0", 0.0, false);
}

TEST(ErrorFeedback, MemoryAccumulatesWhatWasNotSent) {
  // With a codec that sends nothing, e grows by g every step: p_t = g_0 + ... + g_t.
  auto fb = make_feedback("ef");
  const std::vector<float> g = {1.0f, -2.0f, 0.5f};
  for (int t = 1; t <= 3; ++t) {
    const auto p = fb->compensate(g, {});
    EXPECT_EQ(p[0], 1.0f * t);
    EXPECT_EQ(p[1], -2.0f * t);
    fb->commit();  // residual = p: nothing sent
  }
}

// The engine hands a bucket's tensors over as backward produces them; ef compensates each part
// as it comes, and the whole is compensate()'s bits (a residual left by a codec in between).
TEST(ErrorFeedback, CompensatingInPartsGivesTheWholesBits) {
  auto whole = make_feedback("ef:decay=0.7,lr_correction=true");
  auto parts = make_feedback("ef:decay=0.7,lr_correction=true");
  ASSERT_TRUE(parts->in_parts());
  for (uint64_t t = 0; t < 3; ++t) {
    const StepInfo info{.step = t, .lr = 0.1 / static_cast<double>(t + 1),
                        .prev_lr = t == 0 ? 0.0 : 0.1 / static_cast<double>(t)};
    const auto g = gradient(100, t + 1);
    const auto want = whole->compensate(g, info);
    parts->begin_parts(g.size(), info);
    parts->compensate_part(60, std::span(g).subspan(60));
    parts->compensate_part(0, std::span(g).first(60));
    const auto got = parts->end_parts();
    ASSERT_EQ(std::memcmp(got.data(), want.data(), g.size() * sizeof(float)), 0) << "step " << t;
    for (auto* fb : {whole.get(), parts.get()}) {  // a codec that keeps every other element
      for (size_t i = 0; i < g.size(); i += 2) fb->residual()[i] = 0;
      fb->commit();
    }
  }
  parts->begin_parts(100, {});
  EXPECT_THROW(parts->compensate_part(60, std::vector<float>(41)), Error);
}

// The others compensate whole: a part is an Error naming the feedback.
TEST(ErrorFeedback, OnlyElementwiseFeedbacksTakeParts) {
  for (const std::string spec : {"none", "dgc", "nesterov"}) {
    auto fb = make_feedback(spec);
    EXPECT_FALSE(fb->in_parts()) << spec;
    try {
      fb->begin_parts(10, {});
      ADD_FAILURE() << spec << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot compensate in parts"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find(spec), std::string::npos);
    }
  }
}

TEST(ErrorFeedback, StateRoundTripContinuesBitExactly) {
  auto a = make_feedback("ef:decay=0.7,lr_correction=true");
  const size_t n = 1000;
  EXPECT_EQ(make_feedback("ef")->save_state().size(), 22u);  // header only before first use
  for (uint64_t t = 0; t < 3; ++t) {
    const auto p = a->compensate(gradient(n, t), {.lr = 0.1, .prev_lr = 0.2});
    testing::sparsify_into_residual(p, a->residual(), 1.0f);
  }
  const auto state = a->save_state();
  EXPECT_EQ(state.size(), 22 + 4 * n);
  auto b = make_feedback("ef:decay=0.7,lr_correction=true");
  b->load_state(state);
  EXPECT_EQ(b->save_state(), state);
  for (uint64_t t = 3; t < 5; ++t) {
    const auto g = gradient(n, t);
    const auto pa = a->compensate(g, {.lr = 0.1, .prev_lr = 0.2});
    const auto pb = b->compensate(g, {.lr = 0.1, .prev_lr = 0.2});
    ASSERT_TRUE(std::equal(pa.begin(), pa.end(), pb.begin(), pb.end()));
    testing::sparsify_into_residual(pa, a->residual(), 1.0f);
    testing::sparsify_into_residual(pb, b->residual(), 1.0f);
  }
  // An empty (never used) state loads, and then the first gradient sizes the buffer.
  auto c = make_feedback("ef");
  c->load_state(make_feedback("ef")->save_state());
  EXPECT_EQ(c->compensate(gradient(5, 1), {}).size(), 5u);
}

TEST(ErrorFeedback, CorruptOrForeignStatesAreRejected) {
  auto a = make_feedback("ef");
  a->compensate(gradient(10, 1), {});
  const auto state = a->save_state();
  auto b = make_feedback("ef");
  EXPECT_THROW(b->load_state(std::span(state).first(state.size() - 4)), Error);
  EXPECT_THROW(b->load_state(std::span(state).first(10)), Error);
  auto version = state;
  version[4] = std::byte{9};
  EXPECT_THROW(b->load_state(version), Error);
  try {
    make_feedback("dgc")->load_state(state);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("feedback 'dgc': cannot load state"), std::string::npos)
        << e.what();
  }
  // A failed load leaves the memory as it was.
  b->compensate(gradient(10, 2), {});
  const auto before = b->save_state();
  EXPECT_THROW(b->load_state(version), Error);
  EXPECT_EQ(b->save_state(), before);
}

TEST(ErrorFeedback, GradientLengthMustNotChange) {
  auto fb = make_feedback("ef");
  fb->compensate(gradient(100, 1), {});
  try {
    fb->compensate(gradient(101, 1), {});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("feedback 'ef': gradient of 101 elements, but its memory "
                                         "holds 100"),
              std::string::npos)
        << e.what();
  }
}

TEST(ErrorFeedback, SpecsAreCanonicalAndCheckedTheirRanges) {
  EXPECT_EQ(make_feedback("ef")->spec(), "ef:decay=1,lr_correction=false");
  EXPECT_EQ(make_feedback("ef:decay=0.25,lr_correction=1")->spec(),
            "ef:decay=0.25,lr_correction=true");
  const auto canonical = make_feedback("ef:decay=0.3")->spec();
  EXPECT_EQ(make_feedback(canonical)->spec(), canonical);
  EXPECT_EQ(testing::feedback_spec_error("ef:decay=2"),
            "feedback 'ef': parameter 'decay' = 2 is out of range; allowed: [0, 1]");
  EXPECT_NE(testing::feedback_spec_error("ef:lr_correction=yes").find("parameter 'lr_correction'"),
            std::string::npos);
  EXPECT_NE(
      testing::feedback_spec_error("ef:bogus=1").find("feedback 'ef': unknown parameter 'bogus'"),
      std::string::npos);
  EXPECT_NE(testing::feedback_spec_error("zip").find("unknown feedback 'zip'"), std::string::npos);
}

}  // namespace
}  // namespace gradcomp
