// The sign-bit kernels shared by signsgd, efsignsgd, signum and onebit: the vector kernels give
// exactly the bytes and sums of the portable ones, on every length and on special values.
#include "codec/sign_bits.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "support/codec_testing.h"

namespace gradcomp {
namespace {

namespace sb = sign_bits;

// Gradient values sprinkled with zeros, -0, subnormals and (when asked) NaN and Inf.
std::vector<float> awkward(size_t n, bool non_finite) {
  auto x = testing::gradient(n, n + 3);
  const float specials[] = {0.0f, -0.0f, 1e-40f, -1e-40f, 1.0f, -1.0f,
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  const size_t kinds = non_finite ? 9 : 6;
  for (size_t i = 0; i < n; i += 5) x[i] = specials[(i / 5) % kinds];
  return x;
}

std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = std::bit_cast<uint32_t>(v[i]);
  return out;
}

TEST(SignBits, PackSetsBitForNegativesOnlyLsbFirst) {
  const std::vector<float> x = {-1.0f, 0.0f, -0.0f, 2.0f, std::numeric_limits<float>::quiet_NaN(),
                                -3.0f, -1e-40f, 5.0f, -7.0f};
  std::vector<uint8_t> bits(2, 0xff);
  EXPECT_TRUE(sb::pack(x.data(), x.size(), bits.data(), -1, 1, nullptr));  // the NaN
  // Elements 0, 5, 6 in byte 0 (bits 0, 5, 6 = 0x61); element 8 is bit 0 of byte 1, and the
  // padding bits of byte 1 are zero.
  EXPECT_EQ(bits[0], 0x61);
  EXPECT_EQ(bits[1], 0x01);
}

#if defined(__AVX512F__)
class SignBitsSimd : public ::testing::TestWithParam<size_t> {};

TEST_P(SignBitsSimd, PackAndResidualMatchScalar) {
  const size_t n = GetParam();
  for (bool non_finite : {false, true}) {
    const auto x = awkward(n, non_finite);
    std::vector<uint8_t> a(sb::bytes_for(n) + 1, 0xee), b = a;
    std::vector<float> ra(n), rb(n);
    const bool bad_a = sb::scalar::pack(x.data(), n, a.data(), -0.5f, 0.25f, ra.data());
    const bool bad_b = sb::avx512::pack(x.data(), n, b.data(), -0.5f, 0.25f, rb.data());
    EXPECT_EQ(a, b);
    EXPECT_EQ(a.back(), 0xee) << "wrote past ceil(n/8) bytes";
    EXPECT_EQ(bits_of(ra), bits_of(rb));
    EXPECT_EQ(bad_a, bad_b);
    EXPECT_EQ(bad_a, non_finite && n > 30);  // specials reach NaN at i = 30
    std::vector<uint8_t> c(a.size(), 0xee);
    sb::avx512::pack(x.data(), n, c.data(), -0.5f, 0.25f, nullptr);
    EXPECT_EQ(a, c);
  }
}

TEST_P(SignBitsSimd, SumsMatchScalarExactly) {
  const size_t n = GetParam();
  for (bool non_finite : {false, true}) {
    const auto x = awkward(n, non_finite);
    std::vector<uint8_t> a(sb::bytes_for(n)), b(a.size());
    const double sa = sb::scalar::pack_abs_sum(x.data(), n, a.data());
    const double sv = sb::avx512::pack_abs_sum(x.data(), n, b.data());
    EXPECT_EQ(a, b);
    if (std::isnan(sa)) {
      EXPECT_TRUE(std::isnan(sv));
    } else {
      EXPECT_EQ(sa, sv);
    }
    const auto pa = sb::scalar::pack_split_sums(x.data(), n, a.data());
    const auto pv = sb::avx512::pack_split_sums(x.data(), n, b.data());
    EXPECT_EQ(a, b);
    EXPECT_EQ(pa.negatives, pv.negatives);
    EXPECT_EQ(std::isnan(pa.positive), std::isnan(pv.positive));
    if (!std::isnan(pa.positive)) {
      EXPECT_EQ(pa.positive, pv.positive);
    }
    EXPECT_EQ(pa.negative, pv.negative);
  }
}

TEST_P(SignBitsSimd, ResidualAccumulateAndMomentumMatchScalar) {
  const size_t n = GetParam();
  const auto x = awkward(n, true);
  std::vector<float> ra(n), rb(n);
  sb::scalar::residual(x.data(), n, -0.75f, 0.5f, ra.data());
  sb::avx512::residual(x.data(), n, -0.75f, 0.5f, rb.data());
  EXPECT_EQ(bits_of(ra), bits_of(rb));

  std::vector<uint8_t> bits(sb::bytes_for(n));
  sb::scalar::pack(x.data(), n, bits.data(), -1, 1, nullptr);
  auto sa = testing::gradient(n, 77), sv = sa;
  sb::scalar::accumulate(bits.data(), n, -0.75f, 0.5f, sa.data());
  sb::avx512::accumulate(bits.data(), n, -0.75f, 0.5f, sv.data());
  EXPECT_EQ(bits_of(sa), bits_of(sv));

  auto ma = testing::gradient(n, 78), mv = ma;
  std::vector<uint8_t> ba(sb::bytes_for(n)), bv(ba.size());
  const bool bad_a =
      sb::scalar::momentum_pack(x.data(), ma.data(), ma.data(), n, 0.9f, 0.1f, ba.data(), ra.data());
  const bool bad_v =
      sb::avx512::momentum_pack(x.data(), mv.data(), mv.data(), n, 0.9f, 0.1f, bv.data(), rb.data());
  EXPECT_EQ(bad_a, bad_v);
  EXPECT_EQ(ba, bv);
  EXPECT_EQ(bits_of(ma), bits_of(mv));
  EXPECT_EQ(bits_of(ra), bits_of(rb));
}

INSTANTIATE_TEST_SUITE_P(Lengths, SignBitsSimd,
                         ::testing::Values(0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100,
                                           1000, 4099));
#endif

TEST(SignBits, MomentumSkipsNonFiniteGradients) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> g = {1.0f, nan, -inf, -2.0f}, m = {0.5f, 0.5f, -0.5f, 0.25f};
  std::vector<uint8_t> bits(1);
  std::vector<float> r(4);
  EXPECT_TRUE(sb::momentum_pack(g.data(), m.data(), m.data(), 4, 0.5f, 0.5f, bits.data(), r.data()));
  EXPECT_EQ(m[0], 0.75f);
  EXPECT_EQ(m[1], 0.5f);   // unchanged
  EXPECT_EQ(m[2], -0.5f);  // unchanged
  EXPECT_EQ(m[3], -0.875f);
  EXPECT_EQ(bits[0], 0x0c);  // m[2], m[3] < 0
  EXPECT_EQ(r[0], 0.0f);     // 1 - (+1)
  EXPECT_TRUE(std::isnan(r[1]));
  EXPECT_EQ(r[3], -1.0f);    // -2 - (-1)
}

TEST(SignBits, MajorityVoteKeepsTiesAtZeroAndNanAsNan) {
  std::vector<float> s = {3.0f, -1.0f, 0.0f, -0.0f, 0.5f, std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::infinity()};
  sb::majority_vote(s);
  EXPECT_EQ(s[0], 1.0f);
  EXPECT_EQ(s[1], -1.0f);
  EXPECT_EQ(std::bit_cast<uint32_t>(s[2]), 0u);
  EXPECT_EQ(std::bit_cast<uint32_t>(s[3]), 0u);
  EXPECT_EQ(s[4], 1.0f);
  EXPECT_TRUE(std::isnan(s[5]));
  EXPECT_EQ(s[6], -1.0f);
}

}  // namespace
}  // namespace gradcomp
