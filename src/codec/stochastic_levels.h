// Shared machinery of the stochastic quantizers (qsgd, terngrad, natural, dither): the scale
// (max |x| or an L2 norm, computed deterministically), unbiased stochastic rounding driven by
// the counter RNG, and fast fixed-width bit packing.
//
// Packing keeps bitpack.h's LSB-first layout (element i's b-bit code occupies bits
// [i*b, (i+1)*b) of the little-endian bit stream) but works on groups of 64 codes: 64 codes of
// b bits fill exactly b 64-bit words, so with b a compile-time constant every shift is a
// constant and a group packs or unpacks with no bit-at-a-time loop. With AVX-512 VBMI, 16 codes
// at a time move with byte permutes instead (same bytes). A chunk of kChunk elements is a whole
// number of groups, so chunks pack in parallel.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include <fmt/format.h>

#include "common/bitpack.h"
#include "common/parallel.h"
#include "common/square_sums.h"
#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/frame.h"
#include "gradcomp/random.h"

namespace gradcomp::levels {

static_assert(std::endian::native == std::endian::little,
              "packed words are stored with memcpy; the wire is little-endian");

inline constexpr size_t kGroup = 64;       // codes per packed group
inline constexpr unsigned kMaxWidth = 17;  // sign + 16-bit level (levels up to 2^15)
static_assert(kChunk % kGroup == 0);

// Bits of a level in 0..levels: ceil(log2(levels + 1)).
constexpr unsigned level_bits(uint32_t levels) { return std::bit_width(levels); }

// ---------------------------------------------------------------------------------------------
// Packing

// Packs 64 codes of B bits (each < 2^B) into 8*B bytes, LSB-first (portable version).
template <unsigned B>
inline void pack_group_scalar(const uint32_t* codes, std::byte* out) {
  static_assert(B >= 1 && B <= 32);
  uint64_t words[B] = {};
#pragma GCC unroll 64
  for (unsigned j = 0; j < kGroup; ++j) {
    const unsigned bit = j * B, w = bit / 64, shift = bit % 64;
    words[w] |= uint64_t{codes[j]} << shift;
    if (shift + B > 64) words[w + 1] |= uint64_t{codes[j]} >> (64 - shift);
  }
  std::memcpy(out, words, sizeof(words));
}

// The inverse of pack_group_scalar: reads 8*B bytes.
template <unsigned B>
inline void unpack_group_scalar(const std::byte* in, uint32_t* codes) {
  constexpr uint64_t mask = (uint64_t{1} << B) - 1;
  uint64_t words[B];
  std::memcpy(words, in, sizeof(words));
#pragma GCC unroll 64
  for (unsigned j = 0; j < kGroup; ++j) {
    const unsigned bit = j * B, w = bit / 64, shift = bit % 64;
    uint64_t v = words[w] >> shift;
    if (shift + B > 64) v |= words[w + 1] << (64 - shift);
    codes[j] = static_cast<uint32_t>(v & mask);
  }
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define GRADCOMP_LEVELS_VBMI 1
// AVX-512 VBMI packing, 16 codes (2*B bytes) per step with byte permutes: the same bytes as the
// scalar version, several times faster. Code j of a 16-code step starts at bit j*B: in byte
// j*B/8 at shift j*B%8, and (shifted) spans at most 3 bytes for B <= 17.
namespace vbmi {

struct Tables {
  uint8_t gather[64];      // unpack: byte k of lane j <- input byte j*B/8 + k
  uint32_t shift[16];      // j*B % 8
  int rounds;              // pack: most codes touching one output byte
  uint8_t scatter[8][64];  // pack round r: output byte t <- byte of the r-th code touching t
  uint64_t scatter_mask[8];
};

template <unsigned B>
constexpr Tables make_tables() {
  Tables t{};
  for (unsigned j = 0; j < 16; ++j) {
    for (unsigned k = 0; k < 4; ++k) t.gather[4 * j + k] = static_cast<uint8_t>(j * B / 8 + k);
    t.shift[j] = j * B % 8;
  }
  for (unsigned byte = 0; byte < 2 * B; ++byte) {
    const unsigned first = 8 * byte / B, last = std::min(15U, (8 * byte + 7) / B);
    for (unsigned j = first; j <= last; ++j) {
      const unsigned r = j - first;
      t.scatter[r][byte] = static_cast<uint8_t>(4 * j + (byte - j * B / 8));
      t.scatter_mask[r] |= uint64_t{1} << byte;
      t.rounds = std::max(t.rounds, static_cast<int>(r + 1));
    }
  }
  return t;
}

template <unsigned B>
inline constexpr Tables kTables = make_tables<B>();

// 16 codes from the 2*B bytes at `in` (reads nothing beyond them).
template <unsigned B>
inline __m512i unpack16(const std::byte* in) {
  const Tables& t = kTables<B>;
  const __m512i data = _mm512_maskz_loadu_epi8((uint64_t{1} << (2 * B)) - 1, in);
  // (The all-ones maskz forms sidestep a GCC 12 -Wmaybe-uninitialized false positive.)
  const __m512i lanes =
      _mm512_maskz_permutexvar_epi8(~uint64_t{0}, _mm512_loadu_si512(t.gather), data);
  const __m512i shifted = _mm512_maskz_srlv_epi32(0xffff, lanes, _mm512_loadu_si512(t.shift));
  return _mm512_and_si512(shifted, _mm512_set1_epi32(static_cast<int>((1U << B) - 1)));
}

// 16 codes packed into the low 2*B bytes of the result (the rest is zero).
template <unsigned B>
inline __m512i pack16(__m512i codes) {
  const Tables& t = kTables<B>;
  const __m512i shifted = _mm512_maskz_sllv_epi32(0xffff, codes, _mm512_loadu_si512(t.shift));
  __m512i out = _mm512_setzero_si512();
  for (int r = 0; r < t.rounds; ++r) {
    out = _mm512_or_si512(out, _mm512_maskz_permutexvar_epi8(
                                   t.scatter_mask[r], _mm512_loadu_si512(t.scatter[r]), shifted));
  }
  return out;
}

}  // namespace vbmi
#endif

// Packs 64 codes of B bits into out[0, 8*B); `out` must have 64 bytes of slack after that.
template <unsigned B>
inline void pack_group(const uint32_t* codes, std::byte* out) {
#ifdef GRADCOMP_LEVELS_VBMI
  if constexpr (B <= 17) {
    for (unsigned k = 0; k < 4; ++k) {  // each step overwrites the previous one's zero tail
      const __m512i packed = vbmi::pack16<B>(_mm512_loadu_si512(codes + 16 * k));
      _mm512_storeu_si512(out + 2 * B * k, packed);
    }
    return;
  }
#endif
  pack_group_scalar<B>(codes, out);
}

// Unpacks 64 codes of B bits from in[0, 8*B).
template <unsigned B>
inline void unpack_group(const std::byte* in, uint32_t* codes) {
#ifdef GRADCOMP_LEVELS_VBMI
  if constexpr (B <= 17) {
    for (unsigned k = 0; k < 4; ++k) {
      _mm512_storeu_si512(codes + 16 * k, vbmi::unpack16<B>(in + 2 * B * k));
    }
    return;
  }
#endif
  unpack_group_scalar<B>(in, codes);
}

// Calls fn(std::integral_constant<unsigned, B>{}) for B == bits (1 <= bits <= kMaxWidth), so
// the packing loops are compiled once per width.
template <typename Fn, unsigned... Bs>
void dispatch_width(unsigned bits, Fn&& fn, std::integer_sequence<unsigned, Bs...>) {
  (void)((bits == Bs + 1 ? (fn(std::integral_constant<unsigned, Bs + 1>{}), true) : false) || ...);
}
template <typename Fn>
void with_width(unsigned bits, Fn&& fn) {
  dispatch_width(bits, fn, std::make_integer_sequence<unsigned, kMaxWidth>{});
}

// For each group of up to 64 elements of [0, n): make(first, count, codes) fills
// codes[0, count) with B-bit codes, which are packed into out[0, packed_bytes(n, B)).
// Chunks run on up to `threads` threads; the bytes do not depend on the thread count.
template <unsigned B, typename Make>
void pack_codes(size_t n, int threads, std::byte* out, Make&& make) {
  for_chunks(n, threads, [&](size_t begin, size_t end, size_t) {
    alignas(64) uint32_t codes[kGroup];
    alignas(64) std::byte packed[8 * B + 64];
    for (size_t g = begin; g < end; g += kGroup) {
      const size_t count = std::min(kGroup, end - g);
      make(g, count, codes);
      if (count < kGroup) std::fill(codes + count, codes + kGroup, 0U);  // zero padding bits
      pack_group<B>(codes, packed);
      std::memcpy(out + g / 8 * B, packed, packed_bytes(count, B));
    }
  });
}

// For each group of up to 64 elements of [0, n): unpacks its B-bit codes from `in` (which
// holds packed_bytes(n, B) bytes) and calls use(first, count, codes).
template <unsigned B, typename Use>
void unpack_codes(const std::byte* in, size_t n, int threads, Use&& use) {
  for_chunks(n, threads, [&](size_t begin, size_t end, size_t) {
    alignas(64) uint32_t codes[kGroup];
    for (size_t g = begin; g < end; g += kGroup) {
      const size_t count = std::min(kGroup, end - g);
      if (count == kGroup) {
        unpack_group<B>(in + g / 8 * B, codes);
      } else {  // the last group: copy it out so nothing past the payload is read
        std::byte last[8 * B] = {};
        std::memcpy(last, in + g / 8 * B, packed_bytes(count, B));
        unpack_group<B>(last, codes);
      }
      use(g, count, codes);
    }
  });
}

// The largest of the n B-bit codes in `in`; decoders check it before adding anything, so a
// corrupt frame leaves the sum untouched.
template <unsigned B>
uint32_t max_code(const std::byte* in, size_t n, int threads) {
  std::vector<uint32_t> chunk_max(chunk_count(n), 0);
  unpack_codes<B>(in, n, threads, [&](size_t first, size_t count, const uint32_t* codes) {
    uint32_t m = 0;
    for (size_t j = 0; j < count; ++j) m = std::max(m, codes[j]);
    uint32_t& slot = chunk_max[first / kChunk];
    slot = std::max(slot, m);
  });
  uint32_t m = 0;
  for (uint32_t c : chunk_max) m = std::max(m, c);
  return m;
}

// ---------------------------------------------------------------------------------------------
// Scales

// The largest |x| as its float bit pattern. Comparing the patterns as integers orders finite
// magnitudes, and Inf (0x7f800000) or any NaN (above it) wins, so the result is non-finite
// exactly when some element is.
inline uint32_t max_abs_bits(const float* x, size_t len) {
  uint32_t m = 0;
#pragma omp simd reduction(max : m)
  for (size_t i = 0; i < len; ++i) m = std::max(m, std::bit_cast<uint32_t>(x[i]) & 0x7fffffffU);
  return m;
}

inline float max_abs(std::span<const float> x, int threads) {
  const uint32_t bits = reduce_chunks<uint32_t>(
      x.size(), threads, 0, [&](size_t b, size_t e) { return max_abs_bits(x.data() + b, e - b); },
      [](uint32_t a, uint32_t c) { return std::max(a, c); });
  return std::bit_cast<float>(bits);
}

// ||x[begin, end)||_2 rounded to float; the partial sums of kChunk-aligned pieces are folded
// in order, so a long range is summed in parallel with a thread-independent result. Inf or NaN
// when an element is (squares of floats cannot overflow a double).
inline float l2_norm(const float* x, size_t begin, size_t end, int threads) {
  const double total = reduce_chunks<double>(
      end - begin, threads, 0.0,
      [&](size_t b, size_t e) { return sum_squares(x + begin + b, e - b); },
      [](double a, double c) { return a + c; });
  return static_cast<float>(std::sqrt(total));
}

// Maps a magnitude to grid units: v = |x| / scale * units, computed as (|x| * pre) * inv.
// A tiny scale (< 2^-100, e.g. an all-subnormal tensor) would overflow units / scale, so both
// are first multiplied by 2^100, which is exact. scale == 0 (all-zero input) gives v = 0.
struct Grid {
  float pre = 1.0f;
  float inv = 0.0f;

  static Grid make(float scale, float units) {
    Grid g;
    if (!(scale > 0.0f) || !std::isfinite(scale)) return g;
    if (scale < 0x1.0p-100f) g.pre = 0x1.0p100f;
    g.inv = units / (scale * g.pre);
    return g;
  }
  float units(float magnitude) const { return (magnitude * pre) * inv; }
};

// ---------------------------------------------------------------------------------------------
// Rounding and randomness

// floor(v) + Bernoulli(v - floor(v)), never above `top`: unbiased stochastic rounding of
// 0 <= v < 2^31 with the top 24 bits of `random`. Comparing against the exact fraction (rather
// than flooring v + u, which rounds) keeps the bias below 2^-24 of a step. The floor is a
// truncating conversion (equal for v >= 0), which vectorises where std::floor does not.
inline uint32_t stochastic_round(float v, uint32_t random, uint32_t top) {
  const auto whole = static_cast<int32_t>(v);
  const float frac = v - static_cast<float>(whole);
  const float u = static_cast<float>(random >> 8) * 0x1.0p-24f;
  const auto level = static_cast<uint32_t>(whole) + (u < frac ? 1U : 0U);
  return std::min(level, top);
}

// Rounds a magnitude stochastically to one of the two powers of two around it:
// with m its 23-bit mantissa field, up with probability m / 2^23 = (|x| - 2^e) / 2^e.
// Returns the biased exponent of the result (0 means zero; subnormals round between 0 and
// 2^-126 with the same formula). Exponents never exceed `top_exponent`.
inline uint32_t round_to_power_of_two(uint32_t abs_bits, uint32_t random, uint32_t top_exponent) {
  const uint32_t exponent = abs_bits >> 23;
  const uint32_t mantissa = abs_bits & 0x7fffffU;
  const uint32_t up = (random >> 9) < mantissa ? 1U : 0U;
  return std::min(exponent + up, top_exponent);
}

// Applies sign bit `sign` (0 or 1) to a non-negative float by flipping its sign bit.
inline float with_sign(float magnitude, uint32_t sign) {
  return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) ^ (sign << 31));
}

