// terngrad: wire layout (golden bytes), ternary values, unbiasedness, rejection of code 3,
// special inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "common/bitpack.h"
#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::decode;
using testing::encode;
using testing::gradient;
using testing::hex;

const std::vector<float> kTerngradSmall = {0.5f,  -1.25f, 0.0f,  2.0f,  -0.75f, 0.125f, 3.0f,
                                           -2.5f, 1.0f,   -0.1f, 0.3f,  -3.5f,  0.9f,   -0.02f,
                                           1.75f, 0.6f,   -4.0f, 0.25f, -0.5f,  1.5f};

TEST(TernGrad, GoldenBytesAtAFixedSeed) {
  auto codec = make_codec("terngrad");
  const Context ctx{.seed = 99, .bucket = 4, .step = 17, .rank = 2};
  const auto frame = encode(*codec, kTerngradSmall, ctx);
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + 4 + 5);  // scale + 20 codes of 2 bits
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes)), "000080400090800002");
  // Checked by hand: scale 0x40800000 = 4.0; byte 0x90 holds elements 4..7 = 0, 0, 1 (+4 for
  // 3.0), 2 (-4 for -2.5); byte 0x80 gives element 11 (-3.5) code 2; element 16 (-4, the
  // largest) is always kept: code 2 in the low bits of the last byte.
  EXPECT_EQ(testing::payload_f32(frame, 0), 4.0f);  // max |x|
  BitReader reader(frame.data() + kFrameHeaderBytes + 4, 5, 2);
  for (size_t i = 0; i < kTerngradSmall.size(); ++i) {
    const uint32_t code = reader.get();
    ASSERT_LE(code, 2u) << i;
    if (kTerngradSmall[i] == 0) {
      EXPECT_EQ(code, 0u) << i;
    }
    if (code != 0) {
      EXPECT_EQ(code, kTerngradSmall[i] < 0 ? 2u : 1u) << i;
    }
  }
  EXPECT_EQ(read_frame_header(frame).payload_bytes, 9u);
}

TEST(TernGrad, SpecHasNoParameters) {
  EXPECT_EQ(make_codec("terngrad")->spec(), "terngrad");
  try {
    make_codec("terngrad:levels=2");
    FAIL() << "no error";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("codec 'terngrad'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("unknown parameter 'levels'"), std::string::npos);
  }
}

TEST(TernGrad, TwoBitsPerElementOnTheWire) {
  auto codec = make_codec("terngrad");
  EXPECT_EQ(codec->traits().bits_per_element, 2);
  for (size_t n : {size_t{1}, size_t{3}, size_t{4}, size_t{65}, size_t{100001}}) {
    EXPECT_EQ(encode(*codec, gradient(n, n)).size(), kFrameHeaderBytes + 4 + (n + 3) / 4) << n;
  }
}

TEST(TernGrad, DecodesToMinusZeroOrPlusScale) {
  auto codec = make_codec("terngrad");
  const auto x = gradient(20000, 6);
  const auto frame = encode(*codec, x, Context{.seed = 8});
  const float scale = testing::payload_f32(frame, 0);
  const auto y = decode(*codec, frame, x.size());
  size_t nonzero = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_TRUE(y[i] == 0 || y[i] == scale || y[i] == -scale) << i;
    if (y[i] != 0) {
      ++nonzero;
      ASSERT_EQ(std::signbit(y[i]), std::signbit(x[i])) << i;
    }
    if (std::fabs(x[i]) == scale) {
      ASSERT_EQ(y[i], x[i]) << "the largest is always kept";
    }
  }
  // E[nonzero] = sum |x| / scale; allow 6 standard deviations.
  double expected = 0;
  for (float v : x) expected += std::fabs(v) / scale;
  EXPECT_NEAR(double(nonzero), expected, 6 * std::sqrt(expected));
}

TEST(TernGrad, UnbiasedOverManySteps) {
  auto codec = make_codec("terngrad");
  const auto x = gradient(32, 10);
  const int steps = 2000;
  std::vector<double> mean(x.size(), 0.0);
  float scale = 0;
  for (int t = 0; t < steps; ++t) {
    const auto frame = encode(*codec, x, Context{.seed = 5, .step = uint64_t(t)});
    scale = testing::payload_f32(frame, 0);
    const auto y = decode(*codec, frame, x.size());
    for (size_t i = 0; i < x.size(); ++i) mean[i] += y[i] / steps;
  }
  const double tolerance = 5 * (scale / 2.0) / std::sqrt(double(steps));
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(mean[i], x[i], tolerance) << i;
}

TEST(TernGrad, RejectsCodeThree) {
  auto codec = make_codec("terngrad");
  const auto x = gradient(50, 1);
  auto frame = encode(*codec, x);
  frame[kFrameHeaderBytes + 4 + 12] |= std::byte{0x03};  // element 48 = 4 * 12
  std::vector<float> sum(x.size(), 2.0f);
  try {
    codec->decode_accumulate(frame, sum, {});
    FAIL() << "no error";
  } catch (const FrameError& e) {
    EXPECT_NE(std::string(e.what()).find("code is 3"), std::string::npos) << e.what();
  }
  for (float v : sum) ASSERT_EQ(v, 2.0f);  // nothing was added
}

TEST(TernGrad, RejectsANegativeScale) {
  auto codec = make_codec("terngrad");
  auto frame = encode(*codec, gradient(10, 1));
  const float bad = -2.0f;
  std::memcpy(frame.data() + kFrameHeaderBytes, &bad, 4);
  std::vector<float> sum(10);
  EXPECT_THROW(codec->decode_accumulate(frame, sum, {}), FrameError);
}

TEST(TernGrad, ZeroSubnormalAndNonFiniteInputs) {
  auto codec = make_codec("terngrad");
  for (float v : testing::roundtrip(*codec, std::vector<float>(100, 0.0f))) ASSERT_EQ(v, 0.0f);
  // All subnormal: max |x| < 2^-100; the largest still decodes to itself.
  std::vector<float> tiny = {1e-45f, -3e-44f, 2e-40f, 0.0f};
  const auto y = testing::roundtrip(*codec, tiny);
  EXPECT_EQ(y[2], 2e-40f);
  for (float v : y) EXPECT_TRUE(v == 0 || std::fabs(v) == 2e-40f);
  // NaN: the flag is set and every element decodes to NaN.
  auto x = gradient(100, 3);
  x[7] = std::numeric_limits<float>::quiet_NaN();
  const auto frame = encode(*codec, x);
  EXPECT_EQ(read_frame_header(frame).flags & kFlagNonFinite, kFlagNonFinite);
  for (float v : decode(*codec, frame, x.size())) ASSERT_TRUE(std::isnan(v));
}

}  // namespace
}  // namespace gradcomp
