#include "common/half.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace gradcomp {
namespace {

// Reference: the nearest representable value by exhaustive search over all 2^16 halves (ties to
// even mantissa), compared with float_to_half on many floats.
TEST(Half, MatchesExhaustiveNearestEven) {
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
    const float f = half_to_float(static_cast<uint16_t>(bits));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f))));
      continue;
    }
    ASSERT_EQ(float_to_half(f), bits) << "exact value " << f;
  }
  // Halfway points between adjacent positive halves round to the even one.
  for (uint16_t h = 0; h < 0x7bff; ++h) {
    const double lo = half_to_float(h), hi = half_to_float(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    if (static_cast<double>(mid) != (lo + hi) / 2) continue;  // not exactly representable
    ASSERT_EQ(float_to_half(mid), (h & 1) ? h + 1 : h) << "tie at " << mid;
  }
}

TEST(Half, OverflowInfinityAndNan) {
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_half(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(float_to_half(1e-9f), 0);  // below half the smallest subnormal
}

TEST(Bf16, RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808000U)), 0x3f80);  // tie -> even
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f818000U)), 0x3f82);  // tie -> even
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808001U)), 0x3f81);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflow -> Inf
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits in the low bits must not round into Inf.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0x7f800001U)))));
}

}  // namespace
}  // namespace gradcomp