inline uint32_t sign_bit(float x) { return std::bit_cast<uint32_t>(x) >> 31; }

// The value of level `level` on a linear grid of spacing `step`, with sign bit `sign`. Encoders
// (for the residual) and decoders compute it with exactly these operations, so
// residual + decoded == input. With a non-finite step even level 0 decodes to NaN: that is how
// an input holding Inf or NaN reaches the output of the scale-based codecs.
inline float linear_value(uint32_t level, uint32_t sign, float step) {
  return with_sign(static_cast<float>(level) * step, sign);
}

// The counter RNG of one codec call, indexed by element. CounterRng counts in 32 bits, so each
// 2^32 elements get their own stream (a chunk never straddles two).
class ElementRng {
 public:
  ElementRng(const Context& ctx, size_t n) : first_(ctx.seed, ctx.bucket, ctx.step, ctx.rank, 0) {
    const size_t count = n == 0 ? 1 : ((n - 1) >> 32) + 1;
    for (size_t s = 1; s < count; ++s) {
      more_.emplace_back(ctx.seed, ctx.bucket, ctx.step, ctx.rank, static_cast<uint32_t>(s));
    }
  }
  // The stream holding element `first`; index it with static_cast<uint32_t>(i).
  const CounterRng& at(size_t first) const {
    return first >> 32 == 0 ? first_ : more_[(first >> 32) - 1];
  }

