// The payload shared by the index-carrying sparsifiers (topk, dgc, threshold), and the helpers
// every sparsifier needs: the magnitude key that orders elements, the residual update and the
// element-count limit of 32-bit indices.
//
// Payload (little-endian, no padding; docs/wire-format.md (topk) is the normative description):
//   offset   size      field
//   0        4         count c (u32)
//   4        4c        indices (u32), strictly increasing, each < n
//   4 + 4c   4c        values (f32), values[j] belongs to indices[j]
// The payload is exactly 4 + 8c bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "gradcomp/frame.h"

namespace gradcomp::sparse {

// Orders elements by magnitude with integer compares: the float's bits without the sign.
// For finite values and Inf this is the order of |x|; every NaN maps above Inf, so a NaN is
// the largest magnitude and is always selected first (a loss scaler must see it).
inline uint32_t magnitude_key(uint32_t bits) { return bits & 0x7fffffffU; }
inline uint32_t magnitude_key(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return magnitude_key(bits);
}
// Every key at or above this one belongs to an Inf or a NaN.
inline constexpr uint32_t kNonFiniteKey = 0x7f800000U;

// Indices are u32, so a tensor must have fewer than 2^32 elements. Throws Error naming the
// codec otherwise.
void check_index_range(const char* codec, size_t n);

inline constexpr size_t payload_bytes(size_t count) { return 4 + 8 * count; }

// Adds NaN to every element when the header's non-finite flag is set.
void apply_non_finite_flag(const FrameHeader& header, std::span<float> sum);

// Writes count, indices and values into `payload` (at least payload_bytes(count) long).
void write_payload(std::span<std::byte> payload, std::span<const uint32_t> indices,
                   std::span<const float> values);

// Validates the whole payload against a tensor of sum.size() elements (length, a count in
// [min_count, max_count], every index in range and strictly increasing), then adds values[j]
// into sum[indices[j]]. Throws FrameError naming `codec` before touching `sum` if anything is
// wrong. O(count). Returns the count.
size_t validate_and_scatter_add(const char* codec, std::span<const std::byte> payload,
                                std::span<float> sum, size_t min_count, size_t max_count,
                                int threads);

// Where the selection pass should copy the input for the residual: the residual, unless it
// is empty or aliases the input (then it already holds the input).
inline float* residual_copy_target(std::span<const float> input, std::span<float> residual) {
  return residual.empty() || residual.data() == input.data() ? nullptr : residual.data();
}

// Finishes a sparsifier residual (input with the sent entries zeroed) once it holds the
// input: zeroes the sent entries. Nothing to do when it is empty.
void zero_sent(std::span<float> residual, std::span<const uint32_t> sent);

}  // namespace gradcomp::sparse
