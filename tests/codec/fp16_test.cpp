// fp16: golden bytes, agreement with the scalar reference (half.h) on a sweep of float32 bit
// patterns, round to nearest even, overflow and NaN, error bound, summation, bad frames, specs.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/half.h"
#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::decode;
using testing::encode;
using testing::hex;

std::vector<uint16_t> fp16_words(const std::vector<std::byte>& frame) {
  std::vector<uint16_t> out((frame.size() - kFrameHeaderBytes) / 2);
  std::memcpy(out.data(), frame.data() + kFrameHeaderBytes, 2 * out.size());
  return out;
}

TEST(Fp16, GoldenBytes) {
  auto codec = make_codec("fp16");
  const std::vector<float> x = {1.0f,    -2.5f,  0.0f,   65504.0f,  70000.0f, 0.1f,
                                1.0f + 0x1.0p-11f, 1.0f + 0x3.0p-11f, 6e-8f, -0.0f,
                                3.14159f, -1000.0f, 0.5f,  0x1.0p-14f, 65520.0f, 65519.0f,
                                -7.0f,   -0.25f};
  const Context ctx{.seed = 3, .bucket = 1, .step = 5, .rank = 2, .world_size = 4};
  const auto frame = encode(*codec, x, ctx);
  // Header: "GCFR", version 1, codec 2, round 0, flags 0, FNV-1a("fp16") = 0x724257a8,
  // 1 summand, n = 18, 36 payload bytes, aux 0, CRC-32.
  // Payload, by hand: 1 = 3c00, -2.5 = c100, 0, 65504 = 7bff (max), 70000 = 7c00 (Inf),
  // 0.1 = 2e66, 1+2^-11 ties to even 3c00, 1+3*2^-11 ties to even 3c02, 6e-8 = 0001 (2^-24),
  // -0 = 8000, pi = 4248, -1000 = e3d0, 0.5 = 3800, 2^-14 = 0400 (smallest normal),
  // 65520 = 7c00 (rounds up to Inf), 65519 = 7bff, -7 = c700, -0.25 = b400.
  EXPECT_EQ(hex(frame),
            "4743465201020000a8574272010000001200000000000000240000000000000000000000496a9ec3"
            "003c00c10000ff7b007c662e003c023c010000804842d0e300380004007cff7b00c700b4");
  const auto back = decode(*codec, frame, x.size(), ctx);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], -2.5f);
  EXPECT_EQ(back[4], std::numeric_limits<float>::infinity());
  EXPECT_EQ(back[8], 0x1.0p-24f);
  EXPECT_EQ(back[9], 0.0f);  // -0 added to a zero sum
}

TEST(Fp16, MatchesTheScalarReferenceOnFloatBitPatterns) {
  // A stride through all 2^32 patterns (every exponent, both signs, NaNs), plus the rounding
  // boundaries; an odd length so the vector loop and the scalar tail both run.
  std::vector<float> x;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4093) {
    x.push_back(std::bit_cast<float>(static_cast<uint32_t>(b)));
  }
  for (uint32_t b : {0x477fefffU, 0x477ff000U, 0x477ff001U, 0x38800000U, 0x387fffffU,
                     0x33000000U, 0x33000001U, 0x33c00000U, 0x7f800001U, 0xff800000U}) {
    x.push_back(std::bit_cast<float>(b));
  }
  auto codec = make_codec("fp16");
  std::vector<float> residual(x.size());
  const Context ctx{.threads = 2};
  const auto h = fp16_words(encode(*codec, x, ctx, residual));
  ASSERT_EQ(h.size(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(h[i], float_to_half(x[i])) << "bits 0x" << std::hex << std::bit_cast<uint32_t>(x[i]);
    const float expected = x[i] - half_to_float(h[i]);
    ASSERT_EQ(std::isnan(residual[i]), std::isnan(expected)) << i;
    if (!std::isnan(expected)) {
      ASSERT_EQ(residual[i], expected) << i;
    }
  }
}

