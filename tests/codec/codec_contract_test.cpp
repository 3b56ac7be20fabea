// The contract every codec keeps, checked for all of them: framing, bad frames, zero-length
// input, NaN/Inf propagation, the error-feedback invariant, determinism and thread-count
// independence, summability, and round trip of the aggregate through the reference route.
#include <gtest/gtest.h>

#include <cctype>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "gradcomp/error.h"
#include "gradcomp/spec.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::decode;
using testing::encode;
using testing::gradient;

// One representative spec per codec (every codec in codec_names() must appear).
const std::vector<std::string> kContractSpecs = {
    "none",
    "fp16",
    "bf16",
    "qsgd:levels=16",
    "terngrad",
    "natural",
    "dither:levels=8",
    "signsgd",
    "efsignsgd",
    "signum",
    "onebit",
    "topk:ratio=0.01",
    "randomk:ratio=0.01",
    "dgc:ratio=0.01",
    "threshold:tau=0.5",
    "powersgd:rank=2",
    "intq:bits=8",
    "onebit:block=64",
};

class CodecContract : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Codec> codec_ = make_codec(GetParam());
  // Runs the rounds before the last on this codec alone (world of one).
  void prepare(std::span<const float> x, const Context& ctx) {
    for (int r = 0; r + 1 < codec_->traits().rounds; ++r) {
      std::vector<std::byte> f(codec_->max_round_bytes(r, x.size()));
      f.resize(codec_->encode_round(r, x, f, ctx));
      codec_->absorb_round(r, f, ctx);
    }
  }
};

TEST(CodecRegistry, EveryCodecHasAContractSpec) {
  for (const auto& name : codec_names()) {
    bool found = false;
    for (const auto& s : kContractSpecs) found |= Spec::parse(s).name() == name;
    EXPECT_TRUE(found) << name;
  }
}

TEST(CodecRegistry, UnknownCodecListsTheAvailableOnes) {
  try {
    make_codec("zip");
    FAIL() << "no error";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown codec 'zip'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("topk"), std::string::npos);
  }
}

TEST_P(CodecContract, UnknownParameterIsNamed) {
  const std::string bad = GetParam() + (GetParam().find(':') == std::string::npos ? ":" : ",") +
                          "bogus=1";
  try {
    make_codec(bad);
    FAIL() << "no error for " << bad;
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown parameter 'bogus'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(codec_->name()), std::string::npos) << e.what();
  }
}

TEST_P(CodecContract, CanonicalSpecRebuildsTheSameCodec) {
  auto again = make_codec(codec_->spec());
  EXPECT_EQ(again->spec(), codec_->spec());
  EXPECT_EQ(again->param_hash(), codec_->param_hash());
}

TEST_P(CodecContract, FrameFitsTheBoundAndNamesItsCodec) {
  for (size_t n : {size_t{1}, size_t{7}, size_t{1000}, size_t{70001}}) {
    codec_ = make_codec(GetParam());  // a codec instance serves one bucket length
    const auto x = gradient(n, n);
    Context ctx;
    prepare(x, ctx);
    const auto frame = encode(*codec_, x, ctx);
    EXPECT_LE(frame.size(), codec_->max_frame_bytes(n));
    const FrameHeader h = read_frame_header(frame);
    EXPECT_EQ(h.codec_id, static_cast<uint8_t>(codec_->id()));
    EXPECT_EQ(h.elements, n);
    EXPECT_EQ(h.summands, 1u);
    EXPECT_EQ(frame.size(), kFrameHeaderBytes + h.payload_bytes);
  }
}

TEST_P(CodecContract, ZeroLengthTensorWorks) {
  std::vector<float> empty;
  Context ctx;
  prepare(empty, ctx);
  const auto frame = encode(*codec_, empty, ctx);
  std::vector<float> sum;
  codec_->decode_accumulate(frame, sum, ctx);
  codec_->finalize(sum, 2);
}

TEST_P(CodecContract, RejectsTruncatedFramesAtEveryLength) {
  const auto x = gradient(300, 3);
  Context ctx;
  prepare(x, ctx);
  const auto frame = encode(*codec_, x, ctx);
  std::vector<float> sum(x.size());
  for (size_t len = 0; len < frame.size(); ++len) {
    EXPECT_THROW(codec_->decode_accumulate(std::span(frame).first(len), sum, ctx), FrameError)
        << "length " << len;
  }
}

