// onebit: 1-bit SGD (Seide et al. 2014) with two reconstruction values: each element is sent as
// one bit (x < 0) and decoded as the mean of the elements on its side, mean_pos = mean of the
// elements with x >= 0 and mean_neg = mean of the elements with x < 0. This keeps the sum of
// each side exactly (up to rounding): sum(decoded) == sum(x). The aggregate of W ranks is the
// mean. (MergeComp's decoder inverted a 0/1 uint8 mask with `~` and so reconstructed with 254
// and 255; here the bit selects the value directly.) docs/wire-format.md (onebit) describes the frame.
//
// With block=B (a multiple of 8), each block of B elements has its own two means (the scaled
// 1-bit codes of BytePS-Compress and DeepSpeed are per tensor or per chunk): a fused bucket's
// layers keep their own scales, and an all-zero block (an embedding row no token touched)
// decodes to zeros instead of to the bucket's positive mean.
//
// Payload: float32 mean_pos, float32 mean_neg (one pair per block with block=B, in block order),
// then ceil(n/8) bytes of bits (LSB-first, bit = 1 when x < 0). A side with no element has
// mean 0. NaN counts on the positive side
// (NaN < 0 is false), so a NaN or Inf input makes a mean non-finite; the header's non-finite
// flag is set too.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "codec/casts_frame.h"
#include "codec/factories.h"
#include "codec/sign_bits.h"

namespace gradcomp {
namespace {

constexpr const char* kOnebitName = "onebit";
constexpr size_t kMeansBytes = 8;

// sum / count rounded to float32, 0 for an empty side; every NaN becomes the same quiet NaN so
// the bytes do not depend on which NaN payload won the sum.
float side_mean(double sum, uint64_t count) {
  if (count == 0) return 0.0f;
  const auto mean = static_cast<float>(sum / static_cast<double>(count));
  return std::isnan(mean) ? std::numeric_limits<float>::quiet_NaN() : mean;
}

class OneBitCodec final : public Codec {
 public:
  explicit OneBitCodec(uint64_t block) : block_(block) {}
  CodecId id() const override { return CodecId::kOneBit; }
  std::string spec() const override {
    return block_ ? fmt::format("{}:block={}", kOnebitName, block_) : kOnebitName;
  }
  CodecTraits traits() const override { return {.bits_per_element = 1, .unbiased = false}; }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + means_bytes(n) + sign_bits::bytes_for(n);
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    casts::check_buffers(kOnebitName, n, out, max_frame_bytes(n), residual);
    if (block_) return encode_blocks(input, out, residual);
    std::byte* payload = out.data() + kFrameHeaderBytes;
    // One pass packs the bits and sums each side per chunk (double, folded in chunk order);
    // the residual needs the means, so it takes a second pass.
    const sign_bits::SplitSums sums = reduce_chunks<sign_bits::SplitSums>(
        n, ctx.threads, {},
        [&](size_t b, size_t e) {
          return sign_bits::pack_split_sums(
              input.data() + b, e - b, reinterpret_cast<uint8_t*>(payload + kMeansBytes) + b / 8);
        },
        [](const sign_bits::SplitSums& a, const sign_bits::SplitSums& c) {
          return sign_bits::SplitSums{a.positive + c.positive, a.negative + c.negative,
                                      a.negatives + c.negatives};
        });
    const float mean_pos = side_mean(sums.positive, n - sums.negatives);
    const float mean_neg = side_mean(sums.negative, sums.negatives);
    const bool non_finite = !std::isfinite(mean_pos) || !std::isfinite(mean_neg);
    std::memcpy(payload, &mean_pos, 4);
    std::memcpy(payload + 4, &mean_neg, 4);
    if (!residual.empty()) {
      sign_bits::residual_chunks(input, mean_neg, mean_pos, residual, ctx.threads);
    }
    write_frame_header({.codec_id = static_cast<uint8_t>(id()),
                        .flags = non_finite ? kFlagNonFinite : uint8_t{0},
                        .param_hash = param_hash(), .elements = n,
                        .payload_bytes = kMeansBytes + sign_bits::bytes_for(n)},
                       out);
    return max_frame_bytes(n);
  }

  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override {
    FrameHeader h;
    const size_t n = sum.size();
    const auto payload = check_frame(frame, expectation(n), &h);
    const size_t means = means_bytes(n);
    const bool non_finite =
        casts::check_header(kOnebitName, h, payload.size(), means + sign_bits::bytes_for(n), false);
    for (size_t k = 0; k < means / kMeansBytes; ++k) check_means(payload.data(), k);
    casts::check_padding(kOnebitName, payload.data() + means, n);
    if (non_finite) {
      casts::add_nan(sum);
      return;
    }
    const std::byte* bits = payload.data() + means;
    if (!block_) {
      const auto [mean_pos, mean_neg] = read_means(payload.data(), 0);
      sign_bits::accumulate_chunks(bits, sum, mean_neg, mean_pos, ctx.threads);
      return;
    }
    for (size_t k = 0, b = 0; b < n; ++k, b += block_) {
      const auto [mean_pos, mean_neg] = read_means(payload.data(), k);
      sign_bits::accumulate(reinterpret_cast<const uint8_t*>(bits) + b / 8,
                            std::min<size_t>(block_, n - b), mean_neg, mean_pos, sum.data() + b);
    }
  }

