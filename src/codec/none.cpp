// none: float32 as is. The uncompressed baseline; summable as float32.
//
// Payload: n little-endian float32 values.
#include <fmt/format.h>

#include <cstring>

#include "codec/factories.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

class NoneCodec final : public Codec {
 public:
  CodecId id() const override { return CodecId::kNone; }
  std::string spec() const override { return "none"; }
  CodecTraits traits() const override {
    return {.summable = true, .payload_type = DType::kF32, .bits_per_element = 32,
            .payload_carries_nonfinite = true};
  }
  size_t max_frame_bytes(size_t n) const override { return kFrameHeaderBytes + 4 * n; }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context&,
                std::span<float> residual) override {
    const size_t n = input.size();
    if (out.size() < max_frame_bytes(n)) {
      throw Error(fmt::format("codec 'none': output buffer of {} bytes is too small; the frame "
                              "needs {}", out.size(), max_frame_bytes(n)));
    }
    if (!residual.empty() && residual.size() != n) {
      throw Error(fmt::format("codec 'none': residual has {} elements, the input {}; allowed: "
                              "empty or the input's length", residual.size(), n));
    }
    // memcpy with a null pointer is undefined even for 0 bytes, and an empty span may hold one.
    if (n > 0) std::memcpy(out.data() + kFrameHeaderBytes, input.data(), 4 * n);
    write_frame_header({.codec_id = static_cast<uint8_t>(id()), .param_hash = param_hash(),
                        .elements = n, .payload_bytes = 4 * n},
                       out);
    for (float& r : residual) r = 0.0f;  // lossless: nothing is left behind
    return kFrameHeaderBytes + 4 * n;
  }

  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context&) const override {
    FrameHeader h;
    const auto payload = check_frame(frame, expectation(sum.size()), &h);
    // The payload carries NaN and Inf as they are, so no flag is ever written.
    check_plain_header(h, "none", /*summable=*/true, /*allowed_flags=*/0);
    if (payload.size() != 4 * sum.size()) {
      throw FrameError("none: payload length is not 4 bytes per element");
    }
    const std::byte* p = payload.data();
    for (size_t i = 0; i < sum.size(); ++i) {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      sum[i] += v;
    }
  }
};

}  // namespace

std::unique_ptr<Codec> make_none(Spec&) { return std::make_unique<NoneCodec>(); }

}  // namespace gradcomp