TEST_P(CodecContract, RejectsWrongLengthAndForeignFrames) {
  const auto x = gradient(300, 4);
  Context ctx;
  prepare(x, ctx);
  const auto frame = encode(*codec_, x, ctx);
  std::vector<float> shorter(299), longer(301);
  EXPECT_THROW(codec_->decode_accumulate(frame, shorter, ctx), FrameError);
  EXPECT_THROW(codec_->decode_accumulate(frame, longer, ctx), FrameError);
  auto padded = frame;
  padded.push_back(std::byte{0});
  std::vector<float> sum(300);
  EXPECT_THROW(codec_->decode_accumulate(padded, sum, ctx), FrameError);
  // A frame of another codec.
  auto other = make_codec(codec_->id() == CodecId::kNone ? "fp16" : "none");
  EXPECT_THROW(codec_->decode_accumulate(encode(*other, x), sum, ctx), FrameError);
  // Another version, and a flipped header bit.
  auto versioned = frame;
  versioned[4] = std::byte{2};
  EXPECT_THROW(codec_->decode_accumulate(versioned, sum, ctx), FrameError);
  auto flipped = frame;
  flipped[17] ^= std::byte{0x10};
  EXPECT_THROW(codec_->decode_accumulate(flipped, sum, ctx), FrameError);
}

// A decoder refuses header flags and aux values its encoder never writes: unknown flag bits
// always, the non-finite flag when the payload carries NaN and Inf itself, and any aux when
// the codec keeps nothing there (its frames of two different inputs both have aux 0).
TEST_P(CodecContract, RejectsFlagsAndAuxItNeverWrites) {
  const auto x = gradient(300, 5), y = gradient(300, 6);
  Context ctx;
  prepare(x, ctx);
  const auto frame = encode(*codec_, x, ctx);
  const FrameHeader h = read_frame_header(frame);
  const auto forged = [&](uint8_t flags, uint32_t aux) {
    auto f = frame;
    FrameHeader g = h;
    g.flags = flags;
    g.aux = aux;
    write_frame_header(g, f);
    return f;
  };
  std::vector<float> sum(x.size(), 0.0f);
  for (int bit = 1; bit < 8; ++bit) {
    const auto flags = static_cast<uint8_t>(h.flags | (1u << bit));
    EXPECT_THROW(codec_->decode_accumulate(forged(flags, h.aux), sum, ctx), FrameError)
        << "flags 0x" << std::hex << int{flags};
  }
  if (codec_->traits().payload_carries_nonfinite) {
    EXPECT_EQ(h.flags, 0);
    EXPECT_THROW(codec_->decode_accumulate(forged(kFlagNonFinite, h.aux), sum, ctx), FrameError);
  }
  auto other = make_codec(GetParam());
  for (int r = 0; r + 1 < other->traits().rounds; ++r) {
    std::vector<std::byte> f(other->max_round_bytes(r, y.size()));
    f.resize(other->encode_round(r, y, f, ctx));
    other->absorb_round(r, f, ctx);
  }
  if (h.aux == 0 && read_frame_header(encode(*other, y, ctx)).aux == 0) {
    for (uint32_t aux : {1u, 0x5u, 0x80000000u}) {
      EXPECT_THROW(codec_->decode_accumulate(forged(h.flags, aux), sum, ctx), FrameError)
          << "aux 0x" << std::hex << aux;
    }
  }
  EXPECT_EQ(sum, std::vector<float>(x.size(), 0.0f)) << "a rejected frame must not touch the sum";
}

TEST_P(CodecContract, SameSeedSameBytesOnAnyThreadCount) {
  const auto x = gradient(300000, 5);
  Context one{.seed = 42, .bucket = 3, .step = 9, .rank = 1, .world_size = 4, .threads = 1};
  Context many = one;
  many.threads = 2;
  auto a = make_codec(GetParam()), b = make_codec(GetParam());
  auto run = [&](Codec& c, const Context& ctx) {
    for (int r = 0; r + 1 < c.traits().rounds; ++r) {
      std::vector<std::byte> f(c.max_round_bytes(r, x.size()));
      f.resize(c.encode_round(r, x, f, ctx));
      c.absorb_round(r, f, ctx);
    }
    return encode(c, x, ctx);
  };
  EXPECT_EQ(run(*a, one), run(*b, many));
}

TEST_P(CodecContract, ResidualPlusDecodedEqualsInput) {
  const auto x = gradient(5000, 6);
  Context ctx{.seed = 7};
  prepare(x, ctx);
  std::vector<float> residual(x.size());
  const auto frame = encode(*codec_, x, ctx, residual);
  const auto decoded = decode(*codec_, frame, x.size(), ctx);
  for (size_t i = 0; i < x.size(); ++i) {
    const float sent_plus_left = decoded[i] + residual[i];
    const float tolerance = std::numeric_limits<float>::epsilon() *
                            std::max({std::fabs(x[i]), std::fabs(decoded[i]), 1e-30f});
    ASSERT_NEAR(sent_plus_left, x[i], tolerance) << "element " << i;
  }
}

