// bf16: golden bytes, agreement with the scalar reference (half.h) on a sweep of float32 bit
// patterns, round to nearest even, subnormals rounded (not flushed), Inf and NaN, error bound,
// summation, bad frames, specs.
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

std::vector<uint16_t> bf16_words(const std::vector<std::byte>& frame) {
  std::vector<uint16_t> out((frame.size() - kFrameHeaderBytes) / 2);
  std::memcpy(out.data(), frame.data() + kFrameHeaderBytes, 2 * out.size());
  return out;
}

TEST(Bf16, GoldenBytes) {
  auto codec = make_codec("bf16");
  const std::vector<float> x = {
      1.0f,  -2.5f, 0.0f, 1.0f + 0x1.0p-8f, 1.0f + 0x3.0p-8f, std::numeric_limits<float>::max(),
      1e-40f, -0.0f, 3.14159265f, -1000.0f, 0.1f, std::numeric_limits<float>::quiet_NaN(),
      std::bit_cast<float>(0x7f800001U), std::numeric_limits<float>::infinity(), -7.0f, 0.5f,
      -0.25f, 65504.0f};
  const Context ctx{.seed = 3, .bucket = 1, .step = 5, .rank = 2, .world_size = 4};
  const auto frame = encode(*codec, x, ctx);
  // Header: "GCFR", version 1, codec 3, round 0, flags 0, FNV-1a("bf16"), 1 summand, n = 18,
  // 36 payload bytes, aux 0, CRC-32.
  // Payload, by hand (top half of the float32 after adding 0x7fff + lsb): 1 = 3f80,
  // -2.5 = c020, 0, 1+2^-8 ties to even 3f80, 1+3*2^-8 ties to even 3f82, FLT_MAX rounds to
  // Inf 7f80, 1e-40 (0x000116c2) rounds to 0001, -0 = 8000, pi = 4049, -1000 = c47a,
  // 0.1 = 3dcd, quiet NaN 7fc0, signalling NaN 7f800001 quietened to 7fc0, Inf 7f80,
  // -7 = c0e0, 0.5 = 3f00, -0.25 = be80, 65504 = 4780.
  EXPECT_EQ(hex(frame),
            "4743465201030000eaa29ca10100000012000000000000002400000000000000000000004176ef5f"
            "803f20c00000803f823f807f0100008049407ac4cd3dc07fc07f807fe0c0003f80be8047");
  const auto back = decode(*codec, frame, x.size(), ctx);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], -2.5f);
  EXPECT_EQ(back[5], std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(back[11]));
  EXPECT_TRUE(std::isnan(back[12]));
}

TEST(Bf16, MatchesTheScalarReferenceOnFloatBitPatterns) {
  std::vector<float> x;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4093) {
    x.push_back(std::bit_cast<float>(static_cast<uint32_t>(b)));
  }
  for (uint32_t b : {0x00008000U, 0x00018000U, 0x0000c000U, 0x7f7f8000U, 0x7f7f7fffU,
                     0x7f800001U, 0xffffffffU, 0x80008000U}) {
    x.push_back(std::bit_cast<float>(b));
  }
  auto codec = make_codec("bf16");
  std::vector<float> residual(x.size());
  const auto h = bf16_words(encode(*codec, x, Context{.threads = 2}, residual));
  ASSERT_EQ(h.size(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(h[i], float_to_bf16(x[i])) << "bits 0x" << std::hex << std::bit_cast<uint32_t>(x[i]);
    const float expected = x[i] - bf16_to_float(h[i]);
    ASSERT_EQ(std::isnan(residual[i]), std::isnan(expected)) << i;
    if (!std::isnan(expected)) {
      ASSERT_EQ(residual[i], expected) << i;
    }
  }
}

TEST(Bf16, SubnormalsAreRoundedNotFlushed) {
  // vcvtneps2bf16 would give 0 here; the codec must give float_to_bf16's rounding on any CPU.
  std::vector<float> x(40, std::bit_cast<float>(0x0000c000U));  // > half a bf16 ulp
  for (float v : testing::roundtrip(*make_codec("bf16"), x)) {
    EXPECT_EQ(std::bit_cast<uint32_t>(v), 0x00010000U);
  }
}

TEST(Bf16, RoundTripWithinHalfAnUlp) {
  auto codec = make_codec("bf16");
  const auto x = testing::gradient(10001, 22, 1e3f);
  const auto back = testing::roundtrip(*codec, x);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_LE(std::fabs(back[i] - x[i]), 0x1.0p-8f * std::fabs(x[i])) << i;
  }
}

TEST(Bf16, DecodeAddsIntoTheSum) {
  auto codec = make_codec("bf16");
  const std::vector<float> x = {1.5f, -2.0f, 0.25f};
  std::vector<float> sum = {10.0f, 20.0f, 30.0f};
  codec->decode_accumulate(encode(*codec, x), sum, {});
  EXPECT_EQ(sum, (std::vector<float>{11.5f, 18.0f, 30.25f}));
}

TEST(Bf16, AllreduceAggregateIsTheMean) {
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < 3; ++r) inputs.push_back(testing::gradient(1000, 50 + r));
  const auto mean = testing::aggregate_allreduce("bf16", inputs);
  for (size_t i = 0; i < mean.size(); ++i) {
    const float exact = (inputs[0][i] + inputs[1][i] + inputs[2][i]) / 3.0f;
    ASSERT_NEAR(mean[i], exact, 0.03f * (1.0f + std::fabs(exact))) << i;
  }
}

TEST(Bf16, RejectsMalformedHeadersAndPayloads) {
  auto codec = make_codec("bf16");
  const auto frame = encode(*codec, testing::gradient(10, 1));
  using testing::edited;
  testing::expect_frame_error(*codec, edited(frame, [](FrameHeader& h) { h.payload_bytes = 21; }),
                              10, "payload is 21 bytes");
  testing::expect_frame_error(*codec, edited(frame, [](FrameHeader& h) { h.aux = 7; }), 10, "aux");
  testing::expect_frame_error(*codec, edited(frame, [](FrameHeader& h) { h.flags = 0x81; }), 10,
                              "unknown bits");
}

// Half precision carries NaN and Inf in the payload, so the encoder never sets the non-finite
// flag, and a frame that has it is not one of ours.
TEST(Bf16, NonFiniteFlagIsRefused) {
  auto codec = make_codec("bf16");
  const auto frame = testing::edited(encode(*codec, testing::gradient(5, 1)),
                                     [](FrameHeader& h) { h.flags = kFlagNonFinite; });
  std::vector<float> sum(5, 0.0f);
  EXPECT_THROW(codec->decode_accumulate(frame, sum, {}), FrameError);
}

TEST(Bf16, SpecHasNoParameters) {
  EXPECT_EQ(make_codec("bf16")->spec(), "bf16");
  testing::expect_spec_error("bf16:stochastic=true", {"codec 'bf16'", "'stochastic'"});
  const auto t = make_codec("bf16")->traits();
  EXPECT_TRUE(t.summable);
  EXPECT_EQ(t.payload_type, DType::kBF16);
}

}  // namespace
}  // namespace gradcomp
