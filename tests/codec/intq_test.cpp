// intq: wire layout (golden bytes), overflow-free sums for every allowed world size,
// unbiasedness, accuracy, the world-size limit, non-finite input, and frame validation.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::aggregate_allreduce;
using testing::encode;
using testing::gradient;
using testing::hex;

// Round 0 for a world of ranks with the given inputs: the shared max, absorbed by every codec.
void agree_on_max(std::vector<std::unique_ptr<Codec>>& codecs,
                  const std::vector<std::vector<float>>& inputs, Context ctx) {
  std::vector<std::byte> reduced;
  for (size_t r = 0; r < codecs.size(); ++r) {
    ctx.rank = static_cast<uint32_t>(r);
    std::vector<std::byte> f(codecs[r]->max_round_bytes(0, inputs[r].size()));
    f.resize(codecs[r]->encode_round(0, inputs[r], f, ctx));
    if (r == 0) {
      reduced = f;
    } else {
      reduce_frame_into(reduced, f, DType::kF32, ReduceOp::kMax);
    }
  }
  for (auto& c : codecs) c->absorb_round(0, reduced, ctx);
}

std::vector<std::unique_ptr<Codec>> make_world(const std::string& spec, size_t world) {
  std::vector<std::unique_ptr<Codec>> v;
  for (size_t r = 0; r < world; ++r) v.push_back(make_codec(spec));
  return v;
}

// Re-seals the header checksum after a test edits header bytes.
void reseal(std::vector<std::byte>& frame) {
  const uint32_t crc = crc32(std::span(frame).first(36));
  std::memcpy(frame.data() + 36, &crc, 4);
}

