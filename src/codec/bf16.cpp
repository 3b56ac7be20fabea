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
#if !defined(__clang__)  // a GCC warning clang does not know
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include "codec/factories.h"
#include "codec/half_cast_codec.h"
#include "common/half.h"

namespace gradcomp {
namespace {


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
void encode_bf16_run(const float* x, size_t n, std::byte* out, float* residual) {
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

// sum[i] += bf16(in[i]) for i in [0, n); without kAdd, sum[i] = 0 + bf16(in[i]).
template <bool kAdd>
void accumulate_bf16_run(const std::byte* in, size_t n, float* sum) {
  size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 2 * i));
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m512 base = kAdd ? _mm512_loadu_ps(sum + i) : _mm512_setzero_ps();
    _mm512_storeu_ps(sum + i, _mm512_add_ps(base, v));
  }
#endif
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    sum[i] = (kAdd ? sum[i] : 0.0f) + bf16_to_float(h);
  }
}

// The fp16/bf16 codec's view of this format (half_cast_codec.h).
struct Bf16 {
  static constexpr const char* kName = "bf16";
  static constexpr CodecId kId = CodecId::kBf16;
  static constexpr DType kType = DType::kBF16;
  template <bool kResidual>
  static void encode(const float* x, size_t n, std::byte* out, float* residual) {
    encode_bf16_run<kResidual>(x, n, out, residual);
  }
  template <bool kAdd>
  static void accumulate(const std::byte* in, size_t n, float* sum) {
    accumulate_bf16_run<kAdd>(in, n, sum);
  }
};

}  // namespace

std::unique_ptr<Codec> make_bf16(Spec&) { return std::make_unique<casts::HalfCastCodec<Bf16>>(); }

}  // namespace gradcomp
