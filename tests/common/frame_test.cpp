#include "gradcomp/frame.h"

#include <gtest/gtest.h>

#include <vector>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

std::vector<std::byte> sample_frame(size_t payload = 8) {
  std::vector<std::byte> f(kFrameHeaderBytes + payload, std::byte{0x5a});
  write_frame_header({.codec_id = 12, .round = 0, .flags = 0, .param_hash = 0xdeadbeef,
                      .summands = 1, .elements = 3, .payload_bytes = payload, .aux = 7},
                     f);
  return f;
}

std::string frame_error_of(std::span<const std::byte> f, const FrameExpectation& e) {
  try {
    check_frame(f, e, nullptr);
  } catch (const FrameError& err) {
    return err.what();
  }
  return "no error";
}

const FrameExpectation kTopk{12, "topk", 0xdeadbeef, 0, 3};

TEST(Frame, HeaderLayoutIsTheDocumentedOne) {
  const auto f = sample_frame();
  // magic "GCFR", version 1, codec 12, round 0, flags 0, hash, summands 1, n = 3, payload 8, aux 7
  EXPECT_EQ(testing::hex(std::span(f).first(36)),
            "47434652010c0000efbeadde01000000030000000000000008000000000000000700000"
            "0");
  const FrameHeader h = read_frame_header(f);
  EXPECT_EQ(h.codec_id, 12);
  EXPECT_EQ(h.param_hash, 0xdeadbeefU);
  EXPECT_EQ(h.elements, 3u);
  EXPECT_EQ(h.payload_bytes, 8u);
  EXPECT_EQ(h.aux, 7u);
}

TEST(Frame, Crc32MatchesTheStandardCheckValue) {
  const std::string text = "123456789";
  EXPECT_EQ(crc32(std::as_bytes(std::span(text))), 0xcbf43926U);
}

TEST(Frame, AcceptsAMatchingFrame) {
  const auto f = sample_frame();
  FrameHeader h;
  const auto payload = check_frame(f, kTopk, &h);
  EXPECT_EQ(payload.size(), 8u);
  EXPECT_EQ(payload.data(), f.data() + kFrameHeaderBytes);
}

TEST(Frame, RejectsEachKindOfDamageWithAClearMessage) {
  auto f = sample_frame();
  EXPECT_NE(frame_error_of(std::span(f).first(10), kTopk).find("truncated: 10 bytes"),
            std::string::npos);
  EXPECT_NE(frame_error_of(std::span(f).first(45), kTopk).find("8-byte payload, 5 bytes follow"),
            std::string::npos);
  auto magic = f;
  magic[0] = std::byte{0};
  EXPECT_NE(frame_error_of(magic, kTopk).find("not a gradcomp frame"), std::string::npos);
  auto version = f;
  version[4] = std::byte{9};
  EXPECT_NE(frame_error_of(version, kTopk).find("version 9 is not supported"), std::string::npos);
  auto corrupt = f;
  corrupt[20] ^= std::byte{1};
  EXPECT_NE(frame_error_of(corrupt, kTopk).find("checksum"), std::string::npos);
  EXPECT_NE(frame_error_of(f, {4, "qsgd", 0xdeadbeef, 0, 3}).find("frame is from codec 'topk'"),
            std::string::npos);
  EXPECT_NE(frame_error_of(f, {12, "topk", 1, 0, 3}).find("other parameters"), std::string::npos);
  EXPECT_NE(frame_error_of(f, {12, "topk", 0xdeadbeef, 1, 3}).find("round 0, expected round 1"),
            std::string::npos);
  EXPECT_NE(
      frame_error_of(f, {12, "topk", 0xdeadbeef, 0, 4}).find("holds 3 elements, the buffer has 4"),
      std::string::npos);
  auto longer = f;
  longer.push_back(std::byte{0});
  EXPECT_NE(frame_error_of(longer, kTopk).find("its header says 48"), std::string::npos);
}

