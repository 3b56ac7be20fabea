#include "gradcomp/random.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

namespace gradcomp {
namespace {

TEST(CounterRng, IsAPureFunctionOfKeyAndCounter) {
  const CounterRng a(1, 2, 3, 4), b(1, 2, 3, 4);
  for (uint32_t i = 0; i < 1000; ++i) EXPECT_EQ(a.bits(i), b.bits(i));
  // Evaluation order does not matter.
  EXPECT_EQ(a.bits(999), CounterRng(1, 2, 3, 4).bits(999));
}

TEST(CounterRng, EveryKeyPartChangesTheStream) {
  const CounterRng base(1, 2, 3, 4, 0);
  const std::vector<CounterRng> others = {CounterRng(9, 2, 3, 4, 0), CounterRng(1, 9, 3, 4, 0),
                                          CounterRng(1, 2, 9, 4, 0), CounterRng(1, 2, 3, 9, 0),
                                          CounterRng(1, 2, 3, 4, 9)};
  for (const auto& o : others) {
    int same = 0;
    for (uint32_t i = 0; i < 256; ++i) same += o.bits(i) == base.bits(i);
    EXPECT_LT(same, 3);
  }
}

TEST(CounterRng, UniformIsUniform) {
  const CounterRng rng(7, 0, 0, 0);
  const int n = 1 << 20, bins = 16;
  std::vector<int> count(bins);
  double sum = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const float u = rng.uniform(i);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
    ++count[static_cast<int>(u * bins)];
  }
  EXPECT_NEAR(sum / n, 0.5, 5 * std::sqrt(1.0 / 12 / n));
  double chi2 = 0;
  for (int c : count) chi2 += std::pow(c - n / bins, 2) / (n / bins);
  EXPECT_LT(chi2, 40.0);  // 15 degrees of freedom: p < 0.001 beyond 37.7
}

TEST(CounterRng, AdjacentCountersAreUncorrelated) {
  const CounterRng rng(3, 1, 4, 1);
  const int n = 1 << 18;
  double xy = 0;
  for (uint32_t i = 0; i < n; ++i) xy += (rng.uniform(i) - 0.5) * (rng.uniform(i + 1) - 0.5);
  EXPECT_NEAR(xy / n, 0.0, 5 * (1.0 / 12) / std::sqrt(n));
}

TEST(CounterRng, BelowStaysInRange) {
  const CounterRng rng(1, 1, 1, 1);
  std::set<uint32_t> seen;
  for (uint32_t i = 0; i < 10000; ++i) {
    const uint32_t v = rng.below(i, 7);
    ASSERT_LT(v, 7u);
    seen.insert(v);
  }
  EXPECT_EQ(seen.size(), 7u);
}

}  // namespace
}  // namespace gradcomp
