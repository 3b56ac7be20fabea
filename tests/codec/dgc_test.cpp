// dgc: golden bytes, the warm-up schedule, exactly k and the exact top-k set (not the first k
// above a threshold), spec errors and the decoder's count range.
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

using testing::decode;
using testing::encode;
using testing::error_text;
using testing::gradient;
using testing::hex;
using testing::parse_sparse_payload;
using testing::reference_top_k;

const std::vector<float> kDgcSmall = {0.5f,  -1.0f, 0.0f, 2.0f,   -2.0f,  0.25f, 1.0f,
                                      -0.5f, 3.0f,  0.0f, -3.0f,  0.125f, 1.5f,  -1.5f,
                                      0.75f, -2.0f, 0.0f, -0.25f, 2.0f,   1.0f};

TEST(Dgc, GoldenBytes) {
  auto codec = make_codec("dgc:ratio=0.25");
  const auto frame = encode(*codec, kDgcSmall, {.seed = 3, .bucket = 1, .step = 2});
  // k = 5: the two 3s and the three lowest-index 2s, as topk.
  const std::string payload =
      "05000000" "03000000" "04000000" "08000000" "0a000000" "0f000000"
      "00000040" "000000c0" "00004040" "000040c0" "000000c0";
  // magic, version 1, codec 14, round 0, flags 0, hash, 1 summand, n = 20, 44 payload bytes.
  EXPECT_EQ(hex(frame), "4743465201" "0e0000" "a1870cc2" "01000000" "1400000000000000"
                        "2c00000000000000" "00000000" "5feed488" + payload);
  EXPECT_EQ(read_frame_header(frame).param_hash,
            fnv1a32("dgc:ratio=0.25,warmup_steps=0,warmup_ratio=0.25,sample=0.01"));
}

// Step t's frame sends exactly the top expected[t] of x, and decodes (the decoder accepts the
// whole schedule's range).
void expect_schedule(Codec& codec, const std::vector<float>& x,
                     const std::vector<size_t>& expected) {
  for (uint64_t step = 0; step < expected.size(); ++step) {
    const auto frame = encode(codec, x, {.step = step});
    const auto p = parse_sparse_payload(frame);
    EXPECT_EQ(p.indices.size(), expected[step]) << "step " << step;
    EXPECT_EQ(p.indices, reference_top_k(x, expected[step])) << "step " << step;
    EXPECT_NO_THROW(decode(codec, frame, x.size(), {.step = step}));
  }
}

TEST(Dgc, WarmUpDecaysExponentiallyToTheFinalRatio) {
  // ratio(t) = 0.25 * (0.001 / 0.25)^(t / 4): 25%, 6.29%, 1.58%, 0.398%, then 0.1%.
  auto codec = make_codec("dgc:ratio=0.001,warmup_steps=4,warmup_ratio=0.25");
  const auto x = gradient(10000, 12);
  expect_schedule(*codec, x, {2500, 629, 158, 40, 10, 10, 10});
  EXPECT_EQ(codec->max_frame_bytes(10000), kFrameHeaderBytes + 4 + 8 * 2500);
  // No warm-up: the final ratio from step 0.
  auto plain = make_codec("dgc:ratio=0.001");
  EXPECT_EQ(parse_sparse_payload(encode(*plain, x)).indices.size(), 10u);
}

TEST(Dgc, StagedWarmUpFollowsThePapersStages) {
  // stage_steps = 2: steps 0-1 send 25%, 2-3 6.25%, 4-5 1.5625%, 6-7 0.390625%, then 0.1%
  // (of 10000: 156.25 and 39.0625 round to 156 and 39).
  auto codec = make_codec("dgc:ratio=0.001,stage_steps=2");
  const auto x = gradient(10000, 12);
  expect_schedule(*codec, x, {2500, 2500, 625, 625, 156, 156, 39, 39, 10, 10, 10});
  // Frames are sized for the densest stage; far steps (no overflow) send the final ratio.
  EXPECT_EQ(codec->max_frame_bytes(10000), kFrameHeaderBytes + 4 + 8 * 2500);
  const auto far = encode(*codec, x, {.step = std::numeric_limits<uint64_t>::max()});
  EXPECT_EQ(parse_sparse_payload(far).indices.size(), 10u);
  // A stage never sends less than the final ratio: with ratio 0.05, stages 2 and 3 send 5%.
  auto coarse = make_codec("dgc:ratio=0.05,stage_steps=1");
  expect_schedule(*coarse, x, {2500, 625, 500, 500, 500});
  EXPECT_EQ(codec->spec(), "dgc:ratio=0.001,warmup_steps=0,warmup_ratio=0.25,stage_steps=2,"
                           "sample=0.01");
  const std::string both = error_text([] { make_codec("dgc:warmup_steps=4,stage_steps=2"); });
  EXPECT_NE(both.find("codec 'dgc': parameters 'warmup_steps' and 'stage_steps' are both set"),
            std::string::npos) << both;
  EXPECT_NE(error_text([] { make_codec("dgc:stage_steps=-1"); }).find("parameter 'stage_steps'"),
            std::string::npos);
}

