// efsignsgd: scaled sign (Karimireddy et al., "Error Feedback Fixes SignSGD"): every element is
// sent as sign(x) * scale with scale = mean |x| = ||x||_1 / n, so the decoded vector has the
// input's l1 norm. Zero counts as +. Meant to run with error feedback (the fused residual).
// The aggregate of W ranks is the mean. docs/wire-format.md (efsignsgd) describes the frame.
//
// Payload: float32 scale, then ceil(n/8) bytes of sign bits (LSB-first, bit = 1 when x < 0).
// A NaN or Inf input makes the scale non-finite; the header's non-finite flag is set too.
#include <cmath>
#include <cstring>
#include <limits>

#include "codec/casts_frame.h"
#include "codec/factories.h"
#include "codec/sign_bits.h"

namespace gradcomp {
namespace {

constexpr const char* kEfsignsgdName = "efsignsgd";
constexpr size_t kScaleBytes = 4;

class EfSignSgdCodec final : public Codec {
 public:
  CodecId id() const override { return CodecId::kEfSignSgd; }
  std::string spec() const override { return kEfsignsgdName; }
  CodecTraits traits() const override { return {.bits_per_element = 1, .unbiased = false}; }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + kScaleBytes + sign_bits::bytes_for(n);
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    casts::check_buffers(kEfsignsgdName, n, out, max_frame_bytes(n), residual);
    std::byte* payload = out.data() + kFrameHeaderBytes;
    // One pass packs the bits and sums |x| per chunk (in double, folded in chunk order); the
    // residual needs the scale, so it takes a second pass.
    const double abs_sum = reduce_chunks<double>(
        n, ctx.threads, 0.0,
        [&](size_t b, size_t e) {
          return sign_bits::pack_abs_sum(input.data() + b, e - b,
                                         reinterpret_cast<uint8_t*>(payload + kScaleBytes) + b / 8);
        },
        [](double a, double c) { return a + c; });
    float scale = n == 0 ? 0.0f : static_cast<float>(abs_sum / static_cast<double>(n));
    const bool non_finite = !std::isfinite(scale);
    // One NaN for every input, so the bytes do not depend on which NaN payload won the sum.
    if (std::isnan(scale)) scale = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(payload, &scale, kScaleBytes);
    if (!residual.empty()) {
      sign_bits::residual_chunks(input, -scale, scale, residual, ctx.threads);
    }
    write_frame_header({.codec_id = static_cast<uint8_t>(id()),
                        .flags = non_finite ? kFlagNonFinite : uint8_t{0},
                        .param_hash = param_hash(), .elements = n,
                        .payload_bytes = kScaleBytes + sign_bits::bytes_for(n)},
                       out);
    return max_frame_bytes(n);
  }

  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override {
    FrameHeader h;
    const auto payload = check_frame(frame, expectation(sum.size()), &h);
    const bool non_finite = casts::check_header(
        kEfsignsgdName, h, payload.size(), kScaleBytes + sign_bits::bytes_for(sum.size()), false);
    float scale;
    std::memcpy(&scale, payload.data(), kScaleBytes);
    if (scale < 0.0f) {
      throw FrameError(fmt::format("codec '{}': scale {} is negative; a mean of |x| is >= 0",
                                   kEfsignsgdName, scale));
    }
    casts::check_padding(kEfsignsgdName, payload.data() + kScaleBytes, sum.size());
    if (non_finite) {
      casts::add_nan(sum);
      return;
    }
    sign_bits::accumulate_chunks(payload.data() + kScaleBytes, sum, -scale, scale, ctx.threads);
  }
};

}  // namespace

std::unique_ptr<Codec> make_efsignsgd(Spec&) { return std::make_unique<EfSignSgdCodec>(); }

}  // namespace gradcomp
