// qsgd: wire layout (golden bytes), error bound, unbiasedness, blocks, spec errors, rejection of
// corrupt payloads, special inputs.
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

const std::vector<float> kQsgdSmall = {0.5f,  -1.25f, 0.0f,  2.0f,  -0.75f, 0.125f, 3.0f,  -2.5f,
                                       1.0f,  -0.1f,  0.3f,  -3.5f, 0.9f,   -0.02f, 1.75f, 0.6f,
                                       -4.0f, 0.25f,  -0.5f, 1.5f,  0.0f,   -1.0f,  2.25f, 0.05f};

TEST(Qsgd, GoldenBytesAtAFixedSeed) {
  auto codec = make_codec("qsgd:levels=4,block=16");
  const Context ctx{.seed = 1234, .bucket = 1, .step = 2, .rank = 0};
  const auto frame = encode(*codec, kQsgdSmall, ctx);
  // 2 norms (blocks of 16 and 8) + 24 codes of 4 bits (level << 1 | sign) = 8 + 12 bytes.
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + 20);
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes)),
            "6c69c840b4cd9e40304003341070102409233004");
  // Checked by hand: norm 0 = 0x40c8696c = 6.2628 = sqrt(39.2235), norm 1 = 0x409ecdb4 = 4.9626;
  // code byte 0x30 = element 0 (0.5 -> v 0.32) level 0, element 1 (-1.25 -> v 0.80) level 1
  // with the sign bit; byte 0x40 = element 2 (0) zero, element 3 (2.0 -> v 1.28) level 2.
  // The same layout, checked in general: the norms are the L2 norms of each block...
  double sq0 = 0, sq1 = 0;
  for (size_t i = 0; i < 16; ++i) sq0 += double(kQsgdSmall[i]) * kQsgdSmall[i];
  for (size_t i = 16; i < 24; ++i) sq1 += double(kQsgdSmall[i]) * kQsgdSmall[i];
  EXPECT_EQ(testing::payload_f32(frame, 0), static_cast<float>(std::sqrt(sq0)));
  EXPECT_EQ(testing::payload_f32(frame, 4), static_cast<float>(std::sqrt(sq1)));
  // ...and each 4-bit code, LSB-first, holds the sign and a level next to |x| / norm * 4.
  BitReader reader(frame.data() + kFrameHeaderBytes + 8, 12, 4);
  for (size_t i = 0; i < kQsgdSmall.size(); ++i) {
    const uint32_t code = reader.get();
    const float norm = testing::payload_f32(frame, i < 16 ? 0 : 4);
    const float v = std::fabs(kQsgdSmall[i]) / norm * 4;
    const uint32_t level = code >> 1;
    EXPECT_TRUE(level == static_cast<uint32_t>(std::floor(v)) ||
                level == static_cast<uint32_t>(std::ceil(v)))
        << i << ": level " << level << " for " << v;
    EXPECT_EQ(code & 1, std::signbit(kQsgdSmall[i]) ? 1u : 0u) << i;
  }
  const FrameHeader h = read_frame_header(frame);
  EXPECT_EQ(h.elements, kQsgdSmall.size());
  EXPECT_EQ(h.payload_bytes, 20u);
  EXPECT_EQ(h.flags, 0);
}

TEST(Qsgd, CanonicalSpecSpellsOutTheDefaults) {
  EXPECT_EQ(make_codec("qsgd")->spec(), "qsgd:levels=15,block=0");
  EXPECT_EQ(make_codec("qsgd:block=1000000,levels=7")->spec(), "qsgd:levels=7,block=1000000");
  EXPECT_EQ(make_codec(make_codec("qsgd:block=1000000")->spec())->spec(),
            "qsgd:levels=15,block=1000000");
}

