// randomk: golden bytes, one index per stratum shared by every rank (so frames sum), the
// selection probability of each element, unbiasedness with scaling, the non-finite flag,
// spec errors and decoder validation.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/random.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::decode;
using testing::encode;
using testing::error_text;
using testing::gradient;
using testing::hex;

const std::vector<float> kRandomkSmall = {0.5f,  -1.0f, 0.0f, 2.0f,   -2.0f,  0.25f, 1.0f,
                                          -0.5f, 3.0f,  0.0f, -3.0f,  0.125f, 1.5f,  -1.5f,
                                          0.75f, -2.0f, 0.0f, -0.25f, 2.0f,   1.0f};

// Distinct non-zero values, so the decoded support is visible.
std::vector<float> ramp(size_t n) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i + 1);
  return x;
}

std::vector<size_t> support(const std::vector<float>& decoded) {
  std::vector<size_t> s;
  for (size_t i = 0; i < decoded.size(); ++i) {
    if (decoded[i] != 0.0f) s.push_back(i);
  }
  return s;
}

TEST(RandomK, GoldenBytes) {
  auto codec = make_codec("randomk:k=4");
  const Context ctx{.seed = 3, .bucket = 1, .step = 2, .rank = 5};
  const auto frame = encode(*codec, kRandomkSmall, ctx);
  // Strata [0,5) [5,10) [10,15) [15,20); the documented draw lo + below(j, 5) of
  // CounterRng(seed, bucket, step, kSharedRank, 0) picks 3, 8, 11, 19: x = 2, 3, 0.125, 1.
  const CounterRng rng(3, 1, 2, CounterRng::kSharedRank, 0);
  std::vector<uint32_t> picks;
  for (uint32_t j = 0; j < 4; ++j) picks.push_back(5 * j + rng.below(j, 5));
  EXPECT_EQ(picks, (std::vector<uint32_t>{3, 8, 11, 19}));
  const std::string payload = "00000040" "00004040" "0000003e" "0000803f";
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes)), payload);
  // magic, version 1, codec 13, round 0, flags 0, hash, 1 summand, n = 20, 16 payload bytes.
  EXPECT_EQ(hex(frame), "4743465201" "0d0000" "6aab195f" "01000000" "1400000000000000"
                        "1000000000000000" "00000000" "6d55decd" + payload);
  EXPECT_EQ(read_frame_header(frame).param_hash, fnv1a32("randomk:k=4,unbiased=false"));
}

TEST(RandomK, OneIndexPerStratumSharedByEveryRank) {
  const size_t n = 1000, k = 7;
  auto codec = make_codec("randomk:k=7");
  std::vector<size_t> first;
  for (uint32_t rank = 0; rank < 4; ++rank) {
    const Context ctx{.seed = 11, .bucket = 2, .step = 5, .rank = rank, .world_size = 4};
    const auto s = support(decode(*codec, encode(*codec, ramp(n), ctx), n, ctx));
    ASSERT_EQ(s.size(), k);
    for (size_t j = 0; j < k; ++j) {
      EXPECT_GE(s[j], j * n / k);
      EXPECT_LT(s[j], (j + 1) * n / k);
    }
    if (rank == 0) first = s;
    EXPECT_EQ(s, first) << "rank " << rank;
  }
  // Another step or seed draws other indices.
  const auto other = support(decode(*codec, encode(*codec, ramp(n), {.seed = 11, .bucket = 2, .step = 6}),
                                    n, {.seed = 11, .bucket = 2, .step = 6}));
  EXPECT_NE(other, first);
}

// The documented draw, computed with plain divisions, for strata smaller and larger than the
// encoder's sub-blocks (4096) and chunks (65536), on one and two threads, in place or not.
TEST(RandomK, IndicesFollowTheDocumentedFormula) {
  for (auto [n, k] : {std::pair<size_t, size_t>{200003, 7}, {200003, 3000}, {200003, 200003},
                      {131072, 2}, {70000, 69999}}) {
    const Context ctx{.seed = 21, .bucket = 4, .step = 8};
    const CounterRng rng(21, 4, 8, CounterRng::kSharedRank, 0);
    std::vector<size_t> expected;
    for (uint64_t j = 0; j < k; ++j) {
      const uint64_t lo = j * n / k, size = (j + 1) * n / k - lo;
      expected.push_back(lo + rng.below(static_cast<uint32_t>(j), static_cast<uint32_t>(size)));
    }
    auto codec = make_codec("randomk:k=" + std::to_string(k));
    const auto x = ramp(n);
    const auto frame = encode(*codec, x, ctx);
    ASSERT_EQ(support(decode(*codec, frame, n, ctx)), expected) << "n " << n << " k " << k;
    for (int threads : {1, 2}) {
      Context c = ctx;
      c.threads = threads;
      auto in_place = x;
      ASSERT_EQ(encode(*codec, in_place, c, in_place), frame);
      for (size_t i : expected) in_place[i] = x[i];  // undo the zeroed entries
      ASSERT_EQ(in_place, x);
    }
  }
}

