// How many elements a fixed-count sparsifier (topk, randomk) sends: a ratio of the tensor or
// an absolute k. Exactly one of them is used; giving both is an error.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "gradcomp/error.h"
#include "gradcomp/spec.h"

namespace gradcomp::sparse {

// k for `ratio` of n elements: round half away from zero, at least 1 when n > 0, at most n.
inline size_t count_for_ratio(double ratio, size_t n) {
  if (n == 0) return 0;
  const auto k = static_cast<size_t>(std::llround(ratio * static_cast<double>(n)));
  return std::clamp<size_t>(k, 1, n);
}

class SparseCount {
 public:
  // Reads 'ratio' in (0, 1] or 'k' (an integer >= 0); neither gives ratio = default_ratio.
  static SparseCount parse(Spec& spec, double default_ratio) {
    SparseCount c;
    const auto ratio = spec.find_double("ratio", 0, 1, /*lo_open=*/true);
    const auto k = spec.find_int("k", 0, std::numeric_limits<uint32_t>::max());
    if (ratio && k) {
      spec.fail("parameters 'ratio' and 'k' both given; give one: 'ratio' in (0, 1] (a share "
                "of the tensor) or 'k' (an integer >= 0)");
    }
    if (k) {
      c.k_ = static_cast<size_t>(*k);
    } else {
      c.ratio_ = ratio.value_or(default_ratio);
    }
    return c;
  }

  // k for a tensor of n elements. A fixed k larger than n is an error naming the codec.
  size_t for_elements(const char* codec, size_t n) const {
    if (ratio_) return count_for_ratio(*ratio_, n);
    if (*k_ > n) {
      throw Error(fmt::format("codec '{}': parameter 'k' = {} exceeds the tensor's {} elements; "
                              "allowed: k <= n", codec, *k_, n));
    }
    return *k_;
  }
  // An upper bound of for_elements(n) that never throws, for buffer sizes.
  size_t bound(size_t n) const { return ratio_ ? count_for_ratio(*ratio_, n) : std::min(*k_, n); }

  // "ratio=0.01" or "k=100", for the canonical spec.
  std::string spec_text() const {
    return ratio_ ? "ratio=" + format_number(*ratio_) : fmt::format("k={}", *k_);
  }
  // The share of elements sent for large n: the ratio, or 0 for a fixed k.
  double nominal_ratio() const { return ratio_.value_or(0.0); }
  // CodecTraits::kept_fraction: the ratio; for a fixed k it depends on the tensor, so 1.
  double kept_fraction() const { return ratio_.value_or(1.0); }

 private:
  std::optional<double> ratio_;
  std::optional<size_t> k_;
};

}  // namespace gradcomp::sparse
