// onebit: 1-bit SGD (Seide et al. 2014) with two reconstruction values: each element is sent as
// one bit (x < 0) and decoded as the mean of the elements on its side, mean_pos = mean of the
// elements with x >= 0 and mean_neg = mean of the elements with x < 0. This keeps the sum of
// each side exactly (up to rounding): sum(decoded) == sum(x). The aggregate of W ranks is the
// mean. (MergeComp's decoder inverted a 0/1 uint8 mask with `~` and so reconstructed with 254
// and 255; here the bit selects the value directly.) docs/wire-format.md (onebit) describes the frame.
//
// Payload: float32 mean_pos, float32 mean_neg, then ceil(n/8) bytes of bits (LSB-first,
// bit = 1 when x < 0). A side with no element has mean 0. NaN counts on the positive side
// (NaN < 0 is false), so a NaN or Inf input makes a mean non-finite; the header's non-finite
// flag is set too.
#include <cmath>
#include <cstring>
#include <limits>

#include "codec/casts_frame.h"
#include "codec/factories.h"
#include "codec/sign_bits.h"

namespace gradcomp {
namespace {

constexpr const char* kName = "onebit";
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
  CodecId id() const override { return CodecId::kOneBit; }
  std::string spec() const override { return kName; }
  CodecTraits traits() const override { return {.bits_per_element = 1, .unbiased = false}; }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + kMeansBytes + sign_bits::bytes_for(n);
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    casts::check_buffers(kName, n, out, max_frame_bytes(n), residual);
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
    const auto payload = check_frame(frame, expectation(sum.size()), &h);
    const bool non_finite = casts::check_header(
        kName, h, payload.size(), kMeansBytes + sign_bits::bytes_for(sum.size()), false);
    float mean_pos, mean_neg;
    std::memcpy(&mean_pos, payload.data(), 4);
    std::memcpy(&mean_neg, payload.data() + 4, 4);
    if (mean_pos < 0.0f || mean_neg > 0.0f) {
      throw FrameError(fmt::format("codec '{}': means {} (x >= 0) and {} (x < 0) have the wrong "
                                   "signs; allowed: mean_pos >= 0, mean_neg <= 0",
                                   kName, mean_pos, mean_neg));
    }
    casts::check_padding(kName, payload.data() + kMeansBytes, sum.size());
    if (non_finite) {
      casts::add_nan(sum);
      return;
    }
    sign_bits::accumulate_chunks(payload.data() + kMeansBytes, sum, mean_neg, mean_pos,
                                 ctx.threads);
  }
};

}  // namespace

std::unique_ptr<Codec> make_onebit(Spec&) { return std::make_unique<OneBitCodec>(); }

}  // namespace gradcomp