TEST(Frame, PlainHeaderAllowsOnlyTheNonFiniteFlagNoAuxAndOneSummand) {
  check_plain_header({.flags = kFlagNonFinite}, "topk", false);
  check_plain_header({.summands = 4}, "fp16", true);
  const auto text = [](const FrameHeader& h, bool summable) {
    return testing::error_text([&] { check_plain_header(h, "topk", summable); });
  };
  EXPECT_EQ(text({.flags = 2}, false),
            "codec 'topk': frame flags 0x02 hold unknown bits; allowed: 0x00 or 0x01 (non-finite)");
  EXPECT_EQ(text({.aux = 5}, true), "codec 'topk': frame aux is 0x5; this codec writes 0");
  EXPECT_EQ(text({.summands = 2}, false),
            "codec 'topk': frame sums 2 frames, but this codec's frames cannot be summed; "
            "allowed: 1");
}

TEST(Frame, ZeroSummandsIsCorruption) {
  std::vector<std::byte> f(kFrameHeaderBytes);
  write_frame_header({.codec_id = 1, .summands = 0}, f);
  EXPECT_THROW(read_frame_header(f), FrameError);
}

TEST(Frame, ReduceFrameIntoAddsPayloadsAndSummands) {
  auto a = make_codec("none"), b = make_codec("none");
  const std::vector<float> x = {1, 2, 3}, y = {10, 20, 30};
  auto fa = testing::encode(*a, x), fb = testing::encode(*b, y);
  reduce_frame_into(fa, fb, DType::kF32, ReduceOp::kSum);
  EXPECT_EQ(read_frame_header(fa).summands, 2u);
  EXPECT_EQ(testing::decode(*a, fa, 3), (std::vector<float>{11, 22, 33}));
  reduce_frame_into(fa, testing::encode(*b, std::vector<float>{100, 0, 0}), DType::kF32,
                    ReduceOp::kMax);
  EXPECT_EQ(testing::decode(*a, fa, 3), (std::vector<float>{100, 22, 33}));
  auto other = testing::encode(*b, std::vector<float>{1, 2});
  EXPECT_THROW(reduce_frame_into(fa, other, DType::kF32, ReduceOp::kSum), FrameError);
}

// A header does not name its payload type: the reducer knows each codec's, and refuses another
// (an f16 frame of 4 elements is 8 bytes, which would also pass as two f32 values).
TEST(Frame, ReduceFrameIntoRefusesAnotherPayloadType) {
  auto half = make_codec("fp16");
  auto fa = testing::encode(*half, std::vector<float>{1, 2, 3, 4});
  const auto fb = testing::encode(*half, std::vector<float>{1, 2, 3, 4});
  EXPECT_EQ(testing::error_text([&] { reduce_frame_into(fa, fb, DType::kF32, ReduceOp::kSum); }),
            "frames of codec 'fp16' (round 0) hold f16 payloads; they cannot be reduced as f32");
  EXPECT_THROW(reduce_frame_into(fa, fb, DType::kBF16, ReduceOp::kSum), FrameError);
  EXPECT_EQ(read_frame_header(fa).summands, 1u);  // nothing was added
  EXPECT_NO_THROW(reduce_frame_into(fa, fb, DType::kF16, ReduceOp::kSum));

  auto none = make_codec("none");
  auto fn = testing::encode(*none, std::vector<float>{1, 2});
  EXPECT_THROW(reduce_frame_into(fn, fn, DType::kF16, ReduceOp::kSum), FrameError);
  auto top = make_codec("topk:ratio=0.5");
  auto ft = testing::encode(*top, std::vector<float>{1, 2, 3, 4});
  EXPECT_EQ(testing::error_text([&] { reduce_frame_into(ft, ft, DType::kF32, ReduceOp::kSum); }),
            "frames of codec 'topk' are not summable; they cannot be reduced as f32");
}

}  // namespace
}  // namespace gradcomp
