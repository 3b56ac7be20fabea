// signum: golden bytes over two steps (the momentum carries over), the momentum recursion,
// the residual g - sign(m), the majority vote, NaN/Inf that leave the momentum untouched, state
// save/load and its validation, a change of length, specs.
#include <gtest/gtest.h>

#include <bit>
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

// The momentum from a saved state.
std::vector<float> momentum_of(const Codec& codec) {
  const auto state = codec.save_state();
  std::vector<float> m((state.size() - 16) / 4);
  std::memcpy(m.data(), state.data() + 16, 4 * m.size());
  return m;
}

TEST(Signum, GoldenBytesOverTwoSteps) {
  auto codec = make_codec("signum");
  EXPECT_EQ(codec->spec(), "signum:momentum=0.9");
  const std::vector<float> g1 = {0.5f,  -1.0f,  0.0f, -0.0f, 2.0f,  -3.0f, -0.1f,
                                 4.0f,  1e-3f,  -1e-3f, 7.0f, -7.0f, 0.25f, 0.25f,
                                 -2.0f, 9.0f,   -1.0f, 1.0f,  -5.0f, 0.0f};
  const std::vector<float> g2 = {-0.1f, 0.5f, 1.0f, -1.0f, -3.0f, 2.0f,  0.2f,  -5.0f, 0.0f, 0.0f,
                                 -8.0f, 8.0f, 0.0f, -0.25f, 1.0f, -9.5f, 1.0f, -1.0f, 6.0f, -1e-3f};
  Context ctx{.seed = 3, .bucket = 1, .step = 5, .rank = 2, .world_size = 4};
  // Step 1 from zero momentum: m = 0.1 g1, so the bits are g1's: 62 4a 05.
  EXPECT_EQ(hex(encode(*codec, g1, ctx)),
            "47434652010a000076a7dcff010000001400000000000000030000000000000000000000d760996b"
            "624a05");
  // Step 2: m = 0.9 m + 0.1 g2 is negative at 1, 3, 4, 5, 7 (0xba); 9, 10, 13, 14, 15 (0xe6);
  // 17, 19 (0x0a). E.g. element 0: 0.045 - 0.01 > 0; element 2: 0 + 0.1 > 0.
  ctx.step = 6;
  EXPECT_EQ(hex(encode(*codec, g2, ctx)),
            "47434652010a000076a7dcff010000001400000000000000030000000000000000000000d760996b"
            "bae60a");
}

TEST(Signum, MomentumFollowsTheRecursion) {
  auto codec = make_codec("signum:momentum=0.75");
  const auto g1 = testing::gradient(1000, 61), g2 = testing::gradient(1000, 62);
  encode(*codec, g1);
  std::vector<float> residual(g2.size());
  const auto frame = encode(*codec, g2, {}, residual);
  const auto m = momentum_of(*codec);
  const auto back = decode(*codec, frame, g2.size());
  for (size_t i = 0; i < g2.size(); ++i) {
    const float m1 = std::fma(0.75f, 0.0f, 0.25f * g1[i]);
    const float m2 = std::fma(0.75f, m1, 0.25f * g2[i]);
    ASSERT_EQ(m[i], m2) << i;
    ASSERT_EQ(back[i], m2 < 0 ? -1.0f : 1.0f) << i;
    ASSERT_EQ(residual[i], g2[i] - back[i]) << i;
  }
}

TEST(Signum, ZeroMomentumIsSignSgd) {
  auto signum = make_codec("signum:momentum=0");
  auto signsgd = make_codec("signsgd");
  const auto g = testing::gradient(333, 63);
  encode(*signum, testing::gradient(333, 64));  // history that beta = 0 forgets
  const auto a = encode(*signum, g), b = encode(*signsgd, g);
  EXPECT_EQ(std::vector(a.begin() + kFrameHeaderBytes, a.end()),
            std::vector(b.begin() + kFrameHeaderBytes, b.end()));
}

