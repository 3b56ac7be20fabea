// Kernels shared by the sign codecs (signsgd, efsignsgd, signum, onebit): one bit per element,
// LSB-first (element i is bit i%8 of byte i/8, as in bitpack.h), bit = 1 when x < 0. Zero, -0
// and NaN give bit 0: "x < 0" is false for them.
//
// Each kernel works on one run of elements whose bits start on a byte boundary (a kChunk chunk
// of parallel.h), writes ceil(n/8) bytes with the padding bits of the last byte zero, and
// exists twice: `scalar` (portable) and `avx512` (16 elements per step). Both give identical
// bytes and identical double sums: a sum keeps 16 lanes, lane l adds the elements i with
// i % 16 == l in order, and the lanes are folded 0..15 at the end.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "common/parallel.h"

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

namespace gradcomp::sign_bits {

inline constexpr size_t kLanes = 16;
inline constexpr uint32_t kAbsMask = 0x7fffffffU;
inline constexpr uint32_t kInfBits = 0x7f800000U;

inline size_t bytes_for(size_t n) { return (n + 7) / 8; }

// Positive and negative partial sums of one run (onebit's two reconstruction values).
struct SplitSums {
  double positive = 0;  // elements with bit 0 (x >= 0, or NaN)
  double negative = 0;  // elements with bit 1 (x < 0)
  uint64_t negatives = 0;
};

inline double fold_lanes(const double (&lanes)[kLanes]) {
  double total = 0;
  for (double v : lanes) total += v;
  return total;
}

namespace scalar {

inline bool non_finite(float v) { return (std::bit_cast<uint32_t>(v) & kAbsMask) >= kInfBits; }

// Bits of x; residual[i] = x[i] - (x[i] < 0 ? neg : pos) when residual is not null (it may
// alias x). Returns whether any x[i] is NaN or Inf.
inline bool pack(const float* x, size_t n, uint8_t* bits, float neg, float pos,
                 float* residual) {
  bool bad = false;
  for (size_t i = 0; i < n; i += 8) {
    const size_t m = n - i < 8 ? n - i : 8;
    uint8_t byte = 0;
    for (size_t l = 0; l < m; ++l) {
      const float v = x[i + l];
      const bool negative = v < 0.0f;
      byte |= static_cast<uint8_t>(negative) << l;
      bad |= non_finite(v);
      if (residual != nullptr) residual[i + l] = v - (negative ? neg : pos);
    }
    bits[i / 8] = byte;
  }
  return bad;
}

// Bits of x and the sum of |x[i]|.
inline double pack_abs_sum(const float* x, size_t n, uint8_t* bits) {
  double lanes[kLanes] = {};
  for (size_t i = 0; i < n; i += 8) {
    const size_t m = n - i < 8 ? n - i : 8;
    uint8_t byte = 0;
    for (size_t l = 0; l < m; ++l) {
      const float v = x[i + l];
      byte |= static_cast<uint8_t>(v < 0.0f) << l;
      lanes[(i + l) % kLanes] += static_cast<double>(std::bit_cast<float>(
          std::bit_cast<uint32_t>(v) & kAbsMask));
    }
    bits[i / 8] = byte;
  }
  return fold_lanes(lanes);
}

// Bits of x and the sums of the elements on each side.
inline SplitSums pack_split_sums(const float* x, size_t n, uint8_t* bits) {
  double pos[kLanes] = {}, neg[kLanes] = {};
  uint64_t negatives = 0;
  for (size_t i = 0; i < n; i += 8) {
    const size_t m = n - i < 8 ? n - i : 8;
    uint8_t byte = 0;
    for (size_t l = 0; l < m; ++l) {
      const float v = x[i + l];
      const bool negative = v < 0.0f;
      byte |= static_cast<uint8_t>(negative) << l;
      negatives += negative;
      (negative ? neg : pos)[(i + l) % kLanes] += static_cast<double>(v);
    }
    bits[i / 8] = byte;
  }
  return {fold_lanes(pos), fold_lanes(neg), negatives};
}

// residual[i] = x[i] - (x[i] < 0 ? neg : pos); residual may alias x.
inline void residual(const float* x, size_t n, float neg, float pos, float* out) {
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    out[i] = v - (v < 0.0f ? neg : pos);
  }
}

// Signum's step: where g[i] is finite, m[i] = fma(beta, m_in[i], one_minus_beta * g[i]), else
// m[i] = m_in[i] (one overflow cannot poison the momentum for good); m may be m_in (in place)
// or a separate array (Signum keeps the old momentum for Codec::discard()); bits of the new m;
// residual[i] = g[i] - (m[i] < 0 ? -1 : 1) when residual is not null (it may alias g). Returns
// whether any g[i] or new m[i] is NaN or Inf.
inline bool momentum_pack(const float* g, const float* m_in, float* m, size_t n, float beta,
                          float one_minus_beta, uint8_t* bits, float* residual) {
  bool bad = false;
  for (size_t i = 0; i < n; i += 8) {
    const size_t count = n - i < 8 ? n - i : 8;
    uint8_t byte = 0;
    for (size_t l = 0; l < count; ++l) {
      const float gv = g[i + l];
      float mv = m_in[i + l];
      if (!non_finite(gv)) mv = std::fma(beta, mv, one_minus_beta * gv);
      bad |= static_cast<int>(non_finite(gv)) | static_cast<int>(non_finite(mv));  // no branch
      m[i + l] = mv;
      const bool negative = mv < 0.0f;
      byte |= static_cast<uint8_t>(negative) << l;
      if (residual != nullptr) residual[i + l] = gv - (negative ? -1.0f : 1.0f);
    }
    bits[i / 8] = byte;
  }
  return bad;
}

// sum[i] += bit i ? neg : pos.
inline void accumulate(const uint8_t* bits, size_t n, float neg, float pos, float* sum) {
  for (size_t i = 0; i < n; ++i) sum[i] += ((bits[i / 8] >> (i % 8)) & 1) ? neg : pos;
}

}  // namespace scalar