TEST(RandomK, SummedFramesDecodeToTheSumOfTheSampledValues) {
  const size_t n = 5000;
  auto codec = make_codec("randomk:ratio=0.02");
  std::vector<std::vector<float>> inputs;
  for (uint64_t r = 0; r < 3; ++r) inputs.push_back(gradient(n, 40 + r));
  const Context ctx{.seed = 8, .step = 3, .world_size = 3};
  auto frame = encode(*codec, inputs[0], ctx);
  for (uint32_t r = 1; r < 3; ++r) {
    Context c = ctx;
    c.rank = r;
    reduce_frame_into(frame, encode(*codec, inputs[r], c), DType::kF32, ReduceOp::kSum);
  }
  const auto summed = decode(*codec, frame, n, ctx);
  const auto s = support(decode(*codec, encode(*codec, ramp(n), ctx), n, ctx));
  ASSERT_EQ(s.size(), 100u);
  size_t at = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool sampled = at < s.size() && s[at] == i;
    const float expected = sampled ? inputs[0][i] + inputs[1][i] + inputs[2][i] : 0.0f;
    EXPECT_FLOAT_EQ(summed[i], expected) << i;
    at += sampled;
  }
  // The reference allreduce route gives the mean of the same frames.
  const auto mean = testing::aggregate_allreduce("randomk:ratio=0.02", inputs, ctx);
  for (size_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(mean[i], summed[i] / 3.0f) << i;
}

TEST(RandomK, EachElementIsSelectedWithProbabilityOneOverItsStratum) {
  // n = 10, k = 3: strata [0,3) [3,6) [6,10), probabilities 1/3, 1/3, 1/4.
  auto codec = make_codec("randomk:k=3");
  const size_t steps = 30000;
  std::vector<double> hits(10, 0.0);
  for (uint64_t step = 0; step < steps; ++step) {
    const Context ctx{.seed = 4, .step = step};
    const auto s = support(decode(*codec, encode(*codec, ramp(10), ctx), 10, ctx));
    ASSERT_EQ(s.size(), 3u);
    for (size_t i : s) hits[i] += 1;
  }
  for (size_t i = 0; i < 10; ++i) {
    const double p = i < 6 ? 1.0 / 3 : 0.25;
    const double sigma = std::sqrt(p * (1 - p) / steps);
    EXPECT_NEAR(hits[i] / steps, p, 5 * sigma) << "element " << i;
  }
}

TEST(RandomK, UnbiasedScalingMakesTheMeanDecodeTheInput) {
  const size_t n = 50;
  const auto x = gradient(n, 6);
  auto codec = make_codec("randomk:k=7,unbiased=true");
  EXPECT_TRUE(codec->traits().unbiased);
  const size_t steps = 40000;
  std::vector<double> mean(n, 0.0);
  for (uint64_t step = 0; step < steps; ++step) {
    const Context ctx{.seed = 2, .step = step};
    const auto d = decode(*codec, encode(*codec, x, ctx), n, ctx);
    for (size_t i = 0; i < n; ++i) mean[i] += d[i];
  }
  for (size_t i = 0; i < n; ++i) {
    // Var of one draw: x^2 (size - 1), size 7 or 8.
    const double sigma = std::fabs(x[i]) * std::sqrt(7.0 / steps);
    EXPECT_NEAR(mean[i] / steps, x[i], 5 * sigma + 1e-6) << "element " << i;
  }
  // Without scaling the sent values are the raw ones.
  auto raw = make_codec("randomk:k=7");
  EXPECT_FALSE(raw->traits().unbiased);
  const auto d = decode(*raw, encode(*raw, x), n);
  for (size_t i = 0; i < n; ++i) EXPECT_TRUE(d[i] == 0.0f || d[i] == x[i]);
}

