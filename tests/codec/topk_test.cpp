// topk: golden bytes, exactness against a sort-based reference (ties, NaN, all sizes), the
// count rule, the residual, spec errors and decoder validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "codec/sparse_reference.h"
#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/spec.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::bits_of;
using testing::decode;
using testing::encode;
using testing::error_text;
using testing::gradient;
using testing::hex;
using testing::parse_sparse_payload;
using testing::reference_top_k;

// 20 elements: zeros, negatives, and ties at the cut (four elements of magnitude 2).
const std::vector<float> kTopkSmall = {0.5f,  -1.0f, 0.0f, 2.0f,   -2.0f,  0.25f, 1.0f,
                                       -0.5f, 3.0f,  0.0f, -3.0f,  0.125f, 1.5f,  -1.5f,
                                       0.75f, -2.0f, 0.0f, -0.25f, 2.0f,   1.0f};

// Many equal magnitudes: values on a coarse grid, a third of them zero.
std::vector<float> tied_gradient(size_t n, uint64_t seed) {
  auto x = gradient(n, seed);
  for (float& v : x) v = std::round(v * 2.0f) / 2.0f;
  return x;
}

TEST(TopK, GoldenBytes) {
  auto codec = make_codec("topk:k=5");
  const Context ctx{.seed = 3, .bucket = 1, .step = 2, .rank = 0};
  const auto frame = encode(*codec, kTopkSmall, ctx);
  // The two 3s (8, 10) and the three lowest-index 2s (3, 4, 15; not 18).
  const std::string payload =
      "05000000"                                  // count 5
      "03000000" "04000000" "08000000" "0a000000" "0f000000"  // indices 3 4 8 10 15
      "00000040" "000000c0" "00004040" "000040c0" "000000c0";  // 2 -2 3 -3 -2
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes)), payload);
  const FrameHeader h = read_frame_header(frame);
  EXPECT_EQ(h.codec_id, 12);
  EXPECT_EQ(h.elements, 20u);
  EXPECT_EQ(h.payload_bytes, 44u);
  EXPECT_EQ(h.param_hash, fnv1a32("topk:k=5"));
  EXPECT_EQ(hex(frame), "4743465201" "0c0000" "485495f3"  /* fnv1a("topk:k=5") */ "01000000" "1400000000000000"
                        "2c00000000000000" "00000000" "68dc5bce" + payload);
}

TEST(TopK, RatioRoundsHalfAwayFromZeroAndSendsAtLeastOne) {
  // 20 * 0.25 = 5; 20 * 0.125 = 2.5 -> 3; 20 * 0.01 = 0.2 -> 0 -> at least 1.
  for (auto [spec, k] : {std::pair{"topk:ratio=0.25", 5u}, {"topk:ratio=0.125", 3u},
                         {"topk:ratio=0.01", 1u}, {"topk:ratio=1", 20u}}) {
    auto codec = make_codec(spec);
    const auto p = parse_sparse_payload(encode(*codec, kTopkSmall));
    EXPECT_EQ(p.indices, reference_top_k(kTopkSmall, k)) << spec;
  }
}

TEST(TopK, PicksExactlyTheKLargestMagnitudes) {
  for (size_t n : {size_t{1}, size_t{17}, size_t{1000}, size_t{65536 + 17}, size_t{300000}}) {
    for (double ratio : {0.001, 0.01, 0.1, 0.5, 0.97}) {
      for (int variant = 0; variant < 2; ++variant) {
        const auto x = variant == 0 ? gradient(n, n + 1) : tied_gradient(n, n + 2);
        auto codec = make_codec("topk:ratio=" + format_number(ratio));
        const auto frame = encode(*codec, x, Context{.seed = 5});
        const auto p = parse_sparse_payload(frame);
        const size_t k = std::max<size_t>(1, static_cast<size_t>(std::llround(ratio * n)));
        ASSERT_EQ(p.indices, reference_top_k(x, k)) << "n " << n << " ratio " << ratio;
        for (size_t j = 0; j < p.indices.size(); ++j) {
          ASSERT_EQ(bits_of(std::span(&p.values[j], 1)), bits_of(std::span(&x[p.indices[j]], 1)));
        }
      }
    }
  }
}

