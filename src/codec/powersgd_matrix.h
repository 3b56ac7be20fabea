// Dense kernels behind the powersgd codec: the bucket of n floats viewed as a rows x cols
// row-major matrix M (zero-padded tail), and the two thin products P = M Q and Q = M^T P.
//
// Storage: the thin factors are kept column by column ("transposed"), so each of the r columns
// is contiguous: pt[k * rows + i] = P[i][k], qt[k * cols + c] = Q[c][k].
//
// Every result is a pure function of the inputs, whatever the thread count: each output
// element is computed by exactly one thread in a fixed operation order, and every
// multiply-add is an explicit std::fma, so Release (which would contract a*b+c) and Debug
// builds give the same bits.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/thread_scratch.h"

namespace gradcomp::powersgd {

struct Shape {
  size_t n = 0;     // elements
  size_t rows = 0;  // ceil(n / cols)
  size_t cols = 0;  // matrix width
  size_t rank = 0;  // min(rank parameter, rows, cols)
};

// ceil(sqrt(n)) without overflow for any 64-bit n.
inline uint64_t ceil_sqrt(uint64_t n) {
  // c * c < n, with an overflowing square counted as large enough.
  const auto below = [n](uint64_t c) {
    uint64_t square;
    return !__builtin_mul_overflow(c, c, &square) && square < n;
  };
  auto c = static_cast<uint64_t>(std::sqrt(static_cast<double>(n)));
  while (below(c)) ++c;
  while (c > 0 && !below(c - 1)) --c;
  return c;
}

// The matrix view of n elements. cols_param = 0 picks ceil(sqrt(n)), rounded up to a multiple
// of 16 once above 16 (rows then start on 64-byte boundaries for SIMD); an explicit width is
// capped at n. The rank is clamped to min(rows, cols).
inline Shape make_shape(uint64_t n, uint64_t cols_param, uint64_t rank_param) {
  Shape s;
  s.n = n;
  if (n == 0) return s;
  uint64_t cols = cols_param;
  if (cols == 0) {
    cols = ceil_sqrt(n);
    if (cols > 16) cols = (cols + 15) / 16 * 16;
  }
  s.cols = std::min<uint64_t>(cols, n);
  s.rows = (n - 1) / s.cols + 1;
  s.rank = std::min<uint64_t>({rank_param, s.rows, s.cols});
  return s;
}

// Valid elements of row i (the last row may be short; the rest of it is the zero padding).
inline size_t row_length(const Shape& s, size_t i) { return std::min(s.cols, s.n - i * s.cols); }

// Threads worth using for `work` multiply-adds; small problems stay on one thread.
inline int useful_threads(int threads, size_t work) {
  return work < (size_t{1} << 18) ? 1 : std::max(threads, 1);
}

// The dot products of one row with up to 4 columns of Q: 16 fixed lanes per column (lane j
// sums the elements whose index is j mod 16, in increasing order), folded pairwise (8, 4, 2,
// 1). The AVX-512 path and the portable path perform the same operations in the same order.
inline constexpr size_t kLanes = 16;
inline constexpr size_t kGroup = 4;  // columns of Q per pass over the row

inline float fold_lanes(float* acc) {
  for (size_t width = kLanes / 2; width >= 1; width /= 2) {
    for (size_t j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0];
}

#if defined(__AVX512F__)
// R rows against G columns at a time (constants, so the R x G accumulators stay in
// registers): each loaded piece of Q serves R rows.
template <size_t R, size_t G>
void dot_block(const float* const* row, const float* const* q, size_t len, float* out) {
  __m512 acc[R][G];
  for (size_t r = 0; r < R; ++r) {
    for (size_t k = 0; k < G; ++k) acc[r][k] = _mm512_setzero_ps();
  }
  size_t c = 0;
  for (; c + kLanes <= len; c += kLanes) {
    __m512 x[R];
    for (size_t r = 0; r < R; ++r) x[r] = _mm512_loadu_ps(row[r] + c);
    for (size_t k = 0; k < G; ++k) {
      const __m512 qk = _mm512_loadu_ps(q[k] + c);
      for (size_t r = 0; r < R; ++r) acc[r][k] = _mm512_fmadd_ps(x[r], qk, acc[r][k]);
    }
  }
  if (c < len) {  // the tail: inactive lanes keep their sums untouched
    const auto mask = static_cast<__mmask16>((1U << (len - c)) - 1);
    for (size_t k = 0; k < G; ++k) {
      const __m512 qk = _mm512_maskz_loadu_ps(mask, q[k] + c);
      for (size_t r = 0; r < R; ++r) {
        const __m512 x = _mm512_maskz_loadu_ps(mask, row[r] + c);
        acc[r][k] = _mm512_mask3_fmadd_ps(x, qk, acc[r][k], mask);
      }
    }
  }
  for (size_t r = 0; r < R; ++r) {
    for (size_t k = 0; k < G; ++k) {
      alignas(64) float lanes[kLanes];
      _mm512_store_ps(lanes, acc[r][k]);
      out[r * G + k] = fold_lanes(lanes);
    }
  }
}

// out[r * group + k] = row_r . q_k for `rows` (1 or 2) rows of length len.
inline void dot_group(const float* const* row, size_t rows, const float* const* q, size_t group,
                      size_t len, float* out) {
  if (rows == 2) {
    switch (group) {
      case 1:
        return dot_block<2, 1>(row, q, len, out);
      case 2:
        return dot_block<2, 2>(row, q, len, out);
      case 3:
        return dot_block<2, 3>(row, q, len, out);
      default:
        return dot_block<2, 4>(row, q, len, out);
    }
  }
  switch (group) {
    case 1:
      return dot_block<1, 1>(row, q, len, out);
    case 2:
      return dot_block<1, 2>(row, q, len, out);
    case 3:
      return dot_block<1, 3>(row, q, len, out);
    default:
      return dot_block<1, 4>(row, q, len, out);
  }
}
#else
inline void dot_group(const float* const* row, size_t rows, const float* const* q, size_t group,
                      size_t len, float* out) {
  for (size_t r = 0; r < rows; ++r) {
    for (size_t k = 0; k < group; ++k) {
      float lanes[kLanes] = {};
      for (size_t c = 0; c < len; ++c) {
        lanes[c % kLanes] = std::fma(row[r][c], q[k][c], lanes[c % kLanes]);
      }
      out[r * group + k] = fold_lanes(lanes);
    }
  }
}
#endif

// Rows i .. i+count-1 (1 or 2 rows of length len) against all columns of Q, four at a time.
inline void dot_rows(std::span<const float> m, const Shape& s, const float* qt, float* pt, size_t i,
                     size_t count, size_t len) {
  const float* row[2] = {m.data() + i * s.cols, m.data() + (i + count - 1) * s.cols};
  for (size_t k0 = 0; k0 < s.rank; k0 += kGroup) {
    const size_t group = std::min(kGroup, s.rank - k0);
    const float* q[kGroup];
    for (size_t k = 0; k < group; ++k) q[k] = qt + (k0 + k) * s.cols;
    float out[2 * kGroup];
    dot_group(row, count, q, group, len, out);
    for (size_t r = 0; r < count; ++r) {
      for (size_t k = 0; k < group; ++k) pt[(k0 + k) * s.rows + i + r] = out[r * group + k];
    }
  }
}

// P = M Q: pt[k * rows + i] = row_i(M) . column_k(Q). Rows go in pairs (each row read from
// memory once, each piece of Q loaded once per pair); a pair with the short last row goes
// row by row. Results do not depend on the pairing.
inline void multiply_q(std::span<const float> m, const Shape& s, const float* qt, float* pt,
                       int threads) {
  const auto pairs = static_cast<std::ptrdiff_t>((s.rows + 1) / 2);
  const int t = useful_threads(threads, s.n * s.rank);
#pragma omp parallel for schedule(static) num_threads(t) if (t > 1)
  for (std::ptrdiff_t b = 0; b < pairs; ++b) {
    const size_t i = 2 * static_cast<size_t>(b);
    if (i + 1 < s.rows && row_length(s, i + 1) == s.cols) {
      dot_rows(m, s, qt, pt, i, 2, s.cols);
    } else {
      for (size_t r = i; r < std::min(s.rows, i + 2); ++r)
        dot_rows(m, s, qt, pt, r, 1, row_length(s, r));
    }
  }
}

// q[c] += row[c] * p over [0, len): one step of a column sum.
[[gnu::noinline]] inline void axpy(const float* __restrict row, float p, float* __restrict q,
                                   size_t len) {
  for (size_t c = 0; c < len; ++c) q[c] = std::fma(row[c], p, q[c]);
}

// Four such steps, rows a, b, c, d in that order: the same sums as four axpy calls, with q
// read and written once instead of four times.
[[gnu::noinline]] inline void axpy4(const float* __restrict a, const float* __restrict b,
                                    const float* __restrict c, const float* __restrict d,
                                    const float* p, float* __restrict q, size_t len) {
  const float pa = p[0], pb = p[1], pc = p[2], pd = p[3];
  for (size_t j = 0; j < len; ++j) {
    q[j] = std::fma(d[j], pd, std::fma(c[j], pc, std::fma(b[j], pb, std::fma(a[j], pa, q[j]))));
  }
}

// Q = M^T P over the columns [c0, c1), streaming the rows in order: each Q element sums its
// column down the rows, i increasing. Whole rows go four at a time.
inline void multiply_p_slab(std::span<const float> m, const Shape& s, const float* pt, float* qt,
                            size_t c0, size_t c1) {
  for (size_t k = 0; k < s.rank; ++k) std::fill(qt + k * s.cols + c0, qt + k * s.cols + c1, 0.0f);
  const size_t full_rows = s.n / s.cols;  // rows without padding
  size_t i = 0;
  for (; i + 4 <= full_rows; i += 4) {
    const float* row = m.data() + i * s.cols + c0;
    for (size_t k = 0; k < s.rank; ++k) {
      const float* pk = pt + k * s.rows + i;
      axpy4(row, row + s.cols, row + 2 * s.cols, row + 3 * s.cols, pk, qt + k * s.cols + c0,
            c1 - c0);
    }
  }
  for (; i < s.rows; ++i) {
    const size_t end = std::min(c1, row_length(s, i));
    if (end <= c0) continue;
    const float* row = m.data() + i * s.cols + c0;
    for (size_t k = 0; k < s.rank; ++k)
      axpy(row, pt[k * s.rows + i], qt + k * s.cols + c0, end - c0);
  }
}

// Q = M^T P: qt[k * cols + c] = sum_i M[i][c] * P[i][k], summed over i in increasing order.
// Each thread owns one slab of columns, so the order per element never changes and the
// slabs may follow the thread count; one thread streams M row after row.
inline void multiply_p(std::span<const float> m, const Shape& s, const float* pt, float* qt,
                       int threads) {
  if (s.n == 0) return;
  const int t =
      static_cast<int>(std::min<size_t>(useful_threads(threads, s.n * s.rank), (s.cols + 15) / 16));
  const size_t slab = (s.cols + t - 1) / t;
  const size_t width = (slab + 15) / 16 * 16;  // slab starts stay 64-byte apart
#pragma omp parallel for schedule(static) num_threads(t) if (t > 1)
  for (int b = 0; b < t; ++b) {
    const size_t c0 = std::min(s.cols, static_cast<size_t>(b) * width);
    multiply_p_slab(m, s, pt, qt, c0, std::min(s.cols, c0 + width));
  }
}

// out[c] = chain of fma over the G columns k0 .. k0+G-1 of Q, starting from out[c] (or from
// +0 when kFirst): one pass over the row buffer per four columns of Q.
template <size_t G, bool kFirst>
[[gnu::noinline]] void reconstruct_group(const float* p, const float* const* q, size_t len,
                                         float* __restrict out) {
  float pk[G];
  const float* __restrict qk[G];
  for (size_t k = 0; k < G; ++k) pk[k] = p[k], qk[k] = q[k];
  for (size_t c = 0; c < len; ++c) {
    float v = kFirst ? 0.0f : out[c];
    for (size_t k = 0; k < G; ++k) v = std::fma(pk[k], qk[k][c], v);
    out[c] = v;
  }
}

template <bool kFirst>
void reconstruct_group(const float* p, const float* const* q, size_t group, size_t len,
                       float* out) {
  switch (group) {
    case 1:
      return reconstruct_group<1, kFirst>(p, q, len, out);
    case 2:
      return reconstruct_group<2, kFirst>(p, q, len, out);
    case 3:
      return reconstruct_group<3, kFirst>(p, q, len, out);
    default:
      return reconstruct_group<4, kFirst>(p, q, len, out);
  }
}

// Row i of P Q^T into out[0, len): sum_k P[i][k] * Q[c][k] as fma(P[i][k], Q[c][k], .)
// from +0, k in increasing order.
inline void reconstruct_row(const Shape& s, const float* pt, const float* qt, size_t i, size_t len,
                            float* out) {
  for (size_t k0 = 0; k0 < s.rank; k0 += kGroup) {
    const size_t group = std::min(kGroup, s.rank - k0);
    float p[kGroup];
    const float* q[kGroup];
    for (size_t k = 0; k < group; ++k)
      p[k] = pt[(k0 + k) * s.rows + i], q[k] = qt + (k0 + k) * s.cols;
    if (k0 == 0) {
      reconstruct_group<true>(p, q, group, len, out);
    } else {
      reconstruct_group<false>(p, q, group, len, out);
    }
  }
}

// sum[c] += row[c].
[[gnu::noinline]] inline void add_row(const float* __restrict row, float* __restrict sum,
                                      size_t len) {
  for (size_t c = 0; c < len; ++c) sum[c] += row[c];
}

// out[c] = 0 + row[c]: add_row into zeros (a -0 becomes +0) without reading `out`.
[[gnu::noinline]] inline void store_row(const float* __restrict row, float* __restrict out,
                                        size_t len) {
  for (size_t c = 0; c < len; ++c) out[c] = 0.0f + row[c];
}

// res[c] = x[c] - row[c], into a separate array or over x itself (the error feedback's usual
// call); two kernels so that neither needs a runtime alias check to vectorize.
[[gnu::noinline]] inline void subtract_row(const float* __restrict x, const float* __restrict row,
                                           float* __restrict res, size_t len) {
  for (size_t c = 0; c < len; ++c) res[c] = x[c] - row[c];
}
[[gnu::noinline]] inline void subtract_row_in_place(float* __restrict x,
                                                    const float* __restrict row, size_t len) {
  for (size_t c = 0; c < len; ++c) x[c] -= row[c];
}

// Calls fn(row_begin_element, reconstructed_row, len) for every row of P Q^T, rows in parallel,
// with a per-thread row buffer of cols floats (never a scratch copy of n).
template <typename Fn>
void for_each_reconstructed_row(const Shape& s, const float* pt, const float* qt, int threads,
                                Fn&& fn) {
  if (s.n == 0) return;
  const int t = useful_threads(threads, s.n * s.rank);
#pragma omp parallel num_threads(t) if (t > 1)
  {
    const std::span<float> row = thread_scratch<float, struct ReconstructedRow>(s.cols);
#pragma omp for schedule(static)
    for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(s.rows); ++i) {
      const size_t len = row_length(s, static_cast<size_t>(i));
      reconstruct_row(s, pt, qt, static_cast<size_t>(i), len, row.data());
      fn(static_cast<size_t>(i) * s.cols, row.data(), len);
    }
  }
}

// Gram-Schmidt on the r columns of P (each `len` long, column-major), in double precision so
// that tiny gradients neither underflow nor lose accuracy. A column left (numerically) in the
// span of the previous ones becomes zero: it carries no new direction, and the error feedback
// keeps what it would have sent. Non-finite columns stay non-finite (NaN/Inf must propagate).
inline void orthonormalize(float* columns, size_t len, size_t r) {
  constexpr double kDependent = 1e-6;  // relative norm left after projection: dependent column
  const std::span<double> basis = thread_scratch<double, struct OrthonormalBasis>(len * r);
  for (size_t k = 0; k < r; ++k) {
    double* v = basis.data() + k * len;
    for (size_t i = 0; i < len; ++i) v[i] = columns[k * len + i];
    double before = 0;
    for (size_t i = 0; i < len; ++i) before += v[i] * v[i];
    for (size_t j = 0; j < k; ++j) {  // modified Gram-Schmidt: project out one at a time
      const double* u = basis.data() + j * len;
      double proj = 0;
      for (size_t i = 0; i < len; ++i) proj += u[i] * v[i];
      for (size_t i = 0; i < len; ++i) v[i] -= proj * u[i];
    }
    double after = 0;
    for (size_t i = 0; i < len; ++i) after += v[i] * v[i];
    const bool dependent = std::isfinite(after) && after <= kDependent * kDependent * before;
    const double inv = dependent ? 0.0 : 1.0 / std::sqrt(after);
    for (size_t i = 0; i < len; ++i) v[i] = dependent ? 0.0 : v[i] * inv;
    for (size_t i = 0; i < len; ++i) columns[k * len + i] = static_cast<float>(v[i]);
  }
}

}  // namespace gradcomp::powersgd