 private:
  CounterRng first_;              // elements [0, 2^32): every tensor but the largest
  std::vector<CounterRng> more_;  // the next 2^32 each (no allocation below them)
};

// ---------------------------------------------------------------------------------------------
// The linear grid {0, 1, ..., levels} * scale / levels (qsgd, dither with partition=linear)

// What quantizing on the linear grid of one scale needs, computed once per scale (the
// divisions would otherwise cost as much as a group's arithmetic).
struct LinearScale {
  uint32_t levels = 1;
  bool finite = true;
  float step = 0.0f;  // scale / levels: the decoded value of level 1
  Grid grid;          // |x| -> |x| / scale * levels

  static LinearScale make(float scale, uint32_t levels) {
    const auto s = static_cast<float>(levels);
    return {levels, std::isfinite(scale) != 0, scale / s, Grid::make(scale, s)};
  }
};

// Quantizes x[0, count) (elements first_index...) on the linear grid of `scale` to codes
// level << 1 | sign, and writes the residual x - decoded if kResidual (it may alias x).
// A non-finite scale (the input held Inf or NaN) sends level 0, which decodes to NaN.
template <bool kResidual>
void quantize_linear(const float* x, size_t count, uint32_t first_index, const CounterRng& rng,
                     const LinearScale& scale, uint32_t* codes, float* residual) {
  const float step = scale.step;
  if (!scale.finite) {
    for (size_t j = 0; j < count; ++j) {
      codes[j] = 0;
      if constexpr (kResidual) residual[j] = x[j] - linear_value(0, 0, step);
    }
    return;
  }
  const Grid grid = scale.grid;
  const uint32_t levels = scale.levels;
#pragma omp simd
  for (size_t j = 0; j < count; ++j) {
    const float xj = x[j];  // read before the residual (which may alias x) is written
    const uint32_t sign = sign_bit(xj);
    const uint32_t random = rng.bits(first_index + static_cast<uint32_t>(j));
    const uint32_t level = stochastic_round(grid.units(std::fabs(xj)), random, levels);
    codes[j] = level << 1 | sign;
    if constexpr (kResidual) residual[j] = xj - linear_value(level, sign, step);
  }
}