float max_abs(const std::vector<float>& x) {
  float m = 0;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

TEST(IntQ, SpecAndTraits) {
  EXPECT_EQ(make_codec("intq")->spec(), "intq:bits=8");
  EXPECT_EQ(make_codec("intq:bits=4")->spec(), "intq:bits=4");
  try {
    make_codec("intq:bits=5");
    FAIL();
  } catch (const SpecError& e) {
    EXPECT_STREQ(e.what(), "codec 'intq': parameter 'bits' = '5' is not allowed; allowed: 8, 4");
  }
  const auto t8 = make_codec("intq")->traits(), t4 = make_codec("intq:bits=4")->traits();
  EXPECT_EQ(t8.payload_type, DType::kI8);
  EXPECT_EQ(t4.payload_type, DType::kU8);
  EXPECT_EQ(t8.rounds, 2);
  EXPECT_TRUE(t8.summable && t8.unbiased && !t8.shared_randomness);
  EXPECT_EQ(t4.bits_per_element, 4);
  EXPECT_EQ(make_codec("intq")->round_op(0), ReduceOp::kMax);
  EXPECT_EQ(make_codec("intq")->max_frame_bytes(5), kFrameHeaderBytes + 6);
  EXPECT_EQ(make_codec("intq:bits=4")->max_frame_bytes(5), kFrameHeaderBytes + 4);
}

// x = {1, -2, 0.3, 4, -0.5}, world of 2 (q = 63 for int8, 3 for int4), seed 7, rank 1.
TEST(IntQ, GoldenBytesInt8) {
  const std::vector<float> x = {1, -2, 0.3f, 4, -0.5f};
  auto c = make_codec("intq:bits=8");
  const Context ctx{.seed = 7, .bucket = 1, .step = 3, .rank = 1, .world_size = 2};
  std::vector<std::byte> m(c->max_round_bytes(0, 5));
  m.resize(c->encode_round(0, x, m, ctx));
  // header (round 0, n 5, payload 4), then max|x| = 4.0f = 0x40800000
  EXPECT_EQ(hex(m),
            "47434652011100005c9a9655010000000500000000000000040000000000000000000000a6cab022"
            "00008040");
  c->absorb_round(0, m, ctx);
  const auto f = encode(*c, x, ctx);
  // header (round 1, payload 6, aux = scale), codes 16 -32 5 63 -8, trailer 63
  EXPECT_EQ(hex(f),
            "47434652011101005c9a965501000000050000000000000006000000000000002108823d0a98abb5"
            "10e0053ff83f");
  // Layout: aux = scale = 4 / 63; codes round x / scale up or down; trailer q = 63.
  const FrameHeader h = read_frame_header(f);
  EXPECT_EQ(h.round, 1);
  EXPECT_EQ(h.payload_bytes, 6u);
  EXPECT_EQ(std::bit_cast<float>(h.aux), 4.0f / 63.0f);
  for (size_t i = 0; i < 5; ++i) {
    const auto code = static_cast<int8_t>(std::to_integer<uint8_t>(f[kFrameHeaderBytes + i]));
    const float t = x[i] * 63.0f / 4.0f;
    EXPECT_TRUE(code == std::floor(t) || code == std::ceil(t)) << i << ": " << int{code};
  }
  EXPECT_EQ(std::to_integer<int>(f[kFrameHeaderBytes + 5]), 63);
}

TEST(IntQ, GoldenBytesInt4) {
  const std::vector<float> x = {1, -2, 0.3f, 4, -0.5f};
  auto c = make_codec("intq:bits=4");
  const Context ctx{.seed = 7, .bucket = 1, .step = 3, .rank = 1, .world_size = 2};
  std::vector<std::byte> m(c->max_round_bytes(0, 5));
  m.resize(c->encode_round(0, x, m, ctx));
  c->absorb_round(0, m, ctx);
  const auto f = encode(*c, x, ctx);
  // header (payload 4, aux = 4/3), nibbles (1,-2) (1,3) (0,-) offset by 3, trailer 3
  EXPECT_EQ(hex(f),
            "4743465201110100a8a096590100000005000000000000000400000000000000abaaaa3f3d9ddc04"
            "14640303");
  // Layout: 3 bytes of offset codes c + 3 (low nibble first, the 5th element alone), q = 3.
  const FrameHeader h = read_frame_header(f);
  EXPECT_EQ(h.payload_bytes, 4u);
  EXPECT_EQ(std::bit_cast<float>(h.aux), 4.0f / 3.0f);
  for (size_t i = 0; i < 5; ++i) {
    const auto byte = std::to_integer<int>(f[kFrameHeaderBytes + i / 2]);
    const int code = ((i % 2 == 0) ? byte & 15 : byte >> 4) - 3;
    const float t = x[i] * 3.0f / 4.0f;
    EXPECT_TRUE(code == std::floor(t) || code == std::ceil(t)) << i << ": " << code;
  }
  EXPECT_EQ(std::to_integer<int>(f[kFrameHeaderBytes + 2]) >> 4, 0);  // the unused nibble
  EXPECT_EQ(std::to_integer<int>(f[kFrameHeaderBytes + 3]), 3);
}

// For every world size the width allows: the reduced frame holds exactly the sum of the
// codes (no wrap-around, no carry between nibbles), and the aggregate is within one step.
void check_sums(const std::string& spec, uint32_t world) {
  SCOPED_TRACE(spec + " W=" + std::to_string(world));
  const size_t n = 3001;  // odd: the last nibble is alone
  std::vector<std::vector<float>> inputs;
  for (uint32_t r = 0; r < world; ++r) {
    auto x = gradient(n, 10 + r, 1.0f + r);
    x[r] = (r % 2 ? -1.0f : 1.0f) * 4.0f * (1.0f + r);  // extremes of both signs hit +-q
    inputs.push_back(std::move(x));
  }
  auto codecs = make_world(spec, world);
  const Context base{.seed = 3, .step = 1, .world_size = world};
  agree_on_max(codecs, inputs, base);
  std::vector<std::vector<std::byte>> frames;
  std::vector<float> separate(n, 0.0f);
  for (uint32_t r = 0; r < world; ++r) {
    Context ctx = base;
    ctx.rank = r;
    frames.push_back(encode(*codecs[r], inputs[r], ctx));
    codecs[0]->decode_accumulate(frames.back(), separate, base);
  }
  auto reduced = frames[0];
  for (uint32_t r = 1; r < world; ++r) {
    reduce_frame_into(reduced, frames[r], codecs[0]->traits().payload_type, ReduceOp::kSum);
  }
  const auto summed = testing::decode(*codecs[0], reduced, n, base);
  const float scale = std::bit_cast<float>(read_frame_header(reduced).aux);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(summed[i], separate[i], 1e-3f * scale) << "element " << i;
  }
  // The reference route gives the mean within one quantization step per rank (on average).
  const auto agg = aggregate_allreduce(spec, inputs, base);
  for (size_t i = 0; i < n; ++i) {
    float mean = 0;
    for (const auto& x : inputs) mean += x[i];
    mean /= static_cast<float>(world);
    ASSERT_LE(std::fabs(agg[i] - mean), scale * 1.0001f) << "element " << i;
  }
}