#if defined(__AVX512F__)
namespace avx512 {

inline void store_mask(uint8_t* bits, __mmask16 mask) {
  const auto word = static_cast<uint16_t>(mask);
  std::memcpy(bits, &word, 2);
}
// The last `count` (< 16) elements: ceil(count/8) bytes.
inline void store_tail_mask(uint8_t* bits, __mmask16 mask, size_t count) {
  const auto word = static_cast<uint16_t>(mask);
  std::memcpy(bits, &word, bytes_for(count));
}
inline __mmask16 tail_mask(size_t count) { return static_cast<__mmask16>((1U << count) - 1); }
inline __mmask16 negative_mask(__mmask16 active, __m512 v) {
  return _mm512_mask_cmp_ps_mask(active, v, _mm512_setzero_ps(), _CMP_LT_OQ);
}
// Keeps the largest |bits| seen: >= kInfBits at the end means NaN or Inf was seen.
inline __m512i track_abs(__m512i largest, __m512 v) {
  return _mm512_max_epu32(largest,
                          _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(kAbsMask)));
}
inline bool saw_non_finite(__m512i largest) {
  return _mm512_reduce_max_epu32(largest) >= kInfBits;
}
inline void spill_lanes(double (&lanes)[kLanes], __m512d lo, __m512d hi) {
  double a[8], b[8];
  _mm512_storeu_pd(a, lo);
  _mm512_storeu_pd(b, hi);
  for (size_t l = 0; l < 8; ++l) {
    lanes[l] = a[l];
    lanes[l + 8] = b[l];
  }
}
inline __m512d lo_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
inline __m512d hi_pd(__m512 v) {
  return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

template <bool kResidual>
bool pack_impl(const float* x, size_t n, uint8_t* bits, float neg, float pos, float* residual) {
  const __m512 negv = _mm512_set1_ps(neg), posv = _mm512_set1_ps(pos);
  __m512i largest = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 m = negative_mask(0xffff, v);
    largest = track_abs(largest, v);
    store_mask(bits + i / 8, m);
    if constexpr (kResidual) {
      _mm512_storeu_ps(residual + i, _mm512_sub_ps(v, _mm512_mask_blend_ps(m, posv, negv)));
    }
  }
  if (i < n) {
    const __mmask16 active = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(active, x + i);
    const __mmask16 m = negative_mask(active, v);
    largest = track_abs(largest, v);
    store_tail_mask(bits + i / 8, m, n - i);
    if constexpr (kResidual) {
      _mm512_mask_storeu_ps(residual + i, active,
                            _mm512_sub_ps(v, _mm512_mask_blend_ps(m, posv, negv)));
    }
  }
  return saw_non_finite(largest);
}

inline bool pack(const float* x, size_t n, uint8_t* bits, float neg, float pos,
                 float* residual) {
  return residual != nullptr ? pack_impl<true>(x, n, bits, neg, pos, residual)
                             : pack_impl<false>(x, n, bits, neg, pos, nullptr);
}

