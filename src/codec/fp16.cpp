// fp16: each float32 is cast to IEEE binary16, round to nearest even. Overflow becomes Inf and
// NaN stays NaN (IEEE semantics, so a loss scaler sees an overflow). Summable: payloads of
// several ranks add element-wise as fp16. docs/wire-format.md (fp16) describes the frame.
//
// Payload: n little-endian binary16 values.
#include <cstring>

#if defined(__AVX512F__) || defined(__F16C__)
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

// vcvtps2ph's rounding control: round to nearest even whatever MXCSR says, no exceptions.
#if defined(__AVX512F__) || defined(__F16C__)
constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#endif

// Casts x[0, n) into out (2n bytes); residual[i] = x[i] - half(x[i]) when kResidual (it may
// alias x). The vector paths and the scalar tail give the bytes of float_to_half (half.h).
template <bool kResidual>
void encode_half_run(const float* x, size_t n, std::byte* out, float* residual) {
  size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256i h = _mm512_cvtps_ph(v, kRne);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i), h);
    if constexpr (kResidual) _mm512_storeu_ps(residual + i, _mm512_sub_ps(v, _mm512_cvtph_ps(h)));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m128i h = _mm256_cvtps_ph(v, kRne);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), h);
    if constexpr (kResidual) _mm256_storeu_ps(residual + i, _mm256_sub_ps(v, _mm256_cvtph_ps(h)));
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    const uint16_t h = float_to_half(v);
    std::memcpy(out + 2 * i, &h, 2);
    if constexpr (kResidual) residual[i] = v - half_to_float(h);
  }
}

// sum[i] += half(in[i]) for i in [0, n); without kAdd, sum[i] = 0 + half(in[i]) (the same bits
// as adding into zeros, without reading `sum`).
template <bool kAdd>
void accumulate_half_run(const std::byte* in, size_t n, float* sum) {
  size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 2 * i));
    const __m512 base = kAdd ? _mm512_loadu_ps(sum + i) : _mm512_setzero_ps();
    _mm512_storeu_ps(sum + i, _mm512_add_ps(base, _mm512_cvtph_ps(h)));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
    const __m256 base = kAdd ? _mm256_loadu_ps(sum + i) : _mm256_setzero_ps();
    _mm256_storeu_ps(sum + i, _mm256_add_ps(base, _mm256_cvtph_ps(h)));
  }
#endif
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    sum[i] = (kAdd ? sum[i] : 0.0f) + half_to_float(h);
  }
}

// The fp16/bf16 codec's view of this format (half_cast_codec.h).
struct Fp16 {
  static constexpr const char* kName = "fp16";
  static constexpr CodecId kId = CodecId::kFp16;
  static constexpr DType kType = DType::kF16;
  template <bool kResidual>
  static void encode(const float* x, size_t n, std::byte* out, float* residual) {
    encode_half_run<kResidual>(x, n, out, residual);
  }
  template <bool kAdd>
  static void accumulate(const std::byte* in, size_t n, float* sum) {
    accumulate_half_run<kAdd>(in, n, sum);
  }
};

}  // namespace

std::unique_ptr<Codec> make_fp16(Spec&) { return std::make_unique<casts::HalfCastCodec<Fp16>>(); }

}  // namespace gradcomp
