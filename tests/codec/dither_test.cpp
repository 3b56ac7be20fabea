// dither: wire layout (golden bytes) for both partitions, grid membership and error bounds,
// unbiasedness for every partition and norm, spec errors, rejection of out-of-range levels.
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

// The grid of a dither spec as multiples of the scale.
std::vector<double> grid_points(uint32_t levels, bool natural) {
  std::vector<double> points = {0.0};
  for (uint32_t k = 1; k <= levels; ++k) {
    points.push_back(natural ? std::ldexp(1.0, int(k) - int(levels)) : double(k) / levels);
  }
  return points;
}

const std::vector<float> kDitherSmall = {0.5f,  -1.25f, 0.0f,  2.0f,  -0.75f, 0.125f, 3.0f,
                                         -2.5f, 1.0f,   -0.1f, 0.3f,  -3.5f,  0.9f,   -0.02f,
                                         1.75f, 0.6f,   -4.0f, 0.25f, -0.5f,  1.5f};

TEST(Dither, GoldenBytesLinear) {
  auto codec = make_codec("dither:levels=3");
  const Context ctx{.seed = 31, .bucket = 0, .step = 5, .rank = 3};
  const auto frame = encode(*codec, kDitherSmall, ctx);
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + 4 + 8);  // scale + 20 codes of 3 bits
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes)), "000080401838b818ae484704");
  // Checked by hand: scale 0x40800000 = 4 (max |x|); byte 0x18 = codes 000 (element 0, 0.5:
  // level 0), 011 (element 1, -1.25 -> v 0.94: level 1, negative), then element 2 (zero) = 0
  // and element 3 (2.0 -> v 1.5) = 100 (level 2) from bits 9..11.
  EXPECT_EQ(testing::payload_f32(frame, 0), 4.0f);
  BitReader reader(frame.data() + kFrameHeaderBytes + 4, 8, 3);
  for (size_t i = 0; i < kDitherSmall.size(); ++i) {
    const uint32_t code = reader.get();
    const float v = std::fabs(kDitherSmall[i]) / 4.0f * 3;
    EXPECT_TRUE((code >> 1) == std::floor(v) || (code >> 1) == std::ceil(v)) << i;
    EXPECT_EQ(code & 1, std::signbit(kDitherSmall[i]) ? 1u : 0u) << i;
  }
}

TEST(Dither, GoldenBytesNatural) {
  auto codec = make_codec("dither:partition=natural,norm=l2");  // s = 3: {0, 1/4, 1/2, 1}
  const Context ctx{.seed = 31, .bucket = 0, .step = 5, .rank = 3};
  const auto frame = encode(*codec, kDitherSmall, ctx);
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + 4 + 8);
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes)), "3941f3401814b0088a484500");
  // Checked by hand: scale 0x40f34139 = 7.6017 = sqrt(57.786); byte 0x18 = index 0 for element
  // 0 (0.5 -> v 0.066, between 0 and 1/4) and index 1, negative, for element 1 (v 0.164).
  double sq = 0;
  for (float v : kDitherSmall) sq += double(v) * v;
  const float scale = static_cast<float>(std::sqrt(sq));
  EXPECT_EQ(testing::payload_f32(frame, 0), scale);
  BitReader reader(frame.data() + kFrameHeaderBytes + 4, 8, 3);
  for (size_t i = 0; i < kDitherSmall.size(); ++i) {
    const uint32_t code = reader.get();
    const double v = std::fabs(kDitherSmall[i]) / scale;
    const uint32_t k = code >> 1;
    // The index of the grid point just below v, or the next one.
    const uint32_t below = v < 0.25 ? 0 : v < 0.5 ? 1 : v < 1 ? 2 : 3;
    EXPECT_TRUE(k == below || k == below + 1) << i << ": " << v << " -> " << k;
  }
}

TEST(Dither, CanonicalSpecAndDefaults) {
  EXPECT_EQ(make_codec("dither")->spec(), "dither:levels=15,partition=linear,norm=max");
  EXPECT_EQ(make_codec("dither:partition=natural")->spec(),
            "dither:levels=3,partition=natural,norm=max");
  EXPECT_EQ(make_codec("dither:norm=l2,levels=100")->spec(),
            "dither:levels=100,partition=linear,norm=l2");
}

TEST(Dither, BadSpecsNameTheParameter) {
  testing::expect_spec_error("dither:levels=0",
                             {"codec 'dither'", "parameter 'levels'", "allowed"});
  testing::expect_spec_error("dither:levels=40000",
                             {"codec 'dither'", "parameter 'levels'", "allowed"});
  testing::expect_spec_error("dither:partition=log",
                             {"codec 'dither'", "parameter 'partition'", "allowed"});
  testing::expect_spec_error("dither:norm=l1", {"codec 'dither'", "parameter 'norm'", "allowed"});
  testing::expect_spec_error("dither:partition=natural,levels=128",
                             {"codec 'dither'", "parameter 'levels'", "allowed"});
}

TEST(Dither, WireWidthIsSignPlusCeilLog2OfLevelsPlusOne) {
  const auto x = gradient(1000, 3);
  for (const std::string partition : {"linear", "natural"}) {
    for (uint32_t s : {1u, 2u, 3u, 4u, 7u, 8u, 100u, 127u}) {
      const unsigned width = static_cast<unsigned>(std::ceil(std::log2(s + 1.0))) + 1;
      auto codec = make_codec("dither:levels=" + std::to_string(s) + ",partition=" + partition);
      EXPECT_EQ(codec->traits().bits_per_element, width);
      EXPECT_EQ(encode(*codec, x).size(), kFrameHeaderBytes + 4 + packed_bytes(x.size(), width));
    }
  }
}

