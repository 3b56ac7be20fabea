// Stratified sampling of one index per stratum: [0, n) is cut into k strata
// [floor(j*n/k), floor((j+1)*n/k)), j = 0..k-1, and stratum j yields lo_j + below(j, size_j)
// from a CounterRng. Indices come out sorted and distinct, each is O(1) to compute, and they
// are a pure function of (rng key, n, k). randomk uses it for the indices every rank shares;
// the sparse selector uses it to sample magnitudes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradcomp/random.h"

namespace gradcomp::sparse {

class Strata {
 public:
  // Requires 0 < k <= n < 2^32, so j*n never overflows 64 bits.
  Strata(uint64_t n, uint64_t k) : n_(n), k_(k) {}

  uint64_t count() const { return k_; }
  // First element of stratum j (j <= k; lo(k) == n).
  uint64_t lo(uint64_t j) const { return j * n_ / k_; }
  // The stratum holding element p (p < n): the largest j with lo(j) <= p.
  uint64_t stratum_of(uint64_t p) const { return ((p + 1) * k_ - 1) / n_; }

  // Walks strata j, j+1, ... with one division at the start: lo advances by n/k, plus one
  // whenever the remainder j*n mod k wraps.
  class Cursor {
   public:
    Cursor(const Strata& s, uint64_t j)
        : step_(s.n_ / s.k_), extra_(s.n_ % s.k_), k_(s.k_), lo_(j * s.n_ / s.k_),
          rem_(j * s.n_ % s.k_) {}
    uint64_t lo() const { return lo_; }
    // Size of the current stratum: n/k, or one more when the remainder wraps.
    uint64_t size() const { return step_ + (rem_ + extra_ >= k_ ? 1 : 0); }
    void next() {
      const uint64_t wrap = rem_ + extra_ >= k_ ? 1 : 0;
      lo_ += step_ + wrap;
      rem_ = rem_ + extra_ - wrap * k_;
    }

   private:
    uint64_t step_, extra_, k_, lo_, rem_;
  };

 private:
  uint64_t n_, k_;
};

// The sampled index of stratum j, given its start and size.
inline uint64_t stratum_pick(const CounterRng& rng, uint64_t j, uint64_t lo, uint64_t size) {
  return lo + rng.below(static_cast<uint32_t>(j), static_cast<uint32_t>(size));
}

}  // namespace gradcomp::sparse
