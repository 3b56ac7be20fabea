// signsgd: golden bytes, the bit convention (x < 0 -> 1, zero -> +), decoded +-1, the majority
// vote (ties give 0), the fused residual, the non-finite flag, bad frames and specs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::decode;
using testing::encode;
using testing::hex;

const std::vector<float> kGolden = {0.5f,  -1.0f,  0.0f, -0.0f, 2.0f,  -3.0f, -0.1f,
                                    4.0f,  1e-3f,  -1e-3f, 7.0f, -7.0f, 0.25f, 0.25f,
                                    -2.0f, 9.0f,   -1.0f, 1.0f,  -5.0f, 0.0f};

TEST(SignSgd, GoldenBytes) {
  auto codec = make_codec("signsgd");
  const Context ctx{.seed = 3, .bucket = 1, .step = 5, .rank = 2, .world_size = 4};
  const auto frame = encode(*codec, kGolden, ctx);
  // Header: codec 8, flags 0, FNV-1a("signsgd"), n = 20, 3 payload bytes. Payload, LSB-first:
  // byte 0 has elements 1, 5, 6 negative (0x62; 0 and -0 are +), byte 1 has 9, 11, 14 (0x4a),
  // byte 2 has 16 and 18 (0x05), its bits 4..7 padding.
  EXPECT_EQ(hex(frame),
            "4743465201080000b6bd386f0100000014000000000000000300000000000000000000007eac5a46"
            "624a05");
  const auto back = decode(*codec, frame, kGolden.size(), ctx);
  for (size_t i = 0; i < kGolden.size(); ++i) {
    EXPECT_EQ(back[i], kGolden[i] < 0 ? -1.0f : 1.0f) << i;
  }
}

TEST(SignSgd, ResidualIsInputMinusSign) {
  auto codec = make_codec("signsgd");
  const auto x = testing::gradient(1001, 3);
  std::vector<float> residual(x.size());
  encode(*codec, x, {}, residual);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(residual[i], x[i] - (x[i] < 0 ? -1.0f : 1.0f)) << i;
  }
}

TEST(SignSgd, MajorityVoteWithTies) {
  // Three ranks: the vote is the majority. Two ranks that disagree: a tie gives 0.
  const std::vector<std::vector<float>> three = {{1, -1, 2, -3, 0}, {1, 1, -2, -3, -1},
                                                 {-1, -1, -2, 3, -1}};
  EXPECT_EQ(testing::aggregate_allreduce("signsgd", three),
            (std::vector<float>{1, -1, -1, -1, -1}));
  const std::vector<std::vector<float>> two = {{1, -1, 5, -0.5f}, {-1, -1, 5, 0.5f}};
  EXPECT_EQ(testing::aggregate_allreduce("signsgd", two), (std::vector<float>{0, -1, 1, 0}));
}

TEST(SignSgd, NonFiniteInputSetsTheFlagAndDecodesToNan) {
  auto codec = make_codec("signsgd");
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto x = testing::gradient(70000, 4);  // two chunks; the bad value in the second
    x[69999] = bad;
    const auto frame = encode(*codec, x, Context{.threads = 2});
    EXPECT_EQ(read_frame_header(frame).flags, kFlagNonFinite);
    const auto back = decode(*codec, frame, x.size());
    EXPECT_TRUE(std::isnan(back[0]) && std::isnan(back[69999]));
    std::vector<float> sum = back;
    codec->finalize(sum, 3);
    EXPECT_TRUE(std::isnan(sum[5]));  // the vote keeps the NaN for the loss scaler
  }
  EXPECT_EQ(read_frame_header(encode(*codec, testing::gradient(100, 4))).flags, 0);
}

TEST(SignSgd, RejectsMalformedFrames) {
  auto codec = make_codec("signsgd");
  const auto frame = encode(*codec, kGolden);
  using testing::edited;
  auto padded = frame;
  padded.back() |= std::byte{0x10};  // element 20 does not exist
  testing::expect_frame_error(*codec, padded, 20, "padding bits");
  testing::expect_frame_error(*codec, edited(frame, [](FrameHeader& h) { h.summands = 2; }), 20,
                              "cannot be summed");
  testing::expect_frame_error(*codec, edited(frame, [](FrameHeader& h) { h.payload_bytes = 4; }),
                              20, "payload is 4 bytes");
  testing::expect_frame_error(*codec, edited(frame, [](FrameHeader& h) { h.flags = 4; }), 20,
                              "unknown bits");
}

TEST(SignSgd, SpecAndTraits) {
  EXPECT_EQ(make_codec("signsgd")->spec(), "signsgd");
  testing::expect_spec_error("signsgd:scale=mean", {"codec 'signsgd'", "'scale'"});
  const auto t = make_codec("signsgd")->traits();
  EXPECT_FALSE(t.summable);
  EXPECT_FALSE(t.unbiased);
  EXPECT_EQ(t.aggregation, Aggregation::kMajorityVote);
  EXPECT_EQ(t.bits_per_element, 1);
  EXPECT_EQ(make_codec("signsgd")->max_frame_bytes(17), kFrameHeaderBytes + 3);
}

// The buffer checks every cast and sign codec makes before it writes anything.
TEST(CastAndSignCodecs, RejectBadBuffers) {
  for (const char* spec : {"fp16", "bf16", "signsgd", "efsignsgd", "signum", "onebit"}) {
    auto codec = make_codec(spec);
    const auto x = testing::gradient(100, 5);
    std::vector<std::byte> small(codec->max_frame_bytes(x.size()) - 1);
    EXPECT_THROW(codec->encode(x, small, {}), Error) << spec;
    std::vector<std::byte> out(codec->max_frame_bytes(x.size()));
    std::vector<float> residual(99);
    EXPECT_THROW(codec->encode(x, out, {}, residual), Error) << spec;
    EXPECT_TRUE(codec->save_state().empty()) << spec << ": a failed encode changed the state";
  }
}

}  // namespace
}  // namespace gradcomp