inline double pack_abs_sum(const float* x, size_t n, uint8_t* bits) {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  size_t i = 0;
  auto step = [&](__mmask16 active) {
    const __m512 v = _mm512_maskz_loadu_ps(active, x + i);
    const __m512 a = _mm512_abs_ps(v);  // inactive lanes add +0: a lane sum stays >= +0 anyway
    lo = _mm512_add_pd(lo, lo_pd(a));
    hi = _mm512_add_pd(hi, hi_pd(a));
    return negative_mask(active, v);
  };
  for (; i + kLanes <= n; i += kLanes) store_mask(bits + i / 8, step(0xffff));
  if (i < n) store_tail_mask(bits + i / 8, step(tail_mask(n - i)), n - i);
  double lanes[kLanes];
  spill_lanes(lanes, lo, hi);
  return fold_lanes(lanes);
}

inline SplitSums pack_split_sums(const float* x, size_t n, uint8_t* bits) {
  __m512d pos_lo = _mm512_setzero_pd(), pos_hi = pos_lo, neg_lo = pos_lo, neg_hi = pos_lo;
  uint64_t negatives = 0;
  size_t i = 0;
  // Masked adds leave a lane untouched where the element belongs to the other side, exactly
  // as the scalar kernel skips it.
  auto step = [&](__mmask16 active) {
    const __m512 v = _mm512_maskz_loadu_ps(active, x + i);
    const __mmask16 m = negative_mask(active, v);
    const __mmask16 p = static_cast<__mmask16>(active & ~m);
    const __m512d vlo = lo_pd(v), vhi = hi_pd(v);
    neg_lo = _mm512_mask_add_pd(neg_lo, static_cast<__mmask8>(m), neg_lo, vlo);
    neg_hi = _mm512_mask_add_pd(neg_hi, static_cast<__mmask8>(m >> 8), neg_hi, vhi);
    pos_lo = _mm512_mask_add_pd(pos_lo, static_cast<__mmask8>(p), pos_lo, vlo);
    pos_hi = _mm512_mask_add_pd(pos_hi, static_cast<__mmask8>(p >> 8), pos_hi, vhi);
    negatives += _mm_popcnt_u32(_cvtmask16_u32(m));  // not a cast: see sparse_select.cpp
    return m;
  };
  for (; i + kLanes <= n; i += kLanes) store_mask(bits + i / 8, step(0xffff));
  if (i < n) store_tail_mask(bits + i / 8, step(tail_mask(n - i)), n - i);
  double pos[kLanes], neg[kLanes];
  spill_lanes(pos, pos_lo, pos_hi);
  spill_lanes(neg, neg_lo, neg_hi);
  return {fold_lanes(pos), fold_lanes(neg), negatives};
}

inline void residual(const float* x, size_t n, float neg, float pos, float* out) {
  const __m512 negv = _mm512_set1_ps(neg), posv = _mm512_set1_ps(pos);
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 m = negative_mask(0xffff, v);
    _mm512_storeu_ps(out + i, _mm512_sub_ps(v, _mm512_mask_blend_ps(m, posv, negv)));
  }
  if (i < n) {
    const __mmask16 active = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(active, x + i);
    const __mmask16 m = negative_mask(active, v);
    _mm512_mask_storeu_ps(out + i, active, _mm512_sub_ps(v, _mm512_mask_blend_ps(m, posv, negv)));
  }
}

template <bool kResidual>
bool momentum_impl(const float* g, const float* m_in, float* m, size_t n, float beta,
                   float one_minus_beta, uint8_t* bits, float* residual) {
  const __m512 betav = _mm512_set1_ps(beta), ombv = _mm512_set1_ps(one_minus_beta);
  const __m512 plus = _mm512_set1_ps(1.0f), minus = _mm512_set1_ps(-1.0f);
  const __m512i abs_mask = _mm512_set1_epi32(kAbsMask), inf = _mm512_set1_epi32(kInfBits);
  __m512i largest = _mm512_setzero_si512();
  size_t i = 0;
  auto step = [&](__mmask16 active) {
    const __m512 gv = _mm512_maskz_loadu_ps(active, g + i);
    __m512 mv = _mm512_maskz_loadu_ps(active, m_in + i);
    const __m512i gabs = _mm512_and_si512(_mm512_castps_si512(gv), abs_mask);
    const __mmask16 finite = _mm512_cmplt_epu32_mask(gabs, inf);
    mv = _mm512_mask_fmadd_ps(mv, finite, betav, _mm512_mul_ps(ombv, gv));
    largest = track_abs(track_abs(largest, gv), mv);
    _mm512_mask_storeu_ps(m + i, active, mv);
    const __mmask16 neg = negative_mask(active, mv);
    if constexpr (kResidual) {
      _mm512_mask_storeu_ps(residual + i, active,
                            _mm512_sub_ps(gv, _mm512_mask_blend_ps(neg, plus, minus)));
    }
    return neg;
  };
  for (; i + kLanes <= n; i += kLanes) store_mask(bits + i / 8, step(0xffff));
  if (i < n) store_tail_mask(bits + i / 8, step(tail_mask(n - i)), n - i);
  return saw_non_finite(largest);
}