TEST(Fp16, RoundTripWithinHalfAnUlp) {
  auto codec = make_codec("fp16");
  const auto x = testing::gradient(10001, 21, 3.0f);
  const auto back = testing::roundtrip(*codec, x);
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::fabs(x[i]) < 0x1.0p-14f) {
      ASSERT_LE(std::fabs(back[i] - x[i]), 0x1.0p-25f) << i;  // subnormal: half of 2^-24
    } else {
      ASSERT_LE(std::fabs(back[i] - x[i]), 0x1.0p-11f * std::fabs(x[i])) << i;
    }
  }
}

TEST(Fp16, OverflowIsInfAndNanStaysNan) {
  auto codec = make_codec("fp16");
  const std::vector<float> x = {1e6f, -1e6f, std::numeric_limits<float>::quiet_NaN(),
                                -std::numeric_limits<float>::infinity()};
  const auto back = testing::roundtrip(*codec, x);
  EXPECT_EQ(back[0], std::numeric_limits<float>::infinity());
  EXPECT_EQ(back[1], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(back[2]));
  EXPECT_EQ(back[3], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(read_frame_header(encode(*codec, x)).flags, 0);  // the payload carries them
}

TEST(Fp16, DecodeAddsIntoTheSum) {
  auto codec = make_codec("fp16");
  const std::vector<float> x = {1.5f, -2.0f, 0.25f};
  std::vector<float> sum = {10.0f, 20.0f, 30.0f};
  codec->decode_accumulate(encode(*codec, x), sum, {});
  EXPECT_EQ(sum, (std::vector<float>{11.5f, 18.0f, 30.25f}));
}

TEST(Fp16, AllreduceAggregateIsTheMean) {
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < 3; ++r) inputs.push_back(testing::gradient(1000, 40 + r));
  const auto mean = testing::aggregate_allreduce("fp16", inputs);
  for (size_t i = 0; i < mean.size(); ++i) {
    const float exact = (inputs[0][i] + inputs[1][i] + inputs[2][i]) / 3.0f;
    ASSERT_NEAR(mean[i], exact, 4e-3f * (1.0f + std::fabs(exact))) << i;
  }
}

TEST(Fp16, RejectsMalformedHeadersAndPayloads) {
  auto codec = make_codec("fp16");
  const auto frame = encode(*codec, testing::gradient(10, 1));
  using testing::edited;
  testing::expect_frame_error(*codec, edited(frame, [](FrameHeader& h) { h.payload_bytes = 18; }),
                              10, "payload is 18 bytes");
  testing::expect_frame_error(*codec, edited(frame, [](FrameHeader& h) { h.aux = 1; }), 10, "aux");
  testing::expect_frame_error(*codec, edited(frame, [](FrameHeader& h) { h.flags = 2; }), 10,
                              "unknown bits");
}

// Half precision carries NaN and Inf in the payload, so the encoder never sets the non-finite
// flag, and a frame that has it is not one of ours.
TEST(Fp16, NonFiniteFlagIsRefused) {
  auto codec = make_codec("fp16");
  const auto frame = testing::edited(encode(*codec, testing::gradient(5, 1)),
                                     [](FrameHeader& h) { h.flags = kFlagNonFinite; });
  std::vector<float> sum(5, 0.0f);
  EXPECT_THROW(codec->decode_accumulate(frame, sum, {}), FrameError);
}

TEST(Fp16, SpecHasNoParameters) {
  EXPECT_EQ(make_codec("fp16")->spec(), "fp16");
  testing::expect_spec_error("fp16:round=nearest", {"codec 'fp16'", "'round'"});
  const auto t = make_codec("fp16")->traits();
  EXPECT_TRUE(t.summable);
  EXPECT_EQ(t.payload_type, DType::kF16);
  EXPECT_FALSE(t.unbiased);
}

}  // namespace
}  // namespace gradcomp
