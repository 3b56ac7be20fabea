// Vector bodies of the reduce kernels (common/reduce.h). Each kernel handles a prefix of the
// arrays whose length is a multiple of its vector width and returns how many elements it did;
// reduce.h finishes the tail with the scalar kernels, which stay the definition of the bits.
//
// Why the vector code gives exactly the scalar bits:
//  - f16 sum: F16C converts half -> float exactly and float -> half with IEEE round to nearest
//    even, overflow to Inf and subnormals, which is what common/half.h computes; it differs only
//    in NaN payloads, and every NaN sum is replaced by the canonical NaN before narrowing
//    (0x7fc00000 narrows to 0x7e00). The float addition in between is the same instruction.
//  - bf16 sum: widening is a shift; narrowing is half.h's integer rounding, lane by lane.
//  - max (f16, bf16, f32): done on the bit patterns, no conversion. Mapping sign-magnitude bits
//    to two's complement (negatives: flip the magnitude bits) orders non-NaN values as the
//    floats are ordered, with -0 just below +0, and equal keys are equal bits; so the signed
//    integer max is max_f32's "larger value, +0 over -0", and any NaN operand gives the
//    canonical NaN.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace gradcomp::reduce::simd {

// ---- Plain loops the compiler vectorises (any target, wider with -march=native) ----------

// Order-preserving key of a sign-magnitude pattern (see the header comment).
template <typename S>
inline S ordered_key(S bits) {
  constexpr int kSignShift = sizeof(S) * 8 - 1;
  using U = std::make_unsigned_t<S>;
  const S magnitude_mask = static_cast<S>(static_cast<U>(~U{0}) >> 1);
  return static_cast<S>(bits ^ ((bits >> kSignShift) & magnitude_mask));
}

// Max of two float patterns of width S: `inf` is the magnitude of +Inf, so a larger magnitude
// is a NaN. Every step is a same-width compare and select (magnitudes are non-negative, so a
// signed compare is right), which is what lets the loop around it vectorise.
template <typename S>
inline S max_bits(S a, S b, S inf, S canonical_nan) {
  constexpr S kMagnitude = std::numeric_limits<S>::max();
  const S larger = ordered_key(a) > ordered_key(b) ? a : b;
  const S r = static_cast<S>(a & kMagnitude) > inf ? canonical_nan : larger;
  return static_cast<S>(b & kMagnitude) > inf ? canonical_nan : r;
}

// dst[i] = max(dst[i], src[i]) on patterns of width S; the whole array (no tail left).
template <typename S>
inline size_t max_bits_loop(void* dst, const void* src, size_t count, S inf,
                            S canonical_nan) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  for (size_t i = 0; i < count; ++i) {
    S a, b;
    std::memcpy(&a, d + i * sizeof(S), sizeof(S));
    std::memcpy(&b, s + i * sizeof(S), sizeof(S));
    const S r = max_bits<S>(a, b, inf, canonical_nan);
    std::memcpy(d + i * sizeof(S), &r, sizeof(S));
  }
  return count;
}

inline size_t max_f16(void* dst, const void* src, size_t count) {
  return max_bits_loop<int16_t>(dst, src, count, 0x7c00, 0x7e00);
}
inline size_t max_bf16(void* dst, const void* src, size_t count) {
  return max_bits_loop<int16_t>(dst, src, count, 0x7f80, 0x7fc0);
}
inline size_t max_f32(void* dst, const void* src, size_t count) {
  return max_bits_loop<int32_t>(dst, src, count, 0x7f800000, 0x7fc00000);
}

// f32 sum: the scalar kernel's isnan test as a select, so the loop vectorises.
inline size_t sum_f32(void* dst, const void* src, size_t count) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  for (size_t i = 0; i < count; ++i) {
    float a, b;
    std::memcpy(&a, d + i * 4, 4);
    std::memcpy(&b, s + i * 4, 4);
    uint32_t r = std::bit_cast<uint32_t>(a + b);
    r = (r & 0x7fffffffU) > 0x7f800000U ? 0x7fc00000U : r;
    std::memcpy(d + i * 4, &r, 4);
  }
  return count;
}

// bf16 sum: widen by a shift, add, narrow with half.h's rounding (canonical NaN instead of
// the payload it keeps). Written lane by lane for the vectoriser.
inline uint16_t sum_bf16_lane(uint16_t a, uint16_t b) {
  const float f = std::bit_cast<float>(uint32_t{a} << 16) + std::bit_cast<float>(uint32_t{b} << 16);
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (x + 0x7fffU + ((x >> 16) & 1U)) >> 16;
  return static_cast<uint16_t>((x & 0x7fffffffU) > 0x7f800000U ? 0x7fc0U : rounded);
}

#if defined(__AVX2__)
// 16 lanes. Interleaving with zeros puts each bf16 in the top half of a float (the widening
// shift), and packing with unsigned saturation undoes the interleave within each 128-bit lane,
// so the lanes come back in order; the rounded values fit 16 bits, so nothing saturates.
inline __m256i sum_bf16_widened(__m256i a, __m256i b) {
  const __m256 r = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b));
  const __m256i x = _mm256_castps_si256(r);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(r, r, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
}

inline size_t sum_bf16(void* dst, const void* src, size_t count) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  const __m256i zero = _mm256_setzero_si256();
  const size_t whole = count - count % 16;
  for (size_t i = 0; i < whole; i += 16) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + 2 * i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * i));
    const __m256i lo =
        sum_bf16_widened(_mm256_unpacklo_epi16(zero, a), _mm256_unpacklo_epi16(zero, b));
    const __m256i hi =
        sum_bf16_widened(_mm256_unpackhi_epi16(zero, a), _mm256_unpackhi_epi16(zero, b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * i), _mm256_packus_epi32(lo, hi));
  }
  return whole;
}
#else
inline size_t sum_bf16(void* dst, const void* src, size_t count) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  for (size_t i = 0; i < count; ++i) {
    uint16_t a, b;
    std::memcpy(&a, d + i * 2, 2);
    std::memcpy(&b, s + i * 2, 2);
    const uint16_t r = sum_bf16_lane(a, b);
    std::memcpy(d + i * 2, &r, 2);
  }
  return count;
}
#endif

// ---- f16 sum: needs the hardware conversions ---------------------------------------------

// 256-bit only: AVX-512 gains nothing here (the loop is memory bound; Zen 4 splits 512-bit
// operations anyway), and GCC 12 warns falsely (-Wmaybe-uninitialized) in its 512-bit
// conversion intrinsics.
#if defined(__F16C__) && defined(__AVX__)
// 8 lanes: widen, add, canonical NaN (as a float, so it narrows to 0x7e00), narrow.
inline size_t sum_f16(void* dst, const void* src, size_t count) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  const size_t whole = count - count % 8;
  for (size_t i = 0; i < whole; i += 8) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 2 * i)));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i)));
    __m256 r = _mm256_add_ps(a, b);
    r = _mm256_blendv_ps(r, nan, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * i),
                     _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
  }
  return whole;
}
#else
// No conversion instructions: the scalar kernel does it all.
inline size_t sum_f16(void*, const void*, size_t) { return 0; }
#endif

}  // namespace gradcomp::reduce::simd