// Adds the decoded codes (level << 1 | sign) of a linear grid with spacing `step` into sum.
inline void add_linear(const uint32_t* codes, size_t count, float step, float* sum) {
#pragma omp simd
  for (size_t j = 0; j < count; ++j) sum[j] += linear_value(codes[j] >> 1, codes[j] & 1, step);
}

// ---------------------------------------------------------------------------------------------
// Decoder checks beyond check_frame and check_plain_header

// The bits after the last of n `bits`-bit codes must be zero, as the encoder writes them, so
// every frame has a single byte form.
inline void check_padding(const std::byte* codes, size_t n, unsigned bits, const char* codec) {
  const unsigned used = static_cast<unsigned>((n * bits) % 8);
  if (used == 0) return;
  const auto last = std::to_integer<uint8_t>(codes[packed_bytes(n, bits) - 1]);
  if ((last >> used) != 0) {
    throw FrameError(fmt::format("{}: the padding bits after the last code are not zero", codec));
  }
}

// Codes level << 1 | sign must hold levels <= `levels`; with B bits some codes may exceed that
// (levels = 16 in 6 bits allows 0..16 of 0..31). Checked before anything is added to the sum.
template <unsigned B>
void check_levels(const std::byte* codes, size_t n, int threads, uint32_t levels,
                  const char* codec) {
  const uint32_t top_code = levels << 1 | 1;
  if (top_code >= (1U << B) - 1) return;  // every code is valid
  const uint32_t top = max_code<B>(codes, n, threads);
  if (top > top_code) {
    throw FrameError(fmt::format("{}: a code holds level {}; allowed: 0..{} (levels={})", codec,
                                 top >> 1, levels, levels));
  }
}

// ---------------------------------------------------------------------------------------------
// Little-endian float32 fields

inline void store_f32(std::byte* p, float v) { std::memcpy(p, &v, 4); }
inline float load_f32(const std::byte* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// The payload of a single-scale frame (terngrad, dither): a float32 scale, then n `bits`-bit
// codes. Checks its length, a non-negative scale and zero padding; returns the scale.
inline float read_scale_and_codes(const char* codec, std::span<const std::byte> payload, size_t n,
                                  unsigned bits) {
  const size_t expected = 4 + packed_bytes(n, bits);
  if (payload.size() != expected) {
    throw FrameError(fmt::format("{}: payload is {} bytes; expected {} for {} elements (float32 "
                                 "scale, then {}-bit codes)",
                                 codec, payload.size(), expected, n, bits));
  }
  const float scale = load_f32(payload.data());
  if (scale < 0.0f) throw FrameError(fmt::format("{}: scale is {}; allowed: >= 0", codec, scale));
  check_padding(payload.data() + 4, n, bits, codec);
  return scale;
}

}  // namespace gradcomp::levels