TEST(IntQ, SumsNeverOverflowAndStayWithinAStep) {
  for (uint32_t w : {1u, 2u, 4u, 8u, 127u}) check_sums("intq:bits=8", w);
  for (uint32_t w : {1u, 2u, 4u, 7u}) check_sums("intq:bits=4", w);
}

TEST(IntQ, WorldTooLargeForTheWidthIsAClearError) {
  const auto x = gradient(10, 1);
  auto c4 = make_codec("intq:bits=4");
  std::vector<std::byte> out(c4->max_round_bytes(0, 10));
  try {
    c4->encode_round(0, x, out, Context{.world_size = 8});
    FAIL();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("codec 'intq': bits=4 supports a world size of 1 .. 7"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("world_size = 8"), std::string::npos) << msg;
  }
  auto c8 = make_codec("intq:bits=8");
  EXPECT_THROW(c8->encode_round(0, x, out, Context{.world_size = 128}), Error);
  EXPECT_THROW(c8->encode_round(0, x, out, Context{.world_size = 0}), Error);
  // The last round checks too (the world may differ from round 0's context).
  c8->encode_round(0, x, out, Context{.world_size = 2});
  c8->absorb_round(0, std::span(out).first(kFrameHeaderBytes + 4), Context{});
  std::vector<std::byte> frame(c8->max_frame_bytes(10));
  EXPECT_THROW(c8->encode(x, frame, Context{.world_size = 200}), Error);
}

TEST(IntQ, StochasticRoundingIsUnbiased) {
  for (const std::string spec : {"intq:bits=8", "intq:bits=4"}) {
    const size_t n = 64;
    const auto x0 = gradient(n, 5), x1 = gradient(n, 6);
    const int trials = 4000;
    std::vector<double> mean(n, 0.0);
    for (int t = 0; t < trials; ++t) {
      const auto agg =
          aggregate_allreduce(spec, {x0, x1}, Context{.seed = 100, .step = uint64_t(t)});
      for (size_t i = 0; i < n; ++i) mean[i] += agg[i] / trials;
    }
    // Each rank's rounding error is within one step and has variance <= step^2 / 4; the mean
    // of two ranks over `trials` has standard error <= step / (2 sqrt(2 trials)).
    const double q = spec == "intq:bits=8" ? 63 : 3;
    const double step = std::max(max_abs(x0), max_abs(x1)) / q;
    const double sigma = step / (2 * std::sqrt(2.0 * trials));
    size_t outside_3_sigma = 0;
    for (size_t i = 0; i < n; ++i) {
      const double want = (double{x0[i]} + x1[i]) / 2;
      EXPECT_NEAR(mean[i], want, 5 * sigma) << spec << " element " << i;
      outside_3_sigma += std::fabs(mean[i] - want) > 3 * sigma;
    }
    EXPECT_LE(outside_3_sigma, 2u) << spec;
  }
}

TEST(IntQ, ResidualAndInPlaceForBothWidths) {
  for (const std::string spec : {"intq:bits=8", "intq:bits=4"}) {
    const size_t n = 3 * 65536 + 7;  // several chunks and an odd tail
    auto x = gradient(n, 21);
    auto a = make_world(spec, 1), b = make_world(spec, 1);
    const Context ctx{.seed = 2, .step = 4, .world_size = 3, .threads = 2};
    agree_on_max(a, {x}, ctx);
    agree_on_max(b, {x}, ctx);
    std::vector<float> residual(n);
    const auto frame = encode(*a[0], x, ctx, residual);
    const auto decoded = testing::decode(*a[0], frame, n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(
          decoded[i] + residual[i], x[i],
          std::numeric_limits<float>::epsilon() * std::max(std::fabs(x[i]), std::fabs(decoded[i])))
          << spec << " " << i;
    }
    EXPECT_EQ(encode(*b[0], x, ctx, x), frame) << spec;  // in place
    EXPECT_EQ(x, residual) << spec;
    Context one = ctx;
    one.threads = 1;
    EXPECT_EQ(encode(*a[0], gradient(n, 21), one), frame) << spec;
  }
}

