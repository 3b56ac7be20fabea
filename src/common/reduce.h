// The element-wise reduction every transport backend applies, so that an allreduce gives the
// same bits on every backend and on every rank (transport.h states the contract):
//  - f16 / bf16 sums: each addition in float32, rounded to nearest even (common/half.h);
//  - i8 / u8 / i32 sums wrap around (two's complement), computed unsigned so overflow is
//    defined behaviour;
//  - max of floats: +0 beats -0, and any NaN wins; every NaN result (sum or max) is the
//    canonical quiet NaN. This makes every kernel exactly commutative, bit for bit, so it
//    does not matter which operand a backend's algorithm passes first: all ranks end with the
//    same bytes even when they combine partial results in different orders of operands.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/half.h"
#include "common/reduce_simd.h"
#include "gradcomp/dtype.h"

namespace gradcomp::reduce {

inline constexpr uint32_t kCanonicalNanF32 = 0x7fc00000U;
inline constexpr uint16_t kCanonicalNanF16 = 0x7e00U;
inline constexpr uint16_t kCanonicalNanBF16 = 0x7fc0U;

inline float canonical(float x) {
  return std::isnan(x) ? std::bit_cast<float>(kCanonicalNanF32) : x;
}

inline float sum_f32(float a, float b) { return canonical(a + b); }

// Commutative max: for equal values (including +0 / -0) the AND of the bit patterns gives the
// same value, and +0 for a signed-zero pair.
inline float max_f32(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::bit_cast<float>(kCanonicalNanF32);
  if (a == b) return std::bit_cast<float>(std::bit_cast<uint32_t>(a) & std::bit_cast<uint32_t>(b));
  return a > b ? a : b;
}

inline uint16_t sum_f16(uint16_t a, uint16_t b) {
  const float r = half_to_float(a) + half_to_float(b);
  return std::isnan(r) ? kCanonicalNanF16 : float_to_half(r);
}
inline uint16_t max_f16(uint16_t a, uint16_t b) {
  const float r = max_f32(half_to_float(a), half_to_float(b));
  return std::isnan(r) ? kCanonicalNanF16 : float_to_half(r);  // exact: r is a or b
}
inline uint16_t sum_bf16(uint16_t a, uint16_t b) {
  const float r = bf16_to_float(a) + bf16_to_float(b);
  return std::isnan(r) ? kCanonicalNanBF16 : float_to_bf16(r);
}
inline uint16_t max_bf16(uint16_t a, uint16_t b) {
  const float r = max_f32(bf16_to_float(a), bf16_to_float(b));
  return std::isnan(r) ? kCanonicalNanBF16 : float_to_bf16(r);
}

template <typename T>
T sum_int(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}

// dst[i] = f(dst[i], src[i]) for `count` elements of T; memcpy because the buffers are bytes
// with no alignment promise (the compiler turns it into plain, vectorised loads).
template <typename T, typename F>
void apply(void* dst, const void* src, size_t count, F f) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  for (size_t i = 0; i < count; ++i) {
    T a, b;
    std::memcpy(&a, d + i * sizeof(T), sizeof(T));
    std::memcpy(&b, s + i * sizeof(T), sizeof(T));
    const T r = f(a, b);
    std::memcpy(d + i * sizeof(T), &r, sizeof(T));
  }
}

// The scalar kernel over elements [done, count): the tail a vector kernel left.
template <typename T, typename F>
void apply_tail(void* dst, const void* src, size_t done, size_t count, F f) {
  apply<T>(static_cast<std::byte*>(dst) + done * sizeof(T),
           static_cast<const std::byte*>(src) + done * sizeof(T), count - done, f);
}

template <typename T>
void apply_int(void* dst, const void* src, size_t count, ReduceOp op) {
  if (op == ReduceOp::kSum) {
    apply<T>(dst, src, count, [](T a, T b) { return sum_int<T>(a, b); });
  } else {
    apply<T>(dst, src, count, [](T a, T b) { return std::max(a, b); });
  }
}

}  // namespace gradcomp::reduce

namespace gradcomp {

// dst[i] = dst[i] (op) src[i] for `count` elements of `type`. Returns false (and leaves dst
// alone) for a type it does not know (DType::kNone); callers check types before reducing.
// The float kernels run a vector body (common/reduce_simd.h) that gives the scalar kernels' bits
// and leave the scalar kernels the tail; the integer kernels are plain loops that vectorise.
inline bool reduce_into(void* dst, const void* src, size_t count, DType type, ReduceOp op) {
  using namespace reduce;
  const bool sum = op == ReduceOp::kSum;
  switch (type) {
    case DType::kF32:
      if (sum)
        apply_tail<float>(dst, src, simd::sum_f32(dst, src, count), count,
                             [](float a, float b) { return sum_f32(a, b); });
      else
        apply_tail<float>(dst, src, simd::max_f32(dst, src, count), count,
                             [](float a, float b) { return max_f32(a, b); });
      return true;
    case DType::kF16:
      if (sum)
        apply_tail<uint16_t>(dst, src, simd::sum_f16(dst, src, count), count,
                             [](uint16_t a, uint16_t b) { return sum_f16(a, b); });
      else
        apply_tail<uint16_t>(dst, src, simd::max_f16(dst, src, count), count,
                             [](uint16_t a, uint16_t b) { return max_f16(a, b); });
      return true;
    case DType::kBF16:
      if (sum)
        apply_tail<uint16_t>(dst, src, simd::sum_bf16(dst, src, count), count,
                             [](uint16_t a, uint16_t b) { return sum_bf16(a, b); });
      else
        apply_tail<uint16_t>(dst, src, simd::max_bf16(dst, src, count), count,
                             [](uint16_t a, uint16_t b) { return max_bf16(a, b); });
      return true;
    case DType::kI8:
      apply_int<int8_t>(dst, src, count, op);
      return true;
    case DType::kU8:
      apply_int<uint8_t>(dst, src, count, op);
      return true;
    case DType::kI32:
      apply_int<int32_t>(dst, src, count, op);
      return true;
    case DType::kNone:
      break;
  }
  return false;
}

}  // namespace gradcomp
