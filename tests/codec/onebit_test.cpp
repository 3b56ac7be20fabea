// onebit: golden bytes, the two reconstruction values (mean of each side), decoded values are
// exactly those means (MergeComp's decoder produced 254/255), each side's sum is kept, the fused
// residual, empty sides, non-finite input, the mean aggregate, bad frames and specs; with
// block=B, a pair of means per block (an all-zero block decodes to zeros).
#include <gtest/gtest.h>

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

struct Means {
  float pos, neg;
};
Means means_of(const std::vector<std::byte>& frame) {
  Means m;
  std::memcpy(&m.pos, frame.data() + kFrameHeaderBytes, 4);
  std::memcpy(&m.neg, frame.data() + kFrameHeaderBytes + 4, 4);
  return m;
}

TEST(OneBit, GoldenBytes) {
  auto codec = make_codec("onebit");
  const std::vector<float> x = {0.5f,  -1.0f,  0.0f, -0.0f, 2.0f,  -3.0f, -0.1f,
                                4.0f,  1e-3f,  -1e-3f, 7.0f, -7.0f, 0.25f, 0.25f,
                                -2.0f, 9.0f,   -1.0f, 1.0f,  -5.0f, 0.0f};
  const Context ctx{.seed = 3, .bucket = 1, .step = 5, .rank = 2, .world_size = 4};
  const auto frame = encode(*codec, x, ctx);
  // Header: codec 11, FNV-1a("onebit"), n = 20, 11 payload bytes. Payload: mean_pos = 24.001/12
  // = 2.00008 (0x4000015e), mean_neg = -19.101/8 = -2.38763 (0xc018ced9), then the bits
  // 62 4a 05 (elements 1, 5, 6 | 9, 11, 14 | 16, 18 negative; 0 and -0 on the positive side).
  EXPECT_EQ(hex(frame),
            "47434652010b00004aa423d80100000014000000000000000b0000000000000000000000d41d72b6"
            "5e010040d9ce18c0624a05");
  const Means m = means_of(frame);
  EXPECT_FLOAT_EQ(m.pos, 24.001f / 12);
  EXPECT_FLOAT_EQ(m.neg, -19.101f / 8);
  const auto back = decode(*codec, frame, x.size(), ctx);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], x[i] < 0 ? m.neg : m.pos) << i;
}

TEST(OneBit, MeansAreEachSidesMeanAndKeepItsSum) {
  auto codec = make_codec("onebit");
  auto x = testing::gradient(150001, 41, 0.1f);
  for (size_t i = 0; i < x.size(); i += 3) x[i] = std::fabs(x[i]);  // unequal sides
  const auto frame = encode(*codec, x, Context{.threads = 2});
  long double pos = 0, neg = 0;
  size_t negatives = 0;
  for (float v : x) {
    if (v < 0) {
      neg += v;
      ++negatives;
    } else {
      pos += v;
    }
  }
  const Means m = means_of(frame);
  const auto want_pos = static_cast<double>(pos / (x.size() - negatives));
  const auto want_neg = static_cast<double>(neg / negatives);
  EXPECT_NEAR(m.pos, want_pos, 1e-6 * want_pos);
  EXPECT_NEAR(m.neg, want_neg, -1e-6 * want_neg);
  const auto back = decode(*codec, frame, x.size());
  long double decoded_sum = 0;
  for (float v : back) decoded_sum += v;
  EXPECT_NEAR(static_cast<double>(decoded_sum), static_cast<double>(pos + neg),
              1e-5 * static_cast<double>(pos - neg));
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(back[i], x[i] < 0 ? m.neg : m.pos) << i;
}

TEST(OneBit, ResidualIsInputMinusItsSidesMean) {
  auto codec = make_codec("onebit");
  const auto x = testing::gradient(777, 42);
  std::vector<float> residual(x.size());
  const Means m = means_of(encode(*codec, x, {}, residual));
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(residual[i], x[i] - (x[i] < 0 ? m.neg : m.pos)) << i;
  }
}

TEST(OneBit, AnEmptySideHasMeanZero) {
  auto codec = make_codec("onebit");
  const std::vector<float> positive = {1, 2, 3, 0}, negative = {-1, -2, -3};
  Means m = means_of(encode(*codec, positive));
  EXPECT_EQ(m.pos, 1.5f);
  EXPECT_EQ(m.neg, 0.0f);
  m = means_of(encode(*codec, negative));
  EXPECT_EQ(m.pos, 0.0f);
  EXPECT_EQ(m.neg, -2.0f);
  EXPECT_EQ(testing::roundtrip(*codec, negative), (std::vector<float>{-2, -2, -2}));
}