TEST(RandomK, ResidualIsInputMinusDecoded) {
  const size_t n = 3001;
  const auto x = gradient(n, 9);
  for (const char* spec : {"randomk:ratio=0.03", "randomk:ratio=0.03,unbiased=true"}) {
    auto codec = make_codec(spec);
    std::vector<float> residual(n);
    const auto frame = encode(*codec, x, {.seed = 1}, residual);
    const auto d = decode(*codec, frame, n, {.seed = 1});
    auto in_place = x;
    EXPECT_EQ(encode(*codec, in_place, {.seed = 1}, in_place), frame);
    EXPECT_EQ(in_place, residual);
    for (size_t i = 0; i < n; ++i) {
      if (d[i] == 0.0f) {
        EXPECT_EQ(residual[i], x[i]);
      } else {
        EXPECT_EQ(residual[i], x[i] - d[i]) << spec << " " << i;
      }
    }
  }
}

TEST(RandomK, NonFiniteInputFlagsTheFrameAndPoisonsTheDecode) {
  const size_t n = 1000;
  auto codec = make_codec("randomk:ratio=0.01");
  auto x = gradient(n, 3);
  EXPECT_EQ(read_frame_header(encode(*codec, x)).flags, 0);
  x[500] = std::numeric_limits<float>::infinity();
  for (int threads : {1, 2}) {
    const Context ctx{.threads = threads};
    std::vector<float> residual(n);
    const auto frame = encode(*codec, x, ctx, residual);
    EXPECT_EQ(read_frame_header(frame).flags, kFlagNonFinite);
    for (float v : decode(*codec, frame, n, ctx)) EXPECT_TRUE(std::isnan(v));
  }
}

TEST(RandomK, CanonicalSpecAndTraits) {
  EXPECT_EQ(make_codec("randomk")->spec(), "randomk:ratio=0.01,unbiased=false");
  EXPECT_EQ(make_codec("randomk:unbiased=1,k=3")->spec(), "randomk:k=3,unbiased=true");
  const CodecTraits t = make_codec("randomk:ratio=0.01")->traits();
  EXPECT_TRUE(t.summable);
  EXPECT_EQ(t.payload_type, DType::kF32);
  EXPECT_TRUE(t.shared_randomness);
  EXPECT_DOUBLE_EQ(t.bits_per_element, 0.32);
  EXPECT_EQ(make_codec("randomk:ratio=0.01")->max_frame_bytes(1000), kFrameHeaderBytes + 40);
}

TEST(RandomK, BadSpecsNameCodecAndParameter) {
  const std::string range = error_text([] { make_codec("randomk:ratio=2"); });
  EXPECT_NE(range.find("codec 'randomk': parameter 'ratio' = 2 is out of range"), std::string::npos)
      << range;
  const std::string both = error_text([] { make_codec("randomk:ratio=0.5,k=2"); });
  EXPECT_NE(both.find("codec 'randomk'"), std::string::npos) << both;
  EXPECT_NE(both.find("'ratio' and 'k'"), std::string::npos) << both;
  const std::string flag = error_text([] { make_codec("randomk:unbiased=maybe"); });
  EXPECT_NE(flag.find("parameter 'unbiased'"), std::string::npos) << flag;
  auto codec = make_codec("randomk:k=30");
  const std::string big = error_text([&] { encode(*codec, kRandomkSmall); });
  EXPECT_NE(big.find("codec 'randomk': parameter 'k' = 30 exceeds the tensor's 20 elements"),
            std::string::npos) << big;
}

TEST(RandomK, ZeroKAndEmptyInput) {
  auto codec = make_codec("randomk:k=0");
  auto x = kRandomkSmall;
  x[3] = std::numeric_limits<float>::quiet_NaN();
  const auto frame = encode(*codec, x);
  EXPECT_EQ(read_frame_header(frame).payload_bytes, 0u);
  EXPECT_TRUE(std::isnan(decode(*codec, frame, x.size())[0]));  // the flag still carries NaN
  auto ratio = make_codec("randomk");
  EXPECT_EQ(read_frame_header(encode(*ratio, std::vector<float>{})).payload_bytes, 0u);
}

TEST(RandomK, DecoderRejectsAPayloadOfTheWrongLength) {
  auto codec = make_codec("randomk:k=4");
  for (size_t bytes : {size_t{0}, size_t{12}, size_t{17}, size_t{20}}) {
    std::vector<std::byte> f(kFrameHeaderBytes + bytes, std::byte{0});
    write_frame_header({.codec_id = static_cast<uint8_t>(codec->id()), .param_hash = codec->param_hash(),
                        .elements = 20, .payload_bytes = bytes},
                       f);
    std::vector<float> sum(20, 1.0f);
    const std::string text = error_text([&] { codec->decode_accumulate(f, sum, {}); });
    EXPECT_NE(text.find("randomk: payload of " + std::to_string(bytes) + " bytes"), std::string::npos)
        << text;
    EXPECT_EQ(sum, std::vector<float>(20, 1.0f));
  }
}

}  // namespace
}  // namespace gradcomp