TEST(Dither, DecodesToOneOfTheTwoNeighbouringGridPoints) {
  const auto x = gradient(20000, 17);
  for (const std::string spec :
       {"dither:levels=5", "dither:levels=5,norm=l2", "dither:levels=4,partition=natural",
        "dither:levels=20,partition=natural,norm=l2"}) {
    auto codec = make_codec(spec);
    const bool natural = spec.find("natural") != std::string::npos;
    const uint32_t s = std::stoi(spec.substr(spec.find('=') + 1));
    const auto points = grid_points(s, natural);
    std::vector<float> residual(x.size());
    const auto frame = encode(*codec, x, Context{.seed = 2}, residual);
    const double scale = testing::payload_f32(frame, 0);
    const auto y = decode(*codec, frame, x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const double v = std::fabs(x[i]) / scale;
      size_t k = 0;  // points[k] <= v < points[k + 1]
      while (k + 1 < points.size() && points[k + 1] <= v) ++k;
      const double got = std::fabs(y[i]) / scale;
      const bool ok = std::fabs(got - points[k]) < 1e-6 * points[k] + 1e-30 ||
                      (k + 1 < points.size() && std::fabs(got - points[k + 1]) < 1e-6);
      ASSERT_TRUE(ok) << spec << " element " << i << ": " << v << " -> " << got;
      ASSERT_EQ(residual[i], x[i] - y[i]);
    }
  }
}

TEST(Dither, UnbiasedOverManySteps) {
  auto x = gradient(32, 23);
  x[3] = 0.0f;
  const int steps = 2000;
  for (const std::string spec :
       {"dither:levels=3", "dither:levels=3,norm=l2", "dither:levels=3,partition=natural",
        "dither:levels=6,partition=natural,norm=l2"}) {
    auto codec = make_codec(spec);
    std::vector<double> mean(x.size(), 0.0);
    float scale = 0;
    for (int t = 0; t < steps; ++t) {
      const auto frame = encode(*codec, x, Context{.seed = 9, .step = uint64_t(t)});
      scale = testing::payload_f32(frame, 0);
      const auto y = decode(*codec, frame, x.size());
      for (size_t i = 0; i < x.size(); ++i) mean[i] += y[i] / steps;
    }
    // The widest gap between neighbouring grid points is scale / s (linear) or scale / 2
    // (natural); the rounding's standard deviation is at most half of it.
    const double gap = spec.find("natural") != std::string::npos ? scale / 2.0 : scale / 3.0;
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_NEAR(mean[i], x[i], 5 * (gap / 2) / std::sqrt(double(steps))) << spec << " " << i;
    }
  }
}

TEST(Dither, NaturalGridPointsAreExact) {
  auto codec = make_codec("dither:levels=3,partition=natural");
  const std::vector<float> x = {8.0f, -4.0f, 2.0f, 0.0f, -8.0f};  // scale 8: 1, 1/2, 1/4, 0
  for (uint64_t step = 0; step < 20; ++step) {
    EXPECT_EQ(testing::roundtrip(*codec, x, Context{.step = step}), x);
  }
}

TEST(Dither, RejectsLevelsAboveS) {
  auto codec = make_codec("dither:levels=5");  // 4-bit codes: level field 0..7, allowed 0..5
  const auto x = gradient(10, 2);
  auto frame = encode(*codec, x);
  frame[kFrameHeaderBytes + 4 + 2] = std::byte{0x0c};  // element 4: level 6, sign 0
  std::vector<float> sum(x.size(), 3.0f);
  try {
    codec->decode_accumulate(frame, sum, {});
    FAIL() << "no error";
  } catch (const FrameError& e) {
    EXPECT_NE(std::string(e.what()).find("level 6"), std::string::npos) << e.what();
  }
  for (float v : sum) ASSERT_EQ(v, 3.0f);  // nothing was added
}

TEST(Dither, ZeroTinyAndNonFiniteInputs) {
  for (const std::string spec : {"dither", "dither:partition=natural,levels=127"}) {
    auto codec = make_codec(spec);
    for (float v : testing::roundtrip(*codec, std::vector<float>(100, 0.0f))) ASSERT_EQ(v, 0.0f);
    const std::vector<float> tiny = {1e-45f, -3e-44f, 2e-40f, 0.0f};
    const auto y = testing::roundtrip(*codec, tiny);
    EXPECT_EQ(y[2], 2e-40f) << spec << ": the largest sits on the grid";
    for (float v : y) EXPECT_TRUE(std::isfinite(v) && std::fabs(v) <= 2e-40f) << spec;
    auto x = gradient(100, 3);
    x[50] = -std::numeric_limits<float>::infinity();
    const auto frame = encode(*codec, x);
    EXPECT_EQ(read_frame_header(frame).flags & kFlagNonFinite, kFlagNonFinite);
    for (float v : decode(*codec, frame, x.size())) ASSERT_TRUE(std::isnan(v)) << spec;
  }
}

}  // namespace
}  // namespace gradcomp