TEST(OneBit, NonFiniteInputSetsTheFlag) {
  auto codec = make_codec("onebit");
  auto x = testing::gradient(100, 43);
  x[5] = std::numeric_limits<float>::quiet_NaN();  // NaN < 0 is false: the positive side
  auto frame = encode(*codec, x);
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes, 4)), "0000c07f");
  EXPECT_TRUE(std::isfinite(means_of(frame).neg));
  EXPECT_EQ(read_frame_header(frame).flags, kFlagNonFinite);
  for (float v : decode(*codec, frame, x.size())) EXPECT_TRUE(std::isnan(v));
  x[5] = -std::numeric_limits<float>::infinity();
  frame = encode(*codec, x);
  EXPECT_EQ(means_of(frame).neg, -std::numeric_limits<float>::infinity());
  EXPECT_EQ(read_frame_header(frame).flags, kFlagNonFinite);
}

TEST(OneBit, AggregateIsTheMeanOfTheRanks) {
  const std::vector<std::vector<float>> inputs = {{1, 3, -2, -4}, {-1, 5, -5, 1}};
  // Rank 0: (2, 2, -3, -3); rank 1: (-3, 3, -3, 3); mean (-0.5, 2.5, -3, 0).
  EXPECT_EQ(testing::aggregate_allreduce("onebit", inputs),
            (std::vector<float>{-0.5f, 2.5f, -3, 0}));
}

TEST(OneBit, RejectsMeansOfTheWrongSign) {
  auto codec = make_codec("onebit");
  const auto frame = encode(*codec, testing::gradient(16, 44));
  const float wrong = -0.5f;
  auto bad_pos = frame;
  std::memcpy(bad_pos.data() + kFrameHeaderBytes, &wrong, 4);
  testing::expect_frame_error(*codec, bad_pos, 16, "wrong signs");
  auto bad_neg = frame;
  const float positive = 0.5f;
  std::memcpy(bad_neg.data() + kFrameHeaderBytes + 4, &positive, 4);
  testing::expect_frame_error(*codec, bad_neg, 16, "wrong signs");
  testing::expect_frame_error(
      *codec, testing::edited(frame, [](FrameHeader& h) { h.payload_bytes = 9; }), 16,
      "payload is 9 bytes");
}

TEST(OneBit, BlocksHaveTheirOwnMeansAndAZeroBlockDecodesToZeros) {
  auto codec = make_codec("onebit:block=16");
  // Block 0: large values; block 1: all zero (an untouched embedding row); block 2 (ragged,
  // 8 elements): small values.
  std::vector<float> x(40, 0.0f);
  for (size_t i = 0; i < 16; ++i) x[i] = (i % 3 == 0 ? -1.0f : 1.0f) * (10.0f + float(i));
  for (size_t i = 32; i < 40; ++i) x[i] = (i % 2 ? -1e-3f : 2e-3f);
  std::vector<float> residual(x.size());
  const auto frame = encode(*codec, x, {}, residual);
  EXPECT_EQ(frame.size(), kFrameHeaderBytes + 3 * 8 + 5);
  EXPECT_EQ(frame.size(), codec->max_frame_bytes(x.size()));
  const auto back = decode(*codec, frame, x.size());
  for (size_t block = 0; block < 3; ++block) {
    const size_t b = block * 16, e = std::min<size_t>(b + 16, x.size());
    double pos = 0, neg = 0;
    size_t np = 0, nn = 0;
    for (size_t i = b; i < e; ++i) (x[i] < 0 ? (neg += x[i], ++nn) : (pos += x[i], ++np));
    for (size_t i = b; i < e; ++i) {
      const float want = x[i] < 0 ? float(neg / nn) : np ? float(pos / np) : 0.0f;
      ASSERT_FLOAT_EQ(back[i], want) << "element " << i;
      ASSERT_FLOAT_EQ(residual[i], x[i] - want) << "element " << i;
    }
  }
  for (size_t i = 16; i < 32; ++i) EXPECT_EQ(back[i], 0.0f) << "the zero block, element " << i;
  // A wrong sign in the last block's means is refused, naming the block.
  auto bad = frame;
  const float wrong = -0.5f;
  std::memcpy(bad.data() + kFrameHeaderBytes + 2 * 8, &wrong, 4);
  testing::expect_frame_error(*codec, bad, x.size(), "of block 2");
  // One pair of means for the whole input is what block=0 (the default) sends.
  EXPECT_EQ(make_codec("onebit:block=0")->spec(), "onebit");
  EXPECT_EQ(make_codec("onebit:block=64")->spec(), "onebit:block=64");
  testing::expect_spec_error("onebit:block=100", {"'block' = 100", "multiple of 8"});
}

TEST(OneBit, SpecAndTraits) {
  EXPECT_EQ(make_codec("onebit")->spec(), "onebit");
  testing::expect_spec_error("onebit:scaling=true", {"codec 'onebit'", "'scaling'"});
  const auto t = make_codec("onebit")->traits();
  EXPECT_FALSE(t.summable);
  EXPECT_FALSE(t.unbiased);
  EXPECT_EQ(t.aggregation, Aggregation::kMean);
  EXPECT_EQ(make_codec("onebit")->max_frame_bytes(9), kFrameHeaderBytes + 8 + 2);
}

}  // namespace
}  // namespace gradcomp
