// The machinery shared by qsgd, terngrad, natural and dither: packing (same layout as
// bitpack.h, vector and scalar paths equal), stochastic rounding, deterministic norms, and the
// decoders' handling of corrupt payloads.
#include "codec/stochastic_levels.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/bitpack.h"
#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp::levels {
namespace {

const std::vector<std::string> kStochasticSpecs = {
    "qsgd:levels=16", "qsgd:levels=5,block=100", "terngrad",
    "natural",        "dither:levels=6",         "dither:levels=9,partition=natural"};
const unsigned kWidths[] = {6, 4, 2, 9, 4, 5};  // bits per code of each spec

// Re-signs a frame after its header was changed.
void rewrite_header(std::vector<std::byte>& frame, const FrameHeader& h) {
  write_frame_header(h, frame);
}

std::vector<uint32_t> random_codes(size_t n, unsigned bits, uint64_t seed) {
  const CounterRng rng(seed, 0, 0, 0);
  std::vector<uint32_t> codes(n);
  for (size_t i = 0; i < n; ++i) codes[i] = rng.bits(static_cast<uint32_t>(i)) >> (32 - bits);
  return codes;
}

TEST(StochasticLevels, PackingMatchesBitWriterAndRoundTrips) {
  for (unsigned bits = 1; bits <= kMaxWidth; ++bits) {
    for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{1000}, kChunk + 70}) {
      const auto codes = random_codes(n, bits, bits * 1000 + n);
      std::vector<std::byte> expected(packed_bytes(n, bits));
      BitWriter writer(expected.data(), bits);
      for (uint32_t c : codes) writer.put(c);
      writer.flush();

      std::vector<std::byte> packed(packed_bytes(n, bits));
      std::vector<uint32_t> unpacked(n, ~0U);
      with_width(bits, [&](auto width) {
        constexpr unsigned B = decltype(width)::value;
        pack_codes<B>(n, 2, packed.data(), [&](size_t first, size_t count, uint32_t* out) {
          std::copy_n(codes.begin() + first, count, out);
        });
        unpack_codes<B>(packed.data(), n, 2, [&](size_t first, size_t count, const uint32_t* in) {
          std::copy_n(in, count, unpacked.begin() + first);
        });
        uint32_t top = 0;
        for (uint32_t c : codes) top = std::max(top, c);
        EXPECT_EQ(max_code<B>(packed.data(), n, 1), top);
      });
      ASSERT_EQ(packed, expected) << bits << " bits, n = " << n;
      ASSERT_EQ(unpacked, codes) << bits << " bits, n = " << n;
    }
  }
}

TEST(StochasticLevels, VectorAndScalarGroupsAgree) {
  auto check = [](auto width) {
    constexpr unsigned B = decltype(width)::value;
    const auto codes = random_codes(kGroup, B, B);
    alignas(64) std::byte fast[8 * B + 64], slow[8 * B];
    pack_group<B>(codes.data(), fast);
    pack_group_scalar<B>(codes.data(), slow);
    EXPECT_EQ(0, std::memcmp(fast, slow, 8 * B)) << B;
    uint32_t a[kGroup], b[kGroup];
    unpack_group<B>(slow, a);
    unpack_group_scalar<B>(slow, b);
    EXPECT_EQ(0, std::memcmp(a, b, sizeof a)) << B;
  };
  for (unsigned bits = 1; bits <= kMaxWidth; ++bits) with_width(bits, check);
}

TEST(StochasticLevels, StochasticRoundingIsUnbiasedAndBounded) {
  const CounterRng rng(5, 0, 0, 0);
  for (float v : {0.0f, 0.3f, 2.75f, 6.999f, 7.0f}) {
    double sum = 0;
    const int draws = 200000;
    for (int i = 0; i < draws; ++i) {
      const uint32_t level = stochastic_round(v, rng.bits(i), 7);
      ASSERT_TRUE(level == std::floor(v) || level == std::ceil(v)) << v;
      sum += level;
    }
    EXPECT_NEAR(sum / draws, v, 5 * 0.5 / std::sqrt(double(draws))) << v;
  }
  EXPECT_EQ(stochastic_round(7.0001f, ~0U, 7), 7u) << "never above top";
}

TEST(StochasticLevels, PowerOfTwoRoundingIsUnbiased) {
  const CounterRng rng(6, 0, 0, 0);
  for (float x : {1.0f, 1.5f, 3.1f, 0.7f, 3e-39f}) {
    double sum = 0;
    const int draws = 200000;
    for (int i = 0; i < draws; ++i) {
      const uint32_t exponent = round_to_power_of_two(std::bit_cast<uint32_t>(x), rng.bits(i), 254);
      sum += std::bit_cast<float>(exponent << 23);
    }
    // The two candidates are at most max(x, 2^-126) apart (subnormals: 0 and 2^-126).
    const double gap = std::max(double(x), 0x1p-126);
    EXPECT_NEAR(sum / draws, x, 5 * 0.5 * gap / std::sqrt(double(draws))) << x;
  }
}

