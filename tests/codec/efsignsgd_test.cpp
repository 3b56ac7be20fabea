// efsignsgd: golden bytes, scale = mean |x|, decoded +-scale (the l1 norm kept), the fused
// residual, error feedback keeping the long-run average, non-finite input, the mean aggregate,
// bad frames and specs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::decode;
using testing::encode;
using testing::hex;

float scale_of(const std::vector<std::byte>& frame) {
  float s;
  std::memcpy(&s, frame.data() + kFrameHeaderBytes, 4);
  return s;
}

TEST(EfSignSgd, GoldenBytes) {
  auto codec = make_codec("efsignsgd");
  const std::vector<float> x = {0.5f,  -1.0f,  0.0f, -0.0f, 2.0f,  -3.0f, -0.1f,
                                4.0f,  1e-3f,  -1e-3f, 7.0f, -7.0f, 0.25f, 0.25f,
                                -2.0f, 9.0f,   -1.0f, 1.0f,  -5.0f, 0.0f};
  const Context ctx{.seed = 3, .bucket = 1, .step = 5, .rank = 2, .world_size = 4};
  const auto frame = encode(*codec, x, ctx);
  // Header: codec 9, FNV-1a("efsignsgd"), n = 20, 7 payload bytes. Payload: the scale
  // sum|x| / 20 = 43.102 / 20 = 2.1551 as float32 (0x4009ed29), then the sign bits 62 4a 05
  // (elements 1, 5, 6 | 9, 11, 14 | 16, 18 negative).
  EXPECT_EQ(hex(frame),
            "4743465201090000276af738010000001400000000000000070000000000000000000000b172040d"
            "29ed0940624a05");
  const float scale = scale_of(frame);
  EXPECT_FLOAT_EQ(scale, 2.1551f);
  const auto back = decode(*codec, frame, x.size(), ctx);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], x[i] < 0 ? -scale : scale) << i;
}

TEST(EfSignSgd, ScaleIsTheMeanAbsoluteValueAndKeepsTheL1Norm) {
  auto codec = make_codec("efsignsgd");
  const auto x = testing::gradient(200003, 31, 0.01f);  // several chunks and a ragged tail
  const auto frame = encode(*codec, x, Context{.threads = 2});
  long double l1 = 0;
  for (float v : x) l1 += std::fabs(v);
  const auto mean = static_cast<double>(l1 / x.size());
  EXPECT_NEAR(scale_of(frame), mean, 1e-6 * mean);
  double decoded_l1 = 0;
  for (float v : decode(*codec, frame, x.size())) decoded_l1 += std::fabs(v);
  EXPECT_NEAR(decoded_l1, static_cast<double>(l1), 1e-5 * static_cast<double>(l1));
}

TEST(EfSignSgd, ResidualIsInputMinusScaledSign) {
  auto codec = make_codec("efsignsgd");
  const auto x = testing::gradient(999, 32);
  std::vector<float> residual(x.size());
  const float scale = scale_of(encode(*codec, x, {}, residual));
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(residual[i], x[i] - (x[i] < 0 ? -scale : scale)) << i;
  }
}

TEST(EfSignSgd, ErrorFeedbackRecoversTheAverageGradient) {
  // With p = g + e and e <- p - decode(p), the decoded steps add up to T g - e_T. The memory
  // stops growing (here, for a constant g of 64 elements, by about step 500), so the average
  // of the decoded steps tends to g although every step only carries signs and one scale.
  auto codec = make_codec("efsignsgd");
  const auto g = testing::gradient(64, 33);
  std::vector<float> memory(g.size(), 0.0f), total(g.size(), 0.0f);
  auto worst = [](const std::vector<float>& v) {
    float w = 0;
    for (float e : v) w = std::max(w, std::fabs(e));
    return w;
  };
  const int steps = 2048;
  float worst_at_half = 0;
  for (int t = 0; t < steps; ++t) {
    for (size_t i = 0; i < g.size(); ++i) memory[i] += g[i];  // p = g + e, in place
    const auto frame = encode(*codec, memory, Context{.step = static_cast<uint64_t>(t)}, memory);
    codec->decode_accumulate(frame, total, {});
    if (t + 1 == steps / 2) worst_at_half = worst(memory);
  }
  const float worst_at_end = worst(memory);
  EXPECT_LT(worst_at_end, 1.1f * worst_at_half);  // bounded, not growing
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_NEAR(total[i] / steps, g[i], worst_at_end / steps * 1.01f + 1e-3f) << i;
  }
  EXPECT_LT(worst_at_end / steps, 0.05f);
}

TEST(EfSignSgd, NonFiniteInputMakesTheScaleNonFiniteAndSetsTheFlag) {
  auto codec = make_codec("efsignsgd");
  auto x = testing::gradient(100, 34);
  x[17] = std::numeric_limits<float>::infinity();
  auto frame = encode(*codec, x);
  EXPECT_EQ(scale_of(frame), std::numeric_limits<float>::infinity());
  EXPECT_EQ(read_frame_header(frame).flags, kFlagNonFinite);
  for (float v : decode(*codec, frame, x.size())) EXPECT_TRUE(std::isnan(v));
  x[17] = -std::numeric_limits<float>::quiet_NaN();
  frame = encode(*codec, x);
  // Every NaN input gives the same scale bytes: the default quiet NaN 0x7fc00000.
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes, 4)), "0000c07f");
}

TEST(EfSignSgd, ZeroInputHasZeroScale) {
  auto codec = make_codec("efsignsgd");
  const std::vector<float> x(33, 0.0f);
  const auto frame = encode(*codec, x);
  EXPECT_EQ(scale_of(frame), 0.0f);
  for (float v : decode(*codec, frame, x.size())) EXPECT_EQ(v, 0.0f);
}

TEST(EfSignSgd, AggregateIsTheMeanOfScaledSigns) {
  const std::vector<std::vector<float>> inputs = {{1, -3, 2}, {-2, -2, 2}};
  // Rank 0: scale 2 -> (2, -2, 2); rank 1: scale 2 -> (-2, -2, 2); mean (0, -2, 2).
  EXPECT_EQ(testing::aggregate_allreduce("efsignsgd", inputs), (std::vector<float>{0, -2, 2}));
}

TEST(EfSignSgd, RejectsMalformedFrames) {
  auto codec = make_codec("efsignsgd");
  const auto frame = encode(*codec, testing::gradient(12, 35));
  auto negative = frame;
  const float minus = -1.0f;
  std::memcpy(negative.data() + kFrameHeaderBytes, &minus, 4);
  testing::expect_frame_error(*codec, negative, 12, "negative");
  auto padded = frame;
  padded.back() |= std::byte{0x80};
  testing::expect_frame_error(*codec, padded, 12, "padding bits");
  testing::expect_frame_error(
      *codec, testing::edited(frame, [](FrameHeader& h) { h.payload_bytes = 2; }), 12,
      "payload is 2 bytes");
}

TEST(EfSignSgd, SpecAndTraits) {
  EXPECT_EQ(make_codec("efsignsgd")->spec(), "efsignsgd");
  testing::expect_spec_error("efsignsgd:chunk=256", {"codec 'efsignsgd'", "'chunk'"});
  const auto t = make_codec("efsignsgd")->traits();
  EXPECT_FALSE(t.summable);
  EXPECT_EQ(t.aggregation, Aggregation::kMean);
}

}  // namespace
}  // namespace gradcomp