TEST(TopK, SkewedAndConstantInputsStayExact) {
  const size_t n = 200000;
  std::vector<float> zeros(n, 0.0f), constant(n, -0.5f), ramp(n), spikes(n, 0.0f);
  for (size_t i = 0; i < n; ++i) ramp[i] = static_cast<float>(i % 977) - 400.0f;
  for (size_t i = 0; i < n; i += 1013) spikes[i] = static_cast<float>(i);  // few non-zeros
  for (const auto* x : {&zeros, &constant, &ramp, &spikes}) {
    for (size_t k : {size_t{1}, size_t{150}, size_t{2000}, size_t{50000}}) {
      auto codec = make_codec("topk:k=" + std::to_string(k));
      const auto p = parse_sparse_payload(encode(*codec, *x));
      ASSERT_EQ(p.indices, reference_top_k(*x, k)) << "k " << k;
    }
  }
}

TEST(TopK, NanIsTheLargestMagnitudeAndInfNext) {
  auto x = gradient(5000, 21);
  x[4000] = -std::numeric_limits<float>::infinity();
  x[77] = std::numeric_limits<float>::quiet_NaN();
  x[123] = 1e30f;
  auto codec = make_codec("topk:k=2");
  const auto p = parse_sparse_payload(encode(*codec, x));
  EXPECT_EQ(p.indices, (std::vector<uint32_t>{77, 4000}));
  EXPECT_TRUE(std::isnan(p.values[0]));
  EXPECT_EQ(p.values[1], -std::numeric_limits<float>::infinity());
}

TEST(TopK, SameFrameOnAnyThreadCountAndSeed) {
  const auto x = tied_gradient(400000, 8);
  auto codec = make_codec("topk:ratio=0.02");
  const auto one = encode(*codec, x, Context{.seed = 1, .threads = 1});
  EXPECT_EQ(one, encode(*codec, x, Context{.seed = 99, .step = 4, .threads = 2}));
  EXPECT_EQ(one, encode(*codec, x, Context{.seed = 1, .rank = 3, .threads = 7}));
}

TEST(TopK, DecodeScattersAndResidualZeroesTheSentEntries) {
  const auto x = gradient(3000, 4);
  auto codec = make_codec("topk:ratio=0.05");
  std::vector<float> residual(x.size());
  const auto frame = encode(*codec, x, {}, residual);
  const auto decoded = decode(*codec, frame, x.size());
  const auto sent = reference_top_k(x, 150);
  std::vector<bool> is_sent(x.size());
  for (uint32_t i : sent) is_sent[i] = true;
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(decoded[i], is_sent[i] ? x[i] : 0.0f) << i;
    EXPECT_EQ(residual[i], is_sent[i] ? 0.0f : x[i]) << i;
  }
  // decode_accumulate adds.
  std::vector<float> sum(x.size(), 1.0f);
  codec->decode_accumulate(frame, sum, {});
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(sum[i], 1.0f + decoded[i]);
}

TEST(TopK, ZeroKAndEmptyInput) {
  auto codec = make_codec("topk:k=0");
  const auto frame = encode(*codec, kTopkSmall);
  EXPECT_EQ(hex(std::span(frame).subspan(kFrameHeaderBytes)), "00000000");
  EXPECT_EQ(decode(*codec, frame, kTopkSmall.size()), std::vector<float>(kTopkSmall.size(), 0.0f));
  auto ratio = make_codec("topk");
  EXPECT_EQ(read_frame_header(encode(*ratio, std::vector<float>{})).payload_bytes, 4u);
}

TEST(TopK, CanonicalSpecAndTraits) {
  EXPECT_EQ(make_codec("topk")->spec(), "topk:ratio=0.01");
  EXPECT_EQ(make_codec("topk:ratio=0.25")->spec(), "topk:ratio=0.25");
  EXPECT_EQ(make_codec("topk:k=7")->spec(), "topk:k=7");
  const CodecTraits t = make_codec("topk:ratio=0.01")->traits();
  EXPECT_FALSE(t.summable);
  EXPECT_FALSE(t.unbiased);
  EXPECT_DOUBLE_EQ(t.bits_per_element, 0.64);
  EXPECT_EQ(make_codec("topk:k=7")->max_frame_bytes(100), kFrameHeaderBytes + 4 + 56);
}