TEST_P(CodecContract, ResidualMayAliasTheInput) {
  auto x = gradient(5000, 8);
  Context ctx{.seed = 7};
  prepare(x, ctx);
  std::vector<float> separate(x.size());
  auto twin = make_codec(GetParam());
  for (int r = 0; r + 1 < twin->traits().rounds; ++r) {
    std::vector<std::byte> f(twin->max_round_bytes(r, x.size()));
    f.resize(twin->encode_round(r, x, f, ctx));
    twin->absorb_round(r, f, ctx);
  }
  const auto expected = encode(*twin, x, ctx, separate);
  const auto frame = encode(*codec_, x, ctx, x);  // in place
  EXPECT_EQ(frame, expected);
  EXPECT_EQ(x, separate);
}

// Routes decode the first (or only) frame with decode_into: it must give the bits of
// decode_accumulate into zeros (a -0 becoming +0 as well) whatever `out` held before.
TEST_P(CodecContract, DecodeIntoIsTheAccumulationIntoZeros) {
  auto x = gradient(5000, 13);
  for (size_t i = 0; i < 64; ++i) x[i] = -0.0f;  // a stretch of negative zeros
  if (codec_->traits().uses_layout) {  // a vector (sent plain by PowerSGD), then a matrix
    const std::vector<TensorShape> layout = {{64, {64}}, {4936, {8, 617}}};
    codec_->set_layout(layout);
  }
  Context ctx{.seed = 7};
  prepare(x, ctx);
  const auto frame = encode(*codec_, x, ctx);
  std::vector<float> expected(x.size(), 0.0f);
  codec_->decode_accumulate(frame, expected, ctx);
  std::vector<float> got(x.size(), std::numeric_limits<float>::quiet_NaN());
  codec_->decode_into(frame, got, ctx);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(expected[i]))
        << "element " << i << ": " << got[i] << " against " << expected[i];
  }
}

TEST_P(CodecContract, NanAndInfReachTheDecodedOutput) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto x = gradient(1000, 9);
    x[123] = bad;
    Context ctx;
    auto fresh = make_codec(GetParam());
    for (int r = 0; r + 1 < fresh->traits().rounds; ++r) {
      std::vector<std::byte> f(fresh->max_round_bytes(r, x.size()));
      f.resize(fresh->encode_round(r, x, f, ctx));
      fresh->absorb_round(r, f, ctx);
    }
    const auto out = decode(*fresh, encode(*fresh, x, ctx), x.size(), ctx);
    bool non_finite = false;
    for (float v : out) non_finite |= !std::isfinite(v);
    EXPECT_TRUE(non_finite) << "input held " << bad;
  }
}

TEST_P(CodecContract, StateSurvivesSaveAndLoad) {
  const auto x = gradient(2000, 12);
  Context ctx;
  prepare(x, ctx);
  encode(*codec_, x, ctx);  // advance any state
  auto copy = make_codec(GetParam());
  copy->load_state(codec_->save_state());
  EXPECT_EQ(copy->save_state(), codec_->save_state());
  Context next{.step = 1};
  prepare(x, next);
  for (int r = 0; r + 1 < copy->traits().rounds; ++r) {
    std::vector<std::byte> f(copy->max_round_bytes(r, x.size()));
    f.resize(copy->encode_round(r, x, f, next));
    copy->absorb_round(r, f, next);
  }
  EXPECT_EQ(encode(*copy, x, next), encode(*codec_, x, next));
}

// Aggregation::kMean promises that finalize is the multiplication by 1/W and nothing else: the
// routes leave that factor to the engine, which applies it in its own pass over the mean
// (Route::decode_unscaled) instead of calling finalize. A majority vote leaves signs.
TEST_P(CodecContract, FinalizeIsTheFactorOfTheMeanOrAVote) {
  const bool mean = codec_->traits().aggregation == Aggregation::kMean;
  for (const uint32_t world : {1u, 3u, 4u}) {
    auto sum = gradient(1000, 13);
    const auto x = sum;
    codec_->finalize(sum, world);
    const float factor = world > 1 ? 1.0f / static_cast<float>(world) : 1.0f;
    for (size_t i = 0; i < x.size(); ++i) {
      if (mean) {
        ASSERT_EQ(sum[i], x[i] * factor) << "element " << i << " of W = " << world;
      } else {
        ASSERT_TRUE(sum[i] == 1.0f || sum[i] == -1.0f || sum[i] == 0.0f) << sum[i];
      }
    }
  }
}

// Single-round summable codecs: the payload sum that an allreduce computes decodes to the sum
// of the individual decodes. (Multi-round codecs are checked round by round in their tests.)
class SummableCodec : public ::testing::TestWithParam<std::string> {};

std::vector<std::string> summable_specs() {
  std::vector<std::string> out;
  for (const auto& s : kContractSpecs) {
    const auto t = make_codec(s)->traits();
    if (t.summable && t.rounds == 1) out.push_back(s);
  }
  return out;
}