TEST(StochasticLevels, NormsDoNotDependOnThreads) {
  const auto x = testing::gradient(kChunk * 3 + 17, 4);
  const float one = l2_norm(x.data(), 0, x.size(), 1);
  EXPECT_EQ(l2_norm(x.data(), 0, x.size(), 2), one);
  double sq = 0;
  for (float v : x) sq += double(v) * v;
  EXPECT_NEAR(one, std::sqrt(sq), 1e-6 * one);
  EXPECT_EQ(max_abs(x, 1), max_abs(x, 2));
  std::vector<float> with_nan = x;
  with_nan[5] = -std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(max_abs(with_nan, 2)));
  EXPECT_TRUE(std::isnan(l2_norm(with_nan.data(), 0, x.size(), 2)));
}

TEST(StochasticLevels, GridHandlesZeroAndTinyScales) {
  EXPECT_EQ(Grid::make(0.0f, 15).units(0.0f), 0.0f);
  const float tiny = 3e-44f;  // 15 / tiny overflows a float
  const Grid g = Grid::make(tiny, 15);
  EXPECT_NEAR(g.units(tiny), 15.0f, 1e-5f);
  EXPECT_NEAR(g.units(tiny / 3), 5.0f, 1.0f);
}

TEST(StochasticLevels, DecodersRejectAPayloadOfTheWrongLength) {
  for (const auto& spec : kStochasticSpecs) {
    auto codec = make_codec(spec);
    const auto x = testing::gradient(300, 1);
    for (int delta : {-1, 1}) {
      auto frame = testing::encode(*codec, x);
      FrameHeader h = read_frame_header(frame);
      h.payload_bytes += delta;
      frame.resize(kFrameHeaderBytes + h.payload_bytes);
      write_frame_header(h, frame);
      std::vector<float> sum(x.size());
      try {
        codec->decode_accumulate(frame, sum, {});
        FAIL() << spec << ": no error";
      } catch (const FrameError& e) {
        EXPECT_NE(std::string(e.what()).find("expected"), std::string::npos) << e.what();
      }
    }
  }
}

TEST(StochasticLevels, DecodersRejectNonZeroPaddingAndForeignHeaderFields) {
  for (size_t c = 0; c < kStochasticSpecs.size(); ++c) {
    auto codec = make_codec(kStochasticSpecs[c]);
    const size_t n = 301;
    ASSERT_NE(n * kWidths[c] % 8, 0u);
    const auto clean = testing::encode(*codec, testing::gradient(n, 2));
    std::vector<float> sum(n);
    codec->decode_accumulate(clean, sum, {});

    auto padded = clean;
    padded.back() |= std::byte{0x80};
    EXPECT_THROW(codec->decode_accumulate(padded, sum, {}), FrameError) << kStochasticSpecs[c];

    for (int field = 0; field < 3; ++field) {
      auto frame = clean;
      FrameHeader h = read_frame_header(frame);
      if (field == 0) h.flags |= 0x04;
      if (field == 1) h.aux = 1;
      if (field == 2) h.summands = 2;
      rewrite_header(frame, h);
      EXPECT_THROW(codec->decode_accumulate(frame, sum, {}), FrameError)
          << kStochasticSpecs[c] << " field " << field;
    }
  }
}

TEST(StochasticLevels, CorruptPayloadsThrowOrDecodeButNeverCrash) {
  // Random bytes under a valid header: the decoder either rejects them with a FrameError or
  // decodes some values; run under ASan/UBSan this also proves it reads nothing out of bounds.
  for (size_t c = 0; c < kStochasticSpecs.size(); ++c) {
    const std::string& spec = kStochasticSpecs[c];
    auto codec = make_codec(spec);
    for (size_t n : {size_t{1}, size_t{77}, size_t{1000}}) {
      const auto x = testing::gradient(n, n);
      const auto clean = testing::encode(*codec, x);
      const CounterRng rng(n, 1, 2, 3);
      int rejected = 0;
      for (uint32_t trial = 0; trial < 200; ++trial) {
        auto frame = clean;
        for (size_t i = kFrameHeaderBytes; i < frame.size(); ++i) {
          frame[i] = std::byte(rng.bits(trial * 5000 + static_cast<uint32_t>(i)) & 0xff);
        }
        // Keep the padding bits zero, so the codes themselves are what is tested.
        const unsigned used = static_cast<unsigned>(n * kWidths[c] % 8);
        if (used != 0) frame.back() &= std::byte{static_cast<uint8_t>((1U << used) - 1)};
        std::vector<float> sum(n, 0.0f);
        try {
          codec->decode_accumulate(frame, sum, {});
        } catch (const FrameError&) {
          ++rejected;
          for (float v : sum) ASSERT_EQ(v, 0.0f) << spec << ": partly added before throwing";
        }
      }
      if (spec == "natural") {
        EXPECT_EQ(rejected, 0) << "every natural code is valid";
      }
    }
  }
}

}  // namespace
}  // namespace gradcomp::levels