TEST(Qsgd, BadSpecsNameTheParameter) {
  testing::expect_spec_error("qsgd:levels=0", {"codec 'qsgd'", "parameter 'levels'", "allowed"});
  testing::expect_spec_error("qsgd:levels=32769",
                             {"codec 'qsgd'", "parameter 'levels'", "allowed"});
  testing::expect_spec_error("qsgd:levels=2.5", {"codec 'qsgd'", "parameter 'levels'", "allowed"});
  testing::expect_spec_error("qsgd:block=-1", {"codec 'qsgd'", "parameter 'block'", "allowed"});
  testing::expect_spec_error("qsgd:block=x", {"codec 'qsgd'", "parameter 'block'", "allowed"});
}

TEST(Qsgd, WireWidthIsSignPlusCeilLog2OfLevelsPlusOne) {
  const auto x = gradient(1000, 3);
  for (uint32_t s : {1u, 2u, 3u, 4u, 7u, 8u, 15u, 16u, 255u, 256u, 1000u, 32768u}) {
    const unsigned width = static_cast<unsigned>(std::ceil(std::log2(s + 1.0))) + 1;
    auto codec = make_codec("qsgd:levels=" + std::to_string(s));
    EXPECT_EQ(codec->traits().bits_per_element, width) << s;
    const auto frame = encode(*codec, x);
    EXPECT_EQ(frame.size(), kFrameHeaderBytes + 4 + packed_bytes(x.size(), width)) << s;
  }
}

TEST(Qsgd, DecodedIsWithinOneStepOfTheInput) {
  for (const std::string spec :
       {"qsgd:levels=1", "qsgd:levels=16", "qsgd:levels=32768", "qsgd:levels=5,block=100"}) {
    auto codec = make_codec(spec);
    const auto x = gradient(10000, 21);
    const auto frame = encode(*codec, x, Context{.seed = 5});
    const auto y = decode(*codec, frame, x.size());
    const size_t block = spec.find("block=100") != std::string::npos ? 100 : x.size();
    const float levels = static_cast<float>(std::stoi(spec.substr(spec.find('=') + 1)));
    for (size_t i = 0; i < x.size(); ++i) {
      const float step = testing::payload_f32(frame, 4 * (i / block)) / levels;
      ASSERT_LE(std::fabs(y[i] - x[i]), step * (1 + 1e-5f)) << spec << " element " << i;
      if (y[i] != 0) {
        ASSERT_EQ(std::signbit(y[i]), std::signbit(x[i])) << spec << " " << i;
      }
    }
  }
}

TEST(Qsgd, UnbiasedOverManySteps) {
  auto codec = make_codec("qsgd:levels=4");
  const auto x = gradient(32, 9);
  const int steps = 2000;
  std::vector<double> mean(x.size(), 0.0);
  for (int t = 0; t < steps; ++t) {
    const auto y =
        decode(*codec, encode(*codec, x, Context{.seed = 77, .step = uint64_t(t)}), x.size());
    for (size_t i = 0; i < x.size(); ++i) mean[i] += y[i] / steps;
  }
  double sq = 0;
  for (float v : x) sq += double(v) * v;
  const double step = std::sqrt(sq) / 4;
  // Rounding to one of two points `step` apart has a standard deviation <= step / 2.
  const double tolerance = 5 * (step / 2) / std::sqrt(double(steps));
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(mean[i], x[i], tolerance) << i;
}

TEST(Qsgd, BlocksHaveTheirOwnNorms) {
  auto codec = make_codec("qsgd:levels=8,block=512");
  auto x = gradient(5000, 4);
  for (size_t i = 1024; i < 1536; ++i) x[i] *= 1000;  // one loud block
  const auto frame = encode(*codec, x);
  const size_t blocks = (x.size() + 511) / 512;
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + 4 * blocks + packed_bytes(x.size(), 5));
  for (size_t b = 0; b < blocks; ++b) {
    double sq = 0;
    for (size_t i = 512 * b; i < std::min(x.size(), 512 * (b + 1)); ++i) sq += double(x[i]) * x[i];
    EXPECT_EQ(testing::payload_f32(frame, 4 * b), static_cast<float>(std::sqrt(sq))) << b;
  }
  // The quiet blocks keep their precision despite the loud one.
  const auto y = decode(*codec, frame, x.size());
  for (size_t i = 0; i < 512; ++i) {
    ASSERT_LE(std::fabs(y[i] - x[i]), testing::payload_f32(frame, 0) / 8 * (1 + 1e-5f)) << i;
  }
}