// kept_fraction: the sparsifiers with a ratio carry that share of the elements (the auto
// scheduler waits 1 / it steps for their error-feedback memory to fill); every other codec,
// and a fixed k, says 1.
TEST(KeptFraction, IsTheRatioOfTheSparsifiersAndOneOtherwise) {
  for (const auto& s : kContractSpecs) {
    const double kept = make_codec(s)->traits().kept_fraction;
    const bool sparse = s.starts_with("topk") || s.starts_with("randomk") || s.starts_with("dgc");
    EXPECT_EQ(kept, sparse ? 0.01 : 1.0) << s;
  }
  EXPECT_EQ(make_codec("topk:k=10")->traits().kept_fraction, 1.0);
  EXPECT_EQ(make_codec("randomk:ratio=0.001")->traits().kept_fraction, 0.001);
}

TEST(SummableCodec, TheSummableOnesAreTheExpectedOnes) {
  EXPECT_EQ(summable_specs(),
            (std::vector<std::string>{"none", "fp16", "bf16", "randomk:ratio=0.01"}));
}

TEST_P(SummableCodec, SummedFramesDecodeToTheSumOfDecodes) {
  const auto codec = make_codec(GetParam());
  const size_t n = 4000;
  const uint32_t world = 4;
  std::vector<std::vector<std::byte>> frames;
  std::vector<float> expected(n, 0.0f);
  for (uint32_t r = 0; r < world; ++r) {
    Context ctx{.seed = 11, .step = 2, .rank = r, .world_size = world};
    auto c = make_codec(GetParam());
    frames.push_back(encode(*c, gradient(n, 100 + r), ctx));
    c->decode_accumulate(frames.back(), expected, ctx);
  }
  for (uint32_t r = 1; r < world; ++r) {
    reduce_frame_into(frames[0], frames[r], codec->traits().payload_type, ReduceOp::kSum);
  }
  EXPECT_EQ(read_frame_header(frames[0]).summands, world);
  const auto summed = decode(*codec, frames[0], n, Context{.seed = 11, .step = 2, .world_size = world});
  const float tol = codec->traits().payload_type == DType::kF16 ||
                            codec->traits().payload_type == DType::kBF16
                        ? 0.02f
                        : 1e-4f;
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(summed[i], expected[i], tol * (1 + std::fabs(expected[i]))) << i;
}

// Routes receive a fixed-size codec's frames without being told their sizes: any input, any
// length, any step, every rank must produce exactly max_frame_bytes(n).
std::vector<std::string> fixed_size_specs() {
  std::vector<std::string> out;
  for (const auto& s : kContractSpecs) {
    if (make_codec(s)->traits().fixed_frame_size) out.push_back(s);
  }
  return out;
}

TEST(FixedFrameSize, OnlyThresholdAndDgcSendSizes) {
  std::vector<std::string> sized;
  for (const auto& s : kContractSpecs) {
    if (!make_codec(s)->traits().fixed_frame_size) sized.push_back(Spec::parse(s).name());
  }
  EXPECT_EQ(sized, (std::vector<std::string>{"dgc", "threshold"}));
}

class FixedFrameSize : public CodecContract {};

TEST_P(FixedFrameSize, EncodeWritesTheBoundForEveryInput) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{70001}}) {
    for (int input = 0; input < 4; ++input) {
      codec_ = make_codec(GetParam());
      auto x = gradient(n, n + input);
      if (input == 1) std::fill(x.begin(), x.end(), 0.0f);
      if (input == 2 && n > 0) x[n / 2] = std::numeric_limits<float>::quiet_NaN();
      if (input == 3) std::fill(x.begin(), x.end(), 1e30f);
      const Context ctx{.seed = 5, .step = static_cast<uint64_t>(input), .rank = 1, .world_size = 4};
      prepare(x, ctx);
      EXPECT_EQ(encode(*codec_, x, ctx).size(), codec_->max_frame_bytes(n))
          << "n " << n << ", input " << input;
    }
  }
}

// A test's name: the codec's, plus the parameters where a codec appears twice (onebit,
// onebit_block_64).
std::string test_name(const std::string& spec) {
  std::string name = Spec::parse(spec).name();
  if (spec.find("block=") == std::string::npos) return name;
  for (char c : spec.substr(name.size())) {
    name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(AllCodecs, CodecContract, ::testing::ValuesIn(kContractSpecs),
                         [](const auto& info) { return test_name(info.param); });

INSTANTIATE_TEST_SUITE_P(Summable, SummableCodec, ::testing::ValuesIn(summable_specs()),
                         [](const auto& info) { return test_name(info.param); });

INSTANTIATE_TEST_SUITE_P(Fixed, FixedFrameSize, ::testing::ValuesIn(fixed_size_specs()),
                         [](const auto& info) { return test_name(info.param); });

}  // namespace
}  // namespace gradcomp
