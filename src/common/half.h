// IEEE binary16 and bfloat16 conversions, round to nearest even, Inf and NaN preserved.
#pragma once

#include <bit>
#include <cstdint>

namespace gradcomp {

// float32 -> bfloat16: round to nearest even; NaN stays NaN (quiet bit forced).
constexpr uint16_t float_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffU) > 0x7f800000U) return static_cast<uint16_t>((x >> 16) | 0x0040U);
  const uint32_t rounding = 0x7fffU + ((x >> 16) & 1U);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

constexpr float bf16_to_float(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

// float32 -> binary16: round to nearest even, overflow to Inf, NaN stays NaN.
constexpr uint16_t float_to_half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000U;
  const uint32_t abs = x & 0x7fffffffU;
  if (abs > 0x7f800000U) return static_cast<uint16_t>(sign | 0x7e00U | ((abs >> 13) & 0x3ffU));
  if (abs >= 0x477ff000U) return static_cast<uint16_t>(sign | 0x7c00U);  // rounds to >= 65520
  if (abs < 0x38800000U) {  // subnormal or zero in half: round abs * 2^24 to an integer
    const float scaled = std::bit_cast<float>(abs) * 0x1.0p24f;
    // Adding 2^23 to a value < 2^23 rounds it to an integer with the FPU's nearest-even.
    const float rounded = (scaled + 0x1.0p23f) - 0x1.0p23f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  const uint32_t rounding = 0xfffU + ((abs >> 13) & 1U);
  return static_cast<uint16_t>(sign | ((abs - 0x38000000U + rounding) >> 13));
}

constexpr float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000U} << 16;
  const uint32_t exp = (h >> 10) & 0x1fU;
  const uint32_t mant = h & 0x3ffU;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000U | (mant << 13));
  if (exp == 0) {
    const float value = static_cast<float>(mant) * 0x1.0p-24f;
    return sign ? -value : value;
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

}  // namespace gradcomp
