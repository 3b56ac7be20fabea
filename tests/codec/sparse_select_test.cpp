// The shared sparse internals: exact top-k whatever the sample (tiny samples force the
// retry and fallback paths), threshold filtering, the strata of random-k.
#include "codec/sparse_select.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "codec/sparse_payload.h"
#include "codec/sparse_reference.h"
#include "codec/sparse_strata.h"
#include "support/codec_testing.h"

namespace gradcomp::sparse {
namespace {

using testing::bits_of;
using testing::gradient;
using testing::reference_top_k;

// The selection's indices (in engine buffers) as a plain vector, to compare with a reference.
std::vector<uint32_t> indices_of(const Selection& s) { return {s.indices.begin(), s.indices.end()}; }

std::vector<std::vector<float>> inputs(size_t n) {
  std::vector<std::vector<float>> all;
  all.push_back(gradient(n, n));
  auto tied = gradient(n, n + 1);
  for (float& v : tied) v = std::round(v * 3.0f) / 3.0f;  // many ties, many zeros
  all.push_back(tied);
  std::vector<float> sparse(n, 0.0f);  // 1% non-zero: the sample sees mostly zeros
  for (size_t i = 0; i < n; i += 100) sparse[i] = static_cast<float>(i % 7) - 3.0f;
  all.push_back(sparse);
  std::vector<float> clustered(n, 0.001f);  // all large values in one region
  for (size_t i = n / 3; i < n / 3 + n / 50; ++i) clustered[i] = static_cast<float>(i);
  all.push_back(clustered);
  auto special = gradient(n, n + 2);
  for (size_t i = 0; i < n; i += 997) special[i] = std::numeric_limits<float>::quiet_NaN();
  for (size_t i = 5; i < n; i += 1499) special[i] = -std::numeric_limits<float>::infinity();
  all.push_back(special);
  return all;
}

TEST(SparseSelect, ExactTopKForEverySampleSize) {
  TopKSelector selector;
  Selection out;
  for (size_t n : {size_t{1}, size_t{2}, size_t{33}, size_t{4097}, size_t{150000}}) {
    for (const auto& x : inputs(n)) {
      for (size_t k : {size_t{0}, size_t{1}, n / 100, n / 10, n / 2, n - 1, n}) {
        const auto expected = reference_top_k(x, k);
        for (size_t sample : {size_t{1}, size_t{8}, size_t{64}, size_t{4096}, n}) {
          for (int threads : {1, 2}) {
            const CounterRng rng(sample, k, n, 0, 1);
            // On two threads, also ask for the copy made on the way (the residual's start).
            std::vector<float> copy(threads == 2 ? n : 0, -7.0f);
            selector.select(x, k, sample, rng, threads, out, copy.empty() ? nullptr : copy.data());
            ASSERT_EQ(indices_of(out), expected) << "n " << n << " k " << k << " sample " << sample;
            if (!copy.empty()) {
              ASSERT_EQ(bits_of(copy), bits_of(x));
            }
            std::vector<float> values;
            for (uint32_t i : expected) values.push_back(x[i]);
            ASSERT_EQ(bits_of(out.values), bits_of(values));
          }
        }
      }
    }
  }
}

// An adversarial input: exactly the sampled positions hold tiny magnitudes, so the estimated
// threshold lets through far more candidates than the cap and the selector must fall back.
TEST(SparseSelect, MisleadingSampleFallsBackToExact) {
  const size_t n = 100000, s = 256, k = 500;
  auto x = gradient(n, 77);
  for (float& v : x) v = 1.0f + std::fabs(v);
  const CounterRng rng(9, 0, 0, 0, 1);
  Strata::Cursor cursor(Strata(n, s), 0);
  for (size_t j = 0; j < s; ++j, cursor.next()) {
    x[stratum_pick(rng, j, cursor.lo(), cursor.size())] = 1e-3f * static_cast<float>(j);
  }
  TopKSelector selector;
  Selection out;
  std::vector<float> copy(n);
  selector.select(x, k, s, rng, 2, out, copy.data());
  EXPECT_EQ(indices_of(out), reference_top_k(x, k));
  EXPECT_EQ(copy, x);
}

TEST(SparseSelect, AtLeastKeepsEveryKeyAtOrAboveInOrder) {
  std::vector<ChunkCandidates> parts;
  Selection out;
  for (size_t n : {size_t{0}, size_t{15}, size_t{16}, size_t{200001}}) {
    for (const auto& x : inputs(std::max<size_t>(n, 1))) {
      const std::span<const float> view(x.data(), n);
      for (float tau : {1e-6f, 0.5f, 1.0f, 3.0f, 1e30f}) {
        std::vector<float> copy(n, -7.0f);
        select_at_least(view, magnitude_key(tau), 2, parts, out, copy.data());
        ASSERT_EQ(bits_of(copy), bits_of(view));
        std::vector<uint32_t> expected;
        for (uint32_t i = 0; i < n; ++i) {
          if (!(std::fabs(view[i]) < tau)) expected.push_back(i);  // NaN and Inf pass
        }
        ASSERT_EQ(indices_of(out), expected) << "n " << n << " tau " << tau;
      }
    }
  }
}

TEST(SparseSelect, CollectGivesUpBeyondTheCap) {
  const auto x = gradient(300000, 3);
  std::vector<ChunkCandidates> parts;
  std::vector<float> copy(x.size());
  EXPECT_FALSE(collect_above(x, 0, 1000, 2, parts, copy.data()));
  EXPECT_EQ(copy, x);  // copied even where filtering gave up
  EXPECT_TRUE(collect_above(x, magnitude_key(4.0f), 1000, 2, parts));
}

// Every length from 1 to 300 and around the 16-lane and 4,096-element block edges: the
// candidates are exactly the elements above the key, in order. Under the ThreadSanitizer build
// GCC 12 once counted a spilled lane mask's neighbouring stack bytes as candidates (more
// candidates than elements); the ThreadSanitizer stage of scripts/test.sh runs this test.
TEST(SparseSelect, CollectFindsExactlyTheElementsAboveTheKey) {
  std::vector<size_t> lengths;
  for (size_t n = 1; n <= 300; ++n) lengths.push_back(n);
  for (size_t n : {4095, 4096, 4097, 4111, 8192 + 15, 65536, 65537, 140000}) lengths.push_back(n);
  std::vector<ChunkCandidates> parts;
  for (size_t n : lengths) {
    const auto x = gradient(n, n + 11);
    const uint32_t key = magnitude_key(x[(n * 7) / 10]);
    std::vector<uint32_t> expected;
    for (size_t i = 0; i < n; ++i) {
      if (magnitude_key(x[i]) > key) expected.push_back(static_cast<uint32_t>(i));
    }
    ASSERT_TRUE(collect_above(x, key, n, 1, parts));  // one thread: ThreadSanitizer cannot see
                                                      // OpenMP's barriers
    std::vector<uint32_t> found;
    for (const auto& part : parts) found.insert(found.end(), part.indices.begin(), part.indices.end());
    ASSERT_EQ(found, expected) << "n " << n;
  }
}

TEST(SparseStrata, OneIndexPerStratumAndCursorMatchesDivision) {
  for (auto [n, k] : {std::pair<uint64_t, uint64_t>{10, 3}, {1000, 7}, {1000, 1000}, {17, 1},
                      {4294967295ULL, 65537}}) {
    const Strata strata(n, k);
    Strata::Cursor cursor(strata, 0);
    const CounterRng rng(1, 2, 3, CounterRng::kSharedRank);
    for (uint64_t j = 0; j < std::min<uint64_t>(k, 5000); ++j, cursor.next()) {
      ASSERT_EQ(cursor.lo(), j * n / k);
      ASSERT_EQ(cursor.size(), (j + 1) * n / k - j * n / k);
      const uint64_t i = stratum_pick(rng, j, cursor.lo(), cursor.size());
      ASSERT_GE(i, cursor.lo());
      ASSERT_LT(i, cursor.lo() + cursor.size());
      ASSERT_EQ(strata.stratum_of(i), j);
      ASSERT_EQ(strata.stratum_of(cursor.lo()), j);
    }
    Strata::Cursor late(strata, k - 1);
    EXPECT_EQ(late.lo() + late.size(), n);
  }
}

}  // namespace
}  // namespace gradcomp::sparse