TEST(IntQ, NonFiniteInputReachesEveryRank) {
  for (const std::string spec : {"intq:bits=8", "intq:bits=4"}) {
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      auto x0 = gradient(100, 1);
      x0[42] = bad;
      const auto agg = aggregate_allreduce(spec, {x0, gradient(100, 2)}, Context{.seed = 1});
      for (float v : agg) ASSERT_TRUE(std::isnan(v)) << spec << " " << bad;
    }
  }
  // The frame says so, and the residual is NaN (input - NaN).
  auto codecs = make_world("intq", 1);
  auto x = gradient(50, 1);
  x[3] = std::numeric_limits<float>::infinity();
  agree_on_max(codecs, {x}, Context{});
  std::vector<float> residual(50);
  const auto f = encode(*codecs[0], x, Context{}, residual);
  EXPECT_EQ(read_frame_header(f).flags & kFlagNonFinite, kFlagNonFinite);
  for (float r : residual) ASSERT_TRUE(std::isnan(r));
}

TEST(IntQ, InputBeyondTheAgreedMaxIsClampedAndKeptInTheResidual) {
  auto codecs = make_world("intq", 1);
  const std::vector<float> small = {0.5f, -1.0f, 0.25f};
  agree_on_max(codecs, {small}, Context{});
  const std::vector<float> big = {0.5f, -3.0f, 0.25f};  // another input than round 0's
  std::vector<float> residual(3);
  const auto f = encode(*codecs[0], big, Context{}, residual);
  EXPECT_EQ(read_frame_header(f).flags, 0);
  const auto d = testing::decode(*codecs[0], f, 3);
  EXPECT_FLOAT_EQ(d[1], -1.0f);
  EXPECT_FLOAT_EQ(residual[1], -2.0f);
}

TEST(IntQ, ZeroInputGivesZeros) {
  const std::vector<float> z(100, 0.0f);
  for (const std::string spec : {"intq:bits=8", "intq:bits=4"}) {
    for (float v : aggregate_allreduce(spec, {z, z, z})) ASSERT_EQ(v, 0.0f) << spec;
  }
  // A tiny max whose q / max overflows float still quantizes (inv = 2^127, scale = 2^-127).
  const std::vector<float> tiny = {1e-37f, -3e-38f, 0.0f};
  const auto agg = aggregate_allreduce("intq", {tiny});
  for (size_t i = 0; i < 3; ++i) EXPECT_LE(std::fabs(agg[i] - tiny[i]), 0x1.0p-127f) << i;
}

TEST(IntQ, DecoderValidatesTrailerScaleAndRound0) {
  auto codecs = make_world("intq:bits=4", 1);
  const auto x = gradient(20, 1);
  agree_on_max(codecs, {x}, Context{.world_size = 2});
  const auto f = encode(*codecs[0], x, Context{.world_size = 2});
  std::vector<float> sum(20);
  codecs[0]->decode_accumulate(f, sum, Context{});
  auto bad_trailer = f;
  bad_trailer.back() = std::byte{9};  // q * summands must be in [1, 7] for bits=4
  EXPECT_THROW(codecs[0]->decode_accumulate(bad_trailer, sum, Context{}), FrameError);
  auto summed = f;  // claims 2 summands but the trailer says q * 1 = 3: not a multiple of 2
  std::memcpy(summed.data() + 12, "\x02\x00\x00\x00", 4);
  reseal(summed);
  EXPECT_THROW(codecs[0]->decode_accumulate(summed, sum, Context{}), FrameError);
  auto nan_scale = f;
  const uint32_t nan_bits = 0x7fc00000;
  std::memcpy(nan_scale.data() + 32, &nan_bits, 4);
  reseal(nan_scale);
  EXPECT_THROW(codecs[0]->decode_accumulate(nan_scale, sum, Context{}), FrameError);
  // Round 0: a negative max, and a payload that is not one float.
  auto c = make_codec("intq:bits=4");
  std::vector<std::byte> m(c->max_round_bytes(0, 20));
  m.resize(c->encode_round(0, x, m, Context{}));
  auto negative = m;
  const float minus = -1.0f;
  std::memcpy(negative.data() + kFrameHeaderBytes, &minus, 4);
  EXPECT_THROW(c->absorb_round(0, negative, Context{}), FrameError);
  EXPECT_THROW(c->absorb_round(0, std::span(m).first(m.size() - 1), Context{}), FrameError);
  // Encoding before round 0, or for another length than round 0's, is a clear error.
  auto fresh = make_codec("intq");
  std::vector<std::byte> out(fresh->max_frame_bytes(20));
  EXPECT_THROW(fresh->encode(x, out, Context{}), Error);
  c->absorb_round(0, m, Context{});
  EXPECT_THROW(c->encode(gradient(21, 1), out, Context{}), Error);
}

}  // namespace
}  // namespace gradcomp
