// natural: wire layout (golden bytes), rounding to the neighbouring powers of two,
// unbiasedness, special values, every code decodable.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
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

constexpr float kInf = std::numeric_limits<float>::infinity();

const std::vector<float> kNaturalSmall = {0.5f,  -1.25f, 0.0f,  2.0f,  -0.75f, 0.125f, 3.0f,
                                          -2.5f, 1.0f,   -0.1f, 0.3f,  -3.5f,  0.9f,   -0.02f,
                                          1.75f, 0.6f,   -4.0f, 0.25f, -0.5f,  1.5f};

TEST(Natural, GoldenBytesAtAFixedSeed) {
  auto codec = make_codec("natural");
  const Context ctx{.seed = 7, .bucket = 2, .step = 3, .rank = 1};
  const auto frame = encode(*codec, kNaturalSmall, ctx);
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + 23);  // 20 codes of 9 bits = 180 bits
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes)),
            "7efe0200f4974fa0c07ff8fa01fc272f203f81fbf80504");
  // Checked by hand: bits 0..8 = 0x07e (element 0: +2^(126-127) = 0.5, exact); bits 9..17 =
  // 0x7f | 0b10 << 7 = 0x17f (element 1, -1.25: sign 1, exponent 127 = -1.0); bits 18..26 = 0.
  // Each code is sign << 8 | the biased exponent of a neighbouring power of two.
  BitReader reader(frame.data() + kFrameHeaderBytes, 23, 9);
  for (size_t i = 0; i < kNaturalSmall.size(); ++i) {
    const uint32_t code = reader.get();
    if (kNaturalSmall[i] == 0) {
      EXPECT_EQ(code, 0u);
      continue;
    }
    const uint32_t exponent = (std::bit_cast<uint32_t>(kNaturalSmall[i]) >> 23) & 0xff;
    EXPECT_EQ(code >> 8, std::signbit(kNaturalSmall[i]) ? 1u : 0u) << i;
    EXPECT_TRUE((code & 0xff) == exponent || (code & 0xff) == exponent + 1) << i;
  }
}

TEST(Natural, SpecHasNoParameters) {
  EXPECT_EQ(make_codec("natural")->spec(), "natural");
  EXPECT_EQ(make_codec("natural")->traits().bits_per_element, 9);
  try {
    make_codec("natural:bits=8");
    FAIL() << "no error";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("codec 'natural'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("unknown parameter 'bits'"), std::string::npos);
  }
}

TEST(Natural, RoundsToANeighbouringPowerOfTwo) {
  auto codec = make_codec("natural");
  const auto x = gradient(20000, 12);
  std::vector<float> residual(x.size());
  const auto frame = encode(*codec, x, Context{.seed = 4}, residual);
  EXPECT_EQ(frame.size(), kFrameHeaderBytes + packed_bytes(x.size(), 9));
  const auto y = decode(*codec, frame, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float low = std::exp2(std::floor(std::log2(std::fabs(x[i]))));
    const float a = std::fabs(y[i]);
    ASSERT_TRUE(a == low || a == 2 * low) << x[i] << " -> " << y[i];
    ASSERT_EQ(std::signbit(y[i]), std::signbit(x[i]));
    ASSERT_EQ(residual[i], x[i] - y[i]);
  }
}

TEST(Natural, PowersOfTwoAndSpecialValuesAreExact) {
  auto codec = make_codec("natural");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {1.0f,  -0.5f, 0x1p-126f, 0x1p127f, -0x1p-100f, 0.0f,
                                -0.0f, kInf,  -kInf,     nan,      -nan};
  for (uint64_t step = 0; step < 20; ++step) {
    const auto y = testing::roundtrip(*codec, x, Context{.step = step});
    for (size_t i = 0; i < 9; ++i) EXPECT_EQ(y[i], i == 6 ? 0.0f : x[i]) << i;
    EXPECT_FALSE(std::signbit(y[6])) << "zero is sent as +0";
    EXPECT_TRUE(std::isnan(y[9]));
    EXPECT_TRUE(std::isnan(y[10]));
  }
}

TEST(Natural, HugeValuesStayFinite) {
  auto codec = make_codec("natural");
  const std::vector<float> x = {std::numeric_limits<float>::max(), -0x1.8p127f};
  for (uint64_t step = 0; step < 50; ++step) {
    const auto y = testing::roundtrip(*codec, x, Context{.step = step});
    EXPECT_EQ(y[0], 0x1p127f);
    EXPECT_EQ(y[1], -0x1p127f);
  }
}

TEST(Natural, UnbiasedOverManySteps) {
  auto codec = make_codec("natural");
  auto x = gradient(32, 13);
  x[0] = 3e-39f;   // subnormal: rounds between 0 and 2^-126
  x[1] = -1e-44f;  // deep subnormal
  const int steps = 2000;
  std::vector<double> mean(x.size(), 0.0);
  for (int t = 0; t < steps; ++t) {
    const auto y = testing::roundtrip(*codec, x, Context{.seed = 2, .step = uint64_t(t)});
    for (size_t i = 0; i < x.size(); ++i) mean[i] += double(y[i]) / steps;
  }
  for (size_t i = 0; i < x.size(); ++i) {
    // Rounding between 2^e and 2^(e+1) has a standard deviation <= 2^e / 2 <= |x| / 2; a
    // subnormal rounds between 0 and 2^-126.
    const double spread = std::fabs(x[i]) < 0x1p-126f ? 0x1p-126 : std::fabs(x[i]);
    EXPECT_NEAR(mean[i], x[i], 5 * (spread / 2) / std::sqrt(double(steps))) << i;
  }
}

TEST(Natural, EveryCodeDecodesAsDocumented) {
  auto codec = make_codec("natural");
  // Take a valid frame for 512 elements and overwrite its codes with 0..511.
  auto frame = encode(*codec, std::vector<float>(512, 1.0f));
  BitWriter writer(frame.data() + kFrameHeaderBytes, 9);
  for (uint32_t c = 0; c < 512; ++c) writer.put(c);
  writer.flush();
  std::vector<float> sum(512, 0.0f);
  codec->decode_accumulate(frame, sum, {});
  for (uint32_t c = 0; c < 512; ++c) {
    if (c == 0x100) {
      EXPECT_TRUE(std::isnan(sum[c]));
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(sum[c]), c << 23) << c;
    }
  }
}

TEST(Natural, RejectsAWrongPayloadLength) {
  auto codec = make_codec("natural");
  auto frame = encode(*codec, gradient(100, 1));
  // A well-formed header whose payload is one byte short of 100 9-bit codes.
  FrameHeader h = read_frame_header(frame);
  h.payload_bytes -= 1;
  frame.pop_back();
  write_frame_header(h, frame);
  std::vector<float> sum(100);
  try {
    codec->decode_accumulate(frame, sum, {});
    FAIL() << "no error";
  } catch (const FrameError& e) {
    EXPECT_NE(std::string(e.what()).find("expected 113"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gradcomp
