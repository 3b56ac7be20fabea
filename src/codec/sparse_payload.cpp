#include "codec/sparse_payload.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "common/parallel.h"
#include "gradcomp/error.h"

namespace gradcomp::sparse {
namespace {

inline uint32_t load_u32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float load_f32(const std::byte* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

void check_index_range(const char* codec, size_t n) {
  if (n > std::numeric_limits<uint32_t>::max()) {
    throw Error(fmt::format("codec '{}': a tensor of {} elements is too large; indices are 32-bit, "
                            "so at most {} elements are allowed (split it into buckets)",
                            codec, n, std::numeric_limits<uint32_t>::max()));
  }
}

void apply_non_finite_flag(const FrameHeader& header, std::span<float> sum) {
  if ((header.flags & kFlagNonFinite) == 0) return;
  for (float& s : sum) s += std::numeric_limits<float>::quiet_NaN();
}

void write_payload(std::span<std::byte> payload, std::span<const uint32_t> indices,
                   std::span<const float> values) {
  const auto count = static_cast<uint32_t>(indices.size());
  std::memcpy(payload.data(), &count, 4);
  if (count == 0) return;  // memcpy from an empty vector's null data() is undefined
  std::memcpy(payload.data() + 4, indices.data(), 4 * indices.size());
  std::memcpy(payload.data() + 4 + 4 * indices.size(), values.data(), 4 * values.size());
}

size_t validate_and_scatter_add(const char* codec, std::span<const std::byte> payload,
                                std::span<float> sum, size_t min_count, size_t max_count,
                                int threads) {
  const size_t n = sum.size();
  if (payload.size() < 4) {
    throw FrameError(fmt::format("{}: payload of {} bytes is too short for its 4-byte count",
                                 codec, payload.size()));
  }
  const size_t count = load_u32(payload.data());
  if (count > n) {
    throw FrameError(fmt::format("{}: payload announces {} entries for a tensor of {} elements",
                                 codec, count, n));
  }
  if (count < min_count || count > max_count) {
    throw FrameError(fmt::format("{}: payload holds {} entries; for {} elements this codec sends "
                                 "{}", codec, count, n,
                                 min_count == max_count
                                     ? fmt::format("exactly {}", min_count)
                                     : fmt::format("between {} and {}", min_count, max_count)));
  }
  if (payload.size() != payload_bytes(count)) {
    throw FrameError(fmt::format("{}: payload of {} entries must be {} bytes (4 + 8 per entry), "
                                 "it is {}", codec, count, payload_bytes(count), payload.size()));
  }
  const std::byte* idx = payload.data() + 4;
  const std::byte* val = idx + 4 * count;
  if (count == 0) return 0;
  // Every check before the first write: a rejected frame leaves `sum` untouched.
  bool unsorted = false;
  for (size_t j = 1; j < count; ++j) unsorted |= load_u32(idx + 4 * j) <= load_u32(idx + 4 * (j - 1));
  if (unsorted) {
    throw FrameError(fmt::format("{}: payload indices are not strictly increasing", codec));
  }
  const uint32_t last = load_u32(idx + 4 * (count - 1));
  if (last >= n) {  // sorted, so the last index is the largest
    throw FrameError(fmt::format("{}: payload index {} is out of range for a tensor of {} elements",
                                 codec, last, n));
  }
  // Indices are distinct, so chunks of entries scatter in parallel without conflicts. The
  // adds are mostly cache misses: prefetch a fixed distance ahead to keep many in flight.
  constexpr size_t kAhead = 32;
  float* out = sum.data();
  for_chunks(count, threads, [&](size_t b, size_t e, size_t) {
    size_t j = b;
    for (; j + kAhead < e; ++j) {
      __builtin_prefetch(out + load_u32(idx + 4 * (j + kAhead)), 1);
      out[load_u32(idx + 4 * j)] += load_f32(val + 4 * j);
    }
    for (; j < e; ++j) out[load_u32(idx + 4 * j)] += load_f32(val + 4 * j);
  });
  return count;
}

void zero_sent(std::span<float> residual, std::span<const uint32_t> sent) {
  if (residual.empty()) return;
  for (uint32_t i : sent) residual[i] = 0.0f;
}

}  // namespace gradcomp::sparse
