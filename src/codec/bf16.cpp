// bf16: each float32 is cast to bfloat16 (the top 16 bits of a float32), round to nearest even.
// Inf stays Inf and NaN stays NaN (quiet bit forced). Summable: payloads of several ranks add
// element-wise as bf16. docs/wire-format.md (bf16) describes the frame.
//
// Payload: n little-endian bfloat16 values.
//
// The vector path rounds with integer operations rather than vcvtneps2bf16, because that
// instruction flushes float32 subnormals to zero while float_to_bf16 (half.h) rounds them; the
// bytes must not depend on the instruction set.
#include <cstring>

#if defined(__AVX512F__)
// GCC 12 flags the intrinsics' internal _mm512_undefined_* values as uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include "codec/casts_frame.h"
#include "codec/factories.h"
#include "common/half.h"
#include "common/parallel.h"

namespace gradcomp {
namespace {

constexpr const char* kName = "bf16";

#if defined(__AVX512F__)
// float_to_bf16 on 16 lanes, widened to 32 bits: (x + 0x7fff + lsb) >> 16, or for a NaN its
// top half with the quiet bit set.
inline __m512i round_to_bf16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i top = _mm512_srli_epi32(x, 16);
  const __m512i lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_or_epi32(rounded, nan, top, _mm512_set1_epi32(0x40));
}
#endif

// Casts x[0, n) into out (2n bytes); residual[i] = x[i] - bf16(x[i]) when kResidual (it may
// alias x).
template <bool kResidual>
void encode_run(const float* x, size_t n, std::byte* out, float* residual) {
  size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512i wide = round_to_bf16(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i), _mm512_cvtepi32_epi16(wide));
    if constexpr (kResidual) {
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
      _mm512_storeu_ps(residual + i, _mm512_sub_ps(v, back));
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    const uint16_t h = float_to_bf16(v);
    std::memcpy(out + 2 * i, &h, 2);
    if constexpr (kResidual) residual[i] = v - bf16_to_float(h);
  }
}

// sum[i] += bf16(in[i]) for i in [0, n).
void accumulate_run(const std::byte* in, size_t n, float* sum) {
  size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 2 * i));
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm512_storeu_ps(sum + i, _mm512_add_ps(_mm512_loadu_ps(sum + i), v));
  }
#endif
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    sum[i] += bf16_to_float(h);
  }
}

class Bf16Codec final : public Codec {
 public:
  CodecId id() const override { return CodecId::kBf16; }
  std::string spec() const override { return kName; }
  CodecTraits traits() const override {
    return {.summable = true, .payload_type = DType::kBF16, .bits_per_element = 16,
            .unbiased = false};
  }
  size_t max_frame_bytes(size_t n) const override { return kFrameHeaderBytes + 2 * n; }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    casts::check_buffers(kName, n, out, max_frame_bytes(n), residual);
    std::byte* payload = out.data() + kFrameHeaderBytes;
    for_chunks(n, ctx.threads, [&](size_t b, size_t e, size_t) {
      if (residual.empty()) {
        encode_run<false>(input.data() + b, e - b, payload + 2 * b, nullptr);
      } else {
        encode_run<true>(input.data() + b, e - b, payload + 2 * b, residual.data() + b);
      }
    });
    write_frame_header({.codec_id = static_cast<uint8_t>(id()), .param_hash = param_hash(),
                        .elements = n, .payload_bytes = 2 * n},
                       out);
    return max_frame_bytes(n);
  }

  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override {
    FrameHeader h;
    const auto payload = check_frame(frame, expectation(sum.size()), &h);
    const bool non_finite =
        casts::check_header(kName, h, payload.size(), 2 * sum.size(), /*summable=*/true);
    for_chunks(sum.size(), ctx.threads, [&](size_t b, size_t e, size_t) {
      accumulate_run(payload.data() + 2 * b, e - b, sum.data() + b);
    });
    if (non_finite) casts::add_nan(sum);
  }
};

}  // namespace

std::unique_ptr<Codec> make_bf16(Spec&) { return std::make_unique<Bf16Codec>(); }

}  // namespace gradcomp