inline bool momentum_pack(const float* g, const float* m_in, float* m, size_t n, float beta,
                          float one_minus_beta, uint8_t* bits, float* residual) {
  return residual != nullptr
             ? momentum_impl<true>(g, m_in, m, n, beta, one_minus_beta, bits, residual)
             : momentum_impl<false>(g, m_in, m, n, beta, one_minus_beta, bits, nullptr);
}

inline void accumulate(const uint8_t* bits, size_t n, float neg, float pos, float* sum) {
  const __m512 negv = _mm512_set1_ps(neg), posv = _mm512_set1_ps(pos);
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    uint16_t word;
    std::memcpy(&word, bits + i / 8, 2);
    const __m512 s = _mm512_loadu_ps(sum + i);
    _mm512_storeu_ps(sum + i, _mm512_add_ps(s, _mm512_mask_blend_ps(word, posv, negv)));
  }
  if (i < n) {
    uint16_t word = 0;
    std::memcpy(&word, bits + i / 8, bytes_for(n - i));  // never past the payload
    const __mmask16 active = tail_mask(n - i);
    const __m512 s = _mm512_maskz_loadu_ps(active, sum + i);
    _mm512_mask_storeu_ps(sum + i, active,
                          _mm512_add_ps(s, _mm512_mask_blend_ps(word, posv, negv)));
  }
}

}  // namespace avx512
namespace fast = avx512;
#else
namespace fast = scalar;
#endif

// The dispatching entry points the codecs call.
inline bool pack(const float* x, size_t n, uint8_t* bits, float neg, float pos,
                 float* residual) {
  return fast::pack(x, n, bits, neg, pos, residual);
}
inline double pack_abs_sum(const float* x, size_t n, uint8_t* bits) {
  return fast::pack_abs_sum(x, n, bits);
}
inline SplitSums pack_split_sums(const float* x, size_t n, uint8_t* bits) {
  return fast::pack_split_sums(x, n, bits);
}
inline void residual(const float* x, size_t n, float neg, float pos, float* out) {
  fast::residual(x, n, neg, pos, out);
}
inline bool momentum_pack(const float* g, const float* m_in, float* m, size_t n, float beta,
                          float one_minus_beta, uint8_t* bits, float* residual) {
  return fast::momentum_pack(g, m_in, m, n, beta, one_minus_beta, bits, residual);
}
inline void accumulate(const uint8_t* bits, size_t n, float neg, float pos, float* sum) {
  fast::accumulate(bits, n, neg, pos, sum);
}

// Chunked entry points (deterministic on any thread count, see parallel.h). `bits` points at
// the sign bits of element 0; a chunk's bits start at byte begin/8.

// Packs x; returns whether any element is NaN or Inf. residual may be empty or alias x.
inline bool pack_chunks(std::span<const float> x, std::byte* bits, float neg, float pos,
                        std::span<float> residual, int threads) {
  return reduce_chunks<int>(
      x.size(), threads, 0,
      [&](size_t b, size_t e) {
        return static_cast<int>(pack(x.data() + b, e - b, reinterpret_cast<uint8_t*>(bits) + b / 8,
                                     neg, pos, residual.empty() ? nullptr : residual.data() + b));
      },
      [](int a, int c) { return a | c; }) != 0;
}

// residual[i] = x[i] - (x[i] < 0 ? neg : pos); residual may alias x.
inline void residual_chunks(std::span<const float> x, float neg, float pos,
                            std::span<float> out, int threads) {
  for_chunks(x.size(), threads, [&](size_t b, size_t e, size_t) {
    residual(x.data() + b, e - b, neg, pos, out.data() + b);
  });
}

// sum[i] += bit i ? neg : pos.
inline void accumulate_chunks(const std::byte* bits, std::span<float> sum, float neg, float pos,
                              int threads) {
  for_chunks(sum.size(), threads, [&](size_t b, size_t e, size_t) {
    accumulate(reinterpret_cast<const uint8_t*>(bits) + b / 8, e - b, neg, pos, sum.data() + b);
  });
}

// Majority vote: sum[i] becomes +1, -1 or 0 (a tie); NaN stays NaN so an overflow is seen.
inline void majority_vote(std::span<float> sum) {
  for (float& s : sum) s = s > 0.0f ? 1.0f : s < 0.0f ? -1.0f : s == 0.0f ? 0.0f : s;
}

}  // namespace gradcomp::sign_bits
