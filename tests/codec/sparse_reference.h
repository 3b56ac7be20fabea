// Reference implementations and helpers for the sparsifier tests (topk, dgc, threshold,
// sparse_select): obviously-correct, slow versions to compare the fast code against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <vector>

#include "gradcomp/frame.h"

namespace gradcomp::testing {

// |a| ranks above |b|: NaN above everything, then by magnitude (Inf above finite).
inline bool larger_magnitude(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && !std::isnan(b);
  return std::fabs(a) > std::fabs(b);
}

// Indices of the k largest magnitudes, ties to the lower index, returned ascending.
inline std::vector<uint32_t> reference_top_k(std::span<const float> x, size_t k) {
  std::vector<uint32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return larger_magnitude(x[a], x[b]); });
  order.resize(std::min(k, x.size()));
  std::sort(order.begin(), order.end());
  return order;
}

// The sparse payload of a frame: count, indices, values (checked for consistent length).
struct SparsePayload {
  std::vector<uint32_t> indices;
  std::vector<float> values;
};

inline SparsePayload parse_sparse_payload(std::span<const std::byte> frame) {
  SparsePayload p;
  const std::byte* payload = frame.data() + kFrameHeaderBytes;
  uint32_t count;
  std::memcpy(&count, payload, 4);
  p.indices.resize(count);
  p.values.resize(count);
  if (count > 0) {
    std::memcpy(p.indices.data(), payload + 4, 4 * count);
    std::memcpy(p.values.data(), payload + 4 + 4 * count, 4 * count);
  }
  return p;
}

// Bit patterns, so NaN compares equal to itself.
inline std::vector<uint32_t> bits_of(std::span<const float> v) {
  std::vector<uint32_t> out(v.size());
  if (!v.empty()) std::memcpy(out.data(), v.data(), 4 * v.size());
  return out;
}

}  // namespace gradcomp::testing