TEST(Dgc, SendsExactlyKOfTheLargestMagnitudes) {
  for (size_t n : {size_t{1000}, size_t{100000}, size_t{300001}}) {
    const auto x = gradient(n, n);  // continuous values: magnitudes distinct
    for (double ratio : {0.001, 0.01, 0.1}) {
      const size_t k = std::max<size_t>(1, static_cast<size_t>(std::llround(ratio * n)));
      auto topk = make_codec("topk:k=" + std::to_string(k));
      const auto exact = parse_sparse_payload(encode(*topk, x));
      for (double sample : {0.001, 0.01, 0.5}) {
        auto codec = make_codec("dgc:ratio=" + format_number(ratio) + ",sample=" + format_number(sample));
        const auto p = parse_sparse_payload(encode(*codec, x, {.seed = 17, .threads = 2}));
        ASSERT_EQ(p.indices.size(), k);
        ASSERT_EQ(p.indices, exact.indices) << "n " << n << " ratio " << ratio << " sample " << sample;
        ASSERT_EQ(p.values, exact.values);
      }
    }
  }
}

TEST(Dgc, KeepsTheLargestNotTheFirstAboveTheThreshold) {
  // Small values first, large ones at the end: a "first k above the threshold" scan would take
  // the early moderately-large ones.
  const size_t n = 100000;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i) * 1e-3f * (i % 2 ? 1.0f : -1.0f);
  auto codec = make_codec("dgc:ratio=0.01,sample=0.001");
  const auto p = parse_sparse_payload(encode(*codec, x));
  ASSERT_EQ(p.indices.size(), 1000u);
  EXPECT_EQ(p.indices.front(), n - 1000);
  EXPECT_EQ(p.indices.back(), n - 1);
}

TEST(Dgc, CanonicalSpec) {
  EXPECT_EQ(make_codec("dgc")->spec(), "dgc:ratio=0.001,warmup_steps=0,warmup_ratio=0.25,sample=0.01");
  auto c = make_codec("dgc:sample=0.1,warmup_ratio=0.5,warmup_steps=1000,ratio=0.01");
  EXPECT_EQ(c->spec(), "dgc:ratio=0.01,warmup_steps=1000,warmup_ratio=0.5,sample=0.1");
  EXPECT_DOUBLE_EQ(c->traits().bits_per_element, 0.64);
  EXPECT_FALSE(c->traits().summable);
}

TEST(Dgc, BadSpecsNameCodecAndParameter) {
  const std::string range = error_text([] { make_codec("dgc:ratio=1.5"); });
  EXPECT_NE(range.find("codec 'dgc': parameter 'ratio' = 1.5 is out of range; allowed: (0, 1]"),
            std::string::npos) << range;
  EXPECT_NE(error_text([] { make_codec("dgc:sample=0"); }).find("parameter 'sample'"), std::string::npos);
  EXPECT_NE(error_text([] { make_codec("dgc:warmup_steps=-3"); }).find("parameter 'warmup_steps'"),
            std::string::npos);
  EXPECT_NE(error_text([] { make_codec("dgc:warmup_ratio=2"); }).find("parameter 'warmup_ratio'"),
            std::string::npos);
  const std::string order = error_text([] { make_codec("dgc:ratio=0.3,warmup_steps=5,warmup_ratio=0.1"); });
  EXPECT_NE(order.find("codec 'dgc': parameter 'warmup_ratio' = 0.1 is below 'ratio' = 0.3"),
            std::string::npos) << order;
  EXPECT_NO_THROW(make_codec("dgc:ratio=0.3,warmup_ratio=0.1"));  // no warm-up: unused
  EXPECT_NE(error_text([] { make_codec("dgc:k=5"); }).find("unknown parameter 'k'"), std::string::npos);
}

TEST(Dgc, DecoderAcceptsOnlyCountsTheScheduleCanGive) {
  auto codec = make_codec("dgc:ratio=0.1,warmup_steps=3,warmup_ratio=0.5");  // n = 20: 2 .. 10
  for (uint32_t count : {0u, 1u, 2u, 10u, 11u}) {
    std::vector<uint32_t> words{count};
    for (uint32_t j = 0; j < count; ++j) words.push_back(j);
    for (uint32_t j = 0; j < count; ++j) words.push_back(0x3f800000);
    std::vector<std::byte> f(kFrameHeaderBytes + 4 * words.size());
    std::memcpy(f.data() + kFrameHeaderBytes, words.data(), 4 * words.size());
    write_frame_header({.codec_id = 14, .param_hash = codec->param_hash(), .elements = 20,
                        .payload_bytes = 4 * words.size()},
                       f);
    std::vector<float> sum(20, 0.0f);
    if (count >= 2 && count <= 10) {
      codec->decode_accumulate(f, sum, {});
      EXPECT_EQ(sum[count - 1], 1.0f);
    } else {
      const std::string text = error_text([&] { codec->decode_accumulate(f, sum, {}); });
      EXPECT_NE(text.find("between 2 and 10"), std::string::npos) << text;
    }
  }
}

}  // namespace
}  // namespace gradcomp