 private:
  // Bytes of the means: one pair, or one per block (none for an empty input with blocks).
  size_t means_bytes(size_t n) const {
    return block_ ? kMeansBytes * ((n + block_ - 1) / block_) : kMeansBytes;
  }

  static std::pair<float, float> read_means(const std::byte* payload, size_t k) {
    float mean_pos, mean_neg;
    std::memcpy(&mean_pos, payload + k * kMeansBytes, 4);
    std::memcpy(&mean_neg, payload + k * kMeansBytes + 4, 4);
    return {mean_pos, mean_neg};
  }

  static void check_means(const std::byte* payload, size_t k) {
    const auto [mean_pos, mean_neg] = read_means(payload, k);
    if (mean_pos < 0.0f || mean_neg > 0.0f) {
      throw FrameError(
          fmt::format("codec '{}': means {} (x >= 0) and {} (x < 0) of block {} "
                      "have the wrong signs; allowed: mean_pos >= 0, mean_neg <= 0",
                      kOnebitName, mean_pos, mean_neg, k));
    }
  }

  // Each block packs its bits and sums its sides in one pass (its means are its own), then
  // takes its residual.
  size_t encode_blocks(std::span<const float> input, std::span<std::byte> out,
                       std::span<float> residual) const {
    const size_t n = input.size();
    std::byte* payload = out.data() + kFrameHeaderBytes;
    auto* bits = reinterpret_cast<uint8_t*>(payload + means_bytes(n));
    bool non_finite = false;
    for (size_t k = 0, b = 0; b < n; ++k, b += block_) {
      const size_t len = std::min<size_t>(block_, n - b);
      const sign_bits::SplitSums sums = sign_bits::pack_split_sums(input.data() + b, len,
                                                                   bits + b / 8);
      const float mean_pos = side_mean(sums.positive, len - sums.negatives);
      const float mean_neg = side_mean(sums.negative, sums.negatives);
      non_finite = non_finite || !std::isfinite(mean_pos) || !std::isfinite(mean_neg);
      std::memcpy(payload + k * kMeansBytes, &mean_pos, 4);
      std::memcpy(payload + k * kMeansBytes + 4, &mean_neg, 4);
      if (!residual.empty()) {
        sign_bits::residual(input.data() + b, len, mean_neg, mean_pos, residual.data() + b);
      }
    }
    write_frame_header({.codec_id = static_cast<uint8_t>(id()),
                        .flags = non_finite ? kFlagNonFinite : uint8_t{0},
                        .param_hash = param_hash(), .elements = n,
                        .payload_bytes = means_bytes(n) + sign_bits::bytes_for(n)},
                       out);
    return max_frame_bytes(n);
  }

  uint64_t block_;  // elements per pair of means; 0: one pair for the whole input
};

}  // namespace

std::unique_ptr<Codec> make_onebit(Spec& spec) {
  // 0: one pair of means for the whole input. Else a multiple of 8, so every block's bits
  // start on a byte.
  const auto block = spec.get_int("block", 0, 0, int64_t{1} << 40);
  if (block % 8 != 0) {
    spec.fail(fmt::format("parameter 'block' = {} is not a multiple of 8; allowed: 0 (one pair "
                          "of means) or a multiple of 8", block));
  }
  return std::make_unique<OneBitCodec>(static_cast<uint64_t>(block));
}

}  // namespace gradcomp