TEST(Qsgd, SameBytesOnAnyThreadCountWithBlocks) {
  const auto x = gradient(300000, 14);
  for (const std::string spec : {"qsgd:levels=16,block=1000", "qsgd:levels=16,block=100000"}) {
    auto codec = make_codec(spec);
    Context one{.seed = 3, .threads = 1}, two{.seed = 3, .threads = 2};
    EXPECT_EQ(encode(*codec, x, one), encode(*codec, x, two)) << spec;
  }
}

TEST(Qsgd, RejectsLevelsAboveS) {
  auto codec = make_codec("qsgd:levels=16");  // 6-bit codes: level field 0..31, allowed 0..16
  const auto x = gradient(100, 2);
  auto frame = encode(*codec, x);
  // Element 99's code is the top 6 bits of the 75-byte code stream: set its level to 17.
  const size_t byte = kFrameHeaderBytes + 4 + (99 * 6) / 8;
  frame[byte] = std::byte{
      static_cast<uint8_t>((std::to_integer<uint8_t>(frame[byte]) & 0x03) | (17 << 1 << 2))};
  std::vector<float> sum(x.size(), 1.0f);
  try {
    codec->decode_accumulate(frame, sum, {});
    FAIL() << "no error";
  } catch (const FrameError& e) {
    EXPECT_NE(std::string(e.what()).find("level 17"), std::string::npos) << e.what();
  }
  for (float v : sum) ASSERT_EQ(v, 1.0f);  // nothing was added
}

TEST(Qsgd, RejectsANegativeNorm) {
  auto codec = make_codec("qsgd");
  const auto x = gradient(100, 2);
  auto frame = encode(*codec, x);
  const float bad = -1.0f;
  std::memcpy(frame.data() + kFrameHeaderBytes, &bad, 4);
  std::vector<float> sum(x.size());
  EXPECT_THROW(codec->decode_accumulate(frame, sum, {}), FrameError);
}

TEST(Qsgd, NonFiniteInputDecodesToNanInItsBlockOnly) {
  auto codec = make_codec("qsgd:levels=4,block=64");
  auto x = gradient(256, 5);
  x[70] = std::numeric_limits<float>::infinity();
  std::vector<float> residual(x.size());
  const auto frame = encode(*codec, x, {}, residual);
  EXPECT_EQ(read_frame_header(frame).flags & kFlagNonFinite, kFlagNonFinite);
  const auto y = decode(*codec, frame, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (i >= 64 && i < 128) {
      EXPECT_TRUE(std::isnan(y[i])) << i;
    } else {
      EXPECT_TRUE(std::isfinite(y[i])) << i;
      EXPECT_FLOAT_EQ(residual[i] + y[i], x[i]) << i;
    }
  }
}

TEST(Qsgd, ZeroAndTinyInputs) {
  auto codec = make_codec("qsgd:levels=16");
  const std::vector<float> zeros(1000, 0.0f);
  for (float v : testing::roundtrip(*codec, zeros)) ASSERT_EQ(v, 0.0f);
  // Subnormals: the norm is below 2^-100, where levels / norm would overflow without care.
  std::vector<float> tiny(1000);
  for (size_t i = 0; i < tiny.size(); ++i) tiny[i] = (i % 2 ? -1 : 1) * float(i) * 1e-44f;
  const auto frame = encode(*codec, tiny);
  const float step = testing::payload_f32(frame, 0) / 16;
  const auto y = decode(*codec, frame, tiny.size());
  for (size_t i = 0; i < tiny.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i]));
    ASSERT_LE(std::fabs(y[i] - tiny[i]), step * 1.01f + 1e-45f) << i;
  }
}

}  // namespace
}  // namespace gradcomp
