// Sums of squares in double, in a fixed order: 16 interleaved partial sums (lane j takes the
// elements whose index in the run is j mod 16, in increasing order) folded pairwise (8, 4, 2,
// 1). The inner loops over a block of 16 vectorise without -ffast-math, and a sum is the same on
// any machine and thread count (with parallel.h's chunks folded in order). The codecs' block
// norms (qsgd, dither) and the optimizers' layer norms (LAMB, LANS) take them.
#pragma once

#include <cstddef>

namespace gradcomp {

inline constexpr size_t kSquareLanes = 16;

// The running partial sums of one run; add(lane, x) with lane = (index in the run) mod 16.
// Fused loops (an optimizer's pass) feed several at once.
struct SquareLanes {
  double acc[kSquareLanes] = {};
  void add(size_t lane, float x) { acc[lane] += static_cast<double>(x) * x; }
  double total() {
    for (size_t width = kSquareLanes / 2; width > 0; width /= 2) {
      for (size_t j = 0; j < width; ++j) acc[j] += acc[j + width];
    }
    return acc[0];
  }
};

// The sum of x[0..len)^2.
inline double sum_squares(const float* x, size_t len) {
  SquareLanes lanes;
  for (size_t i = 0; i < len; i += kSquareLanes) {
    const size_t block = len - i < kSquareLanes ? len - i : kSquareLanes;
    for (size_t j = 0; j < block; ++j) lanes.add(j, x[i + j]);
  }
  return lanes.total();
}

}  // namespace gradcomp
