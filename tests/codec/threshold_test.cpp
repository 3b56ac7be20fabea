// threshold: golden bytes, exactly the elements with |x| >= tau (boundaries in double
// semantics), NaN and Inf always sent, variable count within the bound, spec errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "codec/sparse_reference.h"
#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/spec.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::decode;
using testing::encode;
using testing::error_text;
using testing::gradient;
using testing::hex;
using testing::parse_sparse_payload;

const std::vector<float> kThresholdSmall = {0.5f,  -1.0f, 0.0f, 2.0f,   -2.0f,  0.25f, 1.0f,
                                            -0.5f, 3.0f,  0.0f, -3.0f,  0.125f, 1.5f,  -1.5f,
                                            0.75f, -2.0f, 0.0f, -0.25f, 2.0f,   1.0f};

TEST(Threshold, GoldenBytes) {
  auto codec = make_codec("threshold:tau=2");
  const auto frame = encode(*codec, kThresholdSmall, {.seed = 3});
  // |x| >= 2 (the boundary included): 3, 4, 8, 10, 15, 18.
  const std::string payload =
      "06000000" "03000000" "04000000" "08000000" "0a000000" "0f000000" "12000000"
      "00000040" "000000c0" "00004040" "000040c0" "000000c0" "00000040";
  // magic, version 1, codec 15, round 0, flags 0, hash, 1 summand, n = 20, 52 payload bytes.
  EXPECT_EQ(hex(frame), "4743465201" "0f0000" "0f124810" "01000000" "1400000000000000"
                        "3400000000000000" "00000000" "b487c297" + payload);
  EXPECT_EQ(read_frame_header(frame).param_hash, fnv1a32("threshold:tau=2"));
}

TEST(Threshold, SendsExactlyTheElementsAtOrAboveTau) {
  for (size_t n : {size_t{1}, size_t{100}, size_t{65536 * 3 + 5}}) {
    const auto x = gradient(n, n);
    for (double tau : {0.001, 0.1, 1.0, 2.5, 10.0}) {
      auto codec = make_codec("threshold:tau=" + format_number(tau));
      std::vector<float> residual(n);
      const auto frame = encode(*codec, x, {.threads = 2}, residual);
      EXPECT_LE(frame.size(), codec->max_frame_bytes(n));
      const auto p = parse_sparse_payload(frame);
      std::vector<uint32_t> expected;
      for (uint32_t i = 0; i < n; ++i) {
        if (std::fabs(static_cast<double>(x[i])) >= tau) expected.push_back(i);
      }
      ASSERT_EQ(p.indices, expected) << "n " << n << " tau " << tau;
      const auto d = decode(*codec, frame, n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(d[i] + residual[i], x[i]);
        ASSERT_TRUE(d[i] == 0.0f || residual[i] == 0.0f);
      }
    }
  }
}

TEST(Threshold, BoundaryFollowsDoubleTau) {
  // 0.1 is not a float: 0.1f = 0.100000001 >= 0.1 is sent, the float below it is not.
  const float above = 0.1f, below = std::nextafter(0.1f, 0.0f);
  auto codec = make_codec("threshold:tau=0.1");
  const auto p = parse_sparse_payload(encode(*codec, std::vector<float>{below, -above, -below, above}));
  EXPECT_EQ(p.indices, (std::vector<uint32_t>{1, 3}));
  // A tau below the smallest float still leaves zeros out.
  auto tiny = make_codec("threshold:tau=1e-60");
  const auto q = parse_sparse_payload(encode(*tiny, std::vector<float>{0.0f, 1e-45f, -0.0f}));
  EXPECT_EQ(q.indices, (std::vector<uint32_t>{1}));
}

TEST(Threshold, NonFiniteIsAlwaysSent) {
  std::vector<float> x = {1.0f, std::numeric_limits<float>::quiet_NaN(), 3e38f,
                          -std::numeric_limits<float>::infinity(), 0.0f};
  for (const char* spec : {"threshold:tau=1e30", "threshold:tau=1e300"}) {
    auto codec = make_codec(spec);
    const auto p = parse_sparse_payload(encode(*codec, x));
    const std::vector<uint32_t> expected =
        std::string(spec) == "threshold:tau=1e30" ? std::vector<uint32_t>{1, 2, 3}
                                                  : std::vector<uint32_t>{1, 3};
    EXPECT_EQ(p.indices, expected) << spec;
    const auto d = decode(*codec, encode(*codec, x), x.size());
    EXPECT_TRUE(std::isnan(d[1]));
    EXPECT_EQ(d[3], -std::numeric_limits<float>::infinity());
  }
}

TEST(Threshold, NothingAboveGivesAnEmptyPayload) {
  auto codec = make_codec("threshold:tau=100");
  const auto frame = encode(*codec, kThresholdSmall);
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes)), "00000000");
  EXPECT_EQ(decode(*codec, frame, kThresholdSmall.size()),
            std::vector<float>(kThresholdSmall.size(), 0.0f));
  EXPECT_EQ(codec->max_frame_bytes(20), kFrameHeaderBytes + 4 + 160);
}

TEST(Threshold, SpecIsRequiredAndChecked) {
  const std::string missing = error_text([] { make_codec("threshold"); });
  EXPECT_NE(missing.find("codec 'threshold': parameter 'tau' is required"), std::string::npos)
      << missing;
  for (const char* bad : {"threshold:tau=0", "threshold:tau=-1", "threshold:tau=inf",
                          "threshold:tau=abc"}) {
    const std::string text = error_text([&] { make_codec(bad); });
    EXPECT_NE(text.find("codec 'threshold': parameter 'tau'"), std::string::npos) << text;
  }
  EXPECT_EQ(make_codec("threshold:tau=0.5")->spec(), "threshold:tau=0.5");
  EXPECT_FALSE(make_codec("threshold:tau=0.5")->traits().summable);
}

}  // namespace
}  // namespace gradcomp
