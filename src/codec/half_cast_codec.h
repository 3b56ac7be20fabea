// The codec shared by fp16 and bf16: each float32 cast to a 16-bit float, the payload n
// little-endian 16-bit values, summable as that type. A Format names the codec and supplies its
// two kernels:
//   static constexpr const char* kName;  static constexpr CodecId kId;  static constexpr DType kType;
//   template <bool kResidual> static void encode(const float* x, size_t n, std::byte* out, float* residual);
//   template <bool kAdd> static void accumulate(const std::byte* in, size_t n, float* sum);
//     (sum[i] += value, or without kAdd sum[i] = 0 + value: decode_into without a fill)
#pragma once

#include "codec/casts_frame.h"
#include "codec/one_decoder_codec.h"
#include "common/parallel.h"
#include "gradcomp/codec.h"

namespace gradcomp::casts {

template <typename Format>
class HalfCastCodec final : public OneDecoderCodec<HalfCastCodec<Format>> {
 public:
  CodecId id() const override { return Format::kId; }
  std::string spec() const override { return Format::kName; }
  CodecTraits traits() const override {
    return {.summable = true, .payload_type = Format::kType, .bits_per_element = 16,
            .unbiased = false, .payload_carries_nonfinite = true};
  }
  size_t max_frame_bytes(size_t n) const override { return kFrameHeaderBytes + 2 * n; }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    check_buffers(Format::kName, n, out, max_frame_bytes(n), residual);
    std::byte* payload = out.data() + kFrameHeaderBytes;
    for_chunks(n, ctx.threads, [&](size_t b, size_t e, size_t) {
      if (residual.empty()) {
        Format::template encode<false>(input.data() + b, e - b, payload + 2 * b, nullptr);
      } else {
        Format::template encode<true>(input.data() + b, e - b, payload + 2 * b,
                                      residual.data() + b);
      }
    });
    write_frame_header({.codec_id = static_cast<uint8_t>(id()),
                        .param_hash = this->param_hash(),
                        .elements = n,
                        .payload_bytes = 2 * n},
                       out);
    return max_frame_bytes(n);
  }

 private:
  friend class OneDecoderCodec<HalfCastCodec<Format>>;
  template <bool kAdd>
  void decode(std::span<const std::byte> frame, std::span<float> sum, const Context& ctx) const {
    FrameHeader h;
    const auto payload = check_frame(frame, this->expectation(sum.size()), &h);
    // Half precision carries NaN and Inf itself, so the non-finite flag is never written.
    check_header(Format::kName, h, payload.size(), 2 * sum.size(), /*summable=*/true,
                 /*allowed_flags=*/0);
    for_chunks(sum.size(), ctx.threads, [&](size_t b, size_t e, size_t) {
      Format::template accumulate<kAdd>(payload.data() + 2 * b, e - b, sum.data() + b);
    });
  }
};

}  // namespace gradcomp::casts