TEST(Signum, MajorityVoteAcrossRanks) {
  const std::vector<std::vector<float>> inputs = {{1, -1, 2, 0.5f}, {1, 1, -2, -0.5f},
                                                  {-1, -1, -2, 0.5f}, {3, 2, 1, -0.5f}};
  // Each rank's first step sends sign(0.1 g); 4 ranks: +3-1, -1+1-1+1, +1-1-1+1, +1-1+1-1.
  EXPECT_EQ(testing::aggregate_allreduce("signum", inputs), (std::vector<float>{1, 0, 0, 0}));
}

TEST(Signum, NonFiniteGradientLeavesTheMomentumAndSetsTheFlag) {
  auto codec = make_codec("signum");
  const auto g = testing::gradient(100, 65);
  encode(*codec, g);
  const auto before = momentum_of(*codec);
  auto bad = g;
  bad[7] = std::numeric_limits<float>::quiet_NaN();
  bad[8] = -std::numeric_limits<float>::infinity();
  const auto frame = encode(*codec, bad);
  EXPECT_EQ(read_frame_header(frame).flags, kFlagNonFinite);
  for (float v : decode(*codec, frame, g.size())) EXPECT_TRUE(std::isnan(v));
  const auto after = momentum_of(*codec);
  EXPECT_EQ(after[7], before[7]);
  EXPECT_EQ(after[8], before[8]);
  EXPECT_NE(after[9], before[9]);  // finite elements took the step
  // The next finite step is clean again.
  EXPECT_EQ(read_frame_header(encode(*codec, g)).flags, 0);
}

TEST(Signum, StateRoundTripsAndIsValidated) {
  auto codec = make_codec("signum");
  EXPECT_TRUE(codec->save_state().empty());  // nothing before the first encode
  const auto g = testing::gradient(50, 66);
  encode(*codec, g);
  const auto state = codec->save_state();
  ASSERT_EQ(state.size(), 16u + 4 * 50);
  EXPECT_EQ(hex(std::span(state).first(16)), "53474e4d010000003200000000000000");
  auto copy = make_codec("signum");
  copy->load_state(state);
  EXPECT_EQ(encode(*copy, g), encode(*codec, g));

  auto expect_error = [&](std::vector<std::byte> bad, const std::string& needle) {
    try {
      copy->load_state(bad);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("signum"), std::string::npos) << e.what();
    }
  };
  expect_error(std::vector(state.begin(), state.begin() + 10), "truncated");
  auto magic = state;
  magic[0] = std::byte{'X'};
  expect_error(magic, "magic");
  auto version = state;
  version[4] = std::byte{2};
  expect_error(version, "version 2");
  expect_error(std::vector(state.begin(), state.end() - 4), "announces 50");
  auto odd = state;
  odd.push_back(std::byte{0});
  expect_error(odd, "announces 50");

  copy->load_state({});  // back to no momentum: the next step starts from zeros
  auto fresh = make_codec("signum");
  EXPECT_EQ(encode(*copy, g), encode(*fresh, g));
}

TEST(Signum, AnotherLengthIsAnErrorThatKeepsTheMomentum) {
  auto codec = make_codec("signum");
  encode(*codec, testing::gradient(40, 67));
  const auto before = momentum_of(*codec);
  try {
    encode(*codec, testing::gradient(24, 68));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("momentum holds 40 elements but the input has 24"),
              std::string::npos) << e.what();
  }
  EXPECT_EQ(momentum_of(*codec), before);
}

TEST(Signum, BadSpecsNameTheParameter) {
  testing::expect_spec_error("signum:momentum=1", {"codec 'signum'", "'momentum'", "[0, 1)"});
  testing::expect_spec_error("signum:momentum=-0.1", {"codec 'signum'", "'momentum'"});
  testing::expect_spec_error("signum:momentum=fast", {"codec 'signum'", "'momentum'"});
  EXPECT_EQ(make_codec("signum:momentum=0.5")->spec(), "signum:momentum=0.5");
  EXPECT_NE(make_codec("signum:momentum=0.5")->param_hash(), make_codec("signum")->param_hash());
  const auto t = make_codec("signum")->traits();
  EXPECT_EQ(t.aggregation, Aggregation::kMajorityVote);
  EXPECT_FALSE(t.shardable);
  EXPECT_FALSE(t.summable);
}

}  // namespace
}  // namespace gradcomp