TEST(TopK, BadSpecsNameCodecAndParameter) {
  const std::string range = error_text([] { make_codec("topk:ratio=1.5"); });
  EXPECT_NE(range.find("codec 'topk': parameter 'ratio' = 1.5 is out of range; allowed: (0, 1]"),
            std::string::npos) << range;
  EXPECT_NE(error_text([] { make_codec("topk:ratio=0"); }).find("'ratio'"), std::string::npos);
  EXPECT_NE(error_text([] { make_codec("topk:k=-1"); }).find("parameter 'k'"), std::string::npos);
  EXPECT_NE(error_text([] { make_codec("topk:k=1.5"); }).find("parameter 'k'"), std::string::npos);
  const std::string both = error_text([] { make_codec("topk:ratio=0.1,k=3"); });
  EXPECT_NE(both.find("codec 'topk'"), std::string::npos) << both;
  EXPECT_NE(both.find("'ratio' and 'k'"), std::string::npos) << both;
  auto codec = make_codec("topk:k=21");
  const std::string big = error_text([&] { encode(*codec, kTopkSmall); });
  EXPECT_NE(big.find("codec 'topk': parameter 'k' = 21 exceeds the tensor's 20 elements"),
            std::string::npos) << big;
}

// A frame with a valid header (checksum included) around an arbitrary payload.
std::vector<std::byte> forge(const Codec& codec, size_t n, const std::vector<uint32_t>& words) {
  std::vector<std::byte> f(kFrameHeaderBytes + 4 * words.size());
  if (!words.empty()) std::memcpy(f.data() + kFrameHeaderBytes, words.data(), 4 * words.size());
  write_frame_header({.codec_id = static_cast<uint8_t>(codec.id()), .param_hash = codec.param_hash(),
                      .elements = n, .payload_bytes = 4 * words.size()},
                     f);
  return f;
}

TEST(TopK, DecoderRejectsMalformedPayloadsBeforeWriting) {
  auto codec = make_codec("topk:k=2");
  const uint32_t one = 0x3f800000;  // 1.0f
  const std::vector<std::pair<std::vector<uint32_t>, std::string>> cases = {
      {{2, 3, 3, one, one}, "not strictly increasing"},
      {{2, 5, 3, one, one}, "not strictly increasing"},
      {{2, 3, 10, one, one}, "out of range"},
      {{2, 3, 4, one}, "must be 20"},
      {{2, 3, 4, one, one, one}, "must be"},
      {{1, 3, one}, "exactly 2"},
      {{3, 1, 2, 3, one, one, one}, "exactly 2"},
      {{0xffffffffU, 1, 2}, "announces"},
      {}, };
  for (const auto& [words, message] : cases) {
    std::vector<float> sum(10, 7.0f);
    const auto f = forge(*codec, 10, words);
    const std::string text = error_text([&] { codec->decode_accumulate(f, sum, {}); });
    EXPECT_NE(text.find(message.empty() ? "too short" : message), std::string::npos) << text;
    EXPECT_EQ(sum, std::vector<float>(10, 7.0f)) << "a rejected frame must not touch the sum";
  }
  // Header fields check_frame leaves to the codec.
  const std::vector<uint32_t> good = {2, 3, 9, one, one};
  for (auto [field, message] : {std::pair{0, "flags 0x02 hold unknown bits"}, {1, "aux is 0x5"},
                                {2, "sums 2 frames"}}) {
    std::vector<std::byte> f(kFrameHeaderBytes + 20);
    std::memcpy(f.data() + kFrameHeaderBytes, good.data(), 20);
    write_frame_header({.codec_id = 12, .flags = uint8_t(field == 0 ? 2 : 0),
                        .param_hash = codec->param_hash(), .summands = field == 2 ? 2u : 1u,
                        .elements = 10, .payload_bytes = 20, .aux = field == 1 ? 5u : 0u},
                       f);
    std::vector<float> sum(10, 0.0f);
    const std::string text = error_text([&] { codec->decode_accumulate(f, sum, {}); });
    EXPECT_NE(text.find(message), std::string::npos) << text;
  }
  // The well-formed version decodes.
  std::vector<float> sum(10, 0.0f);
  codec->decode_accumulate(forge(*codec, 10, {2, 3, 9, one, one}), sum, {});
  EXPECT_EQ(sum[3], 1.0f);
  EXPECT_EQ(sum[9], 1.0f);
}

}  // namespace
}  // namespace gradcomp
