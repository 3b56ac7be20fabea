// none: float32 as is.
#include <gtest/gtest.h>

#include <cmath>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

TEST(None, GoldenBytes) {
  auto codec = make_codec("none");
  const std::vector<float> x = {1.0f, -2.5f, 0.0f};
  const auto frame = testing::encode(*codec, x);
  // Header: "GCFR", version 1, codec id 1, round 0, flags 0; then the parameter hash.
  EXPECT_EQ(testing::hex(std::span(frame).first(8)), "4743465201010000");
  EXPECT_EQ(read_frame_header(frame).param_hash, fnv1a32("none"));
  EXPECT_EQ(testing::hex(std::span(frame).subspan(12, 24)),
            "01000000"                   // summands 1
            "0300000000000000"           // 3 elements
            "0c00000000000000"           // 12 payload bytes
            "00000000");                 // aux
  EXPECT_EQ(testing::hex(std::span(frame).subspan(kFrameHeaderBytes)),
            "0000803f" "000020c0" "00000000");  // 1.0, -2.5, 0.0
}

TEST(None, IsLosslessAndAccumulates) {
  auto codec = make_codec("none");
  const auto x = testing::gradient(1001, 3);
  std::vector<float> sum(x.size(), 1.0f), residual(x.size(), 7.0f);
  codec->decode_accumulate(testing::encode(*codec, x, {}, residual), sum, {});
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(sum[i], 1.0f + x[i]);
    ASSERT_EQ(residual[i], 0.0f);
  }
}

TEST(None, RejectsAPayloadOfTheWrongLength) {
  auto codec = make_codec("none");
  std::vector<std::byte> frame(kFrameHeaderBytes + 8);
  write_frame_header({.codec_id = 1, .param_hash = fnv1a32("none"), .elements = 3,
                      .payload_bytes = 8},
                     frame);
  std::vector<float> sum(3);
  EXPECT_THROW(codec->decode_accumulate(frame, sum, {}), FrameError);
}

TEST(None, NoParameters) {
  EXPECT_THROW(make_codec("none:ratio=0.5"), SpecError);
  EXPECT_EQ(make_codec("none")->spec(), "none");
}

}  // namespace
}  // namespace gradcomp
