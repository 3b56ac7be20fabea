// Frame checks shared by the cast and sign codecs (fp16, bf16, signsgd, efsignsgd, signum,
// onebit), and the decoder of unscaled sign frames: none of them uses aux, only the casts are
// summable.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "codec/sign_bits.h"
#include "gradcomp/error.h"
#include "gradcomp/frame.h"

namespace gradcomp::casts {

// Throws unless `out` can hold a frame of `needed` bytes and `residual` is empty or has one
// element per input element.
inline void check_buffers(const char* codec, size_t n, std::span<std::byte> out, size_t needed,
                          std::span<const float> residual) {
  if (out.size() < needed) {
    throw Error(fmt::format("codec '{}': output buffer of {} bytes is too small; the frame "
                            "needs {}",
                            codec, out.size(), needed));
  }
  if (!residual.empty() && residual.size() != n) {
    throw Error(fmt::format("codec '{}': residual has {} elements, the input {}; allowed: empty "
                            "or the input's length",
                            codec, residual.size(), n));
  }
}

// Checks the header fields these codecs do not carry data in (flags beyond the non-finite bit,
// aux, and summands for codecs whose frames cannot be summed) and the payload length. Returns
// whether the non-finite flag is set.
inline bool check_header(const char* codec, const FrameHeader& h, size_t payload_bytes,
                         size_t expected_payload_bytes, bool summable,
                         uint8_t allowed_flags = kFlagNonFinite) {
  check_plain_header(h, codec, summable, allowed_flags);
  if (payload_bytes != expected_payload_bytes) {
    throw FrameError(fmt::format("codec '{}': payload is {} bytes; {} elements need exactly {}",
                                 codec, payload_bytes, h.elements, expected_payload_bytes));
  }
  return (h.flags & kFlagNonFinite) != 0;
}

// Sign bits: the padding bits after element n in the last byte must be zero (one canonical
// encoding per frame, and a check that catches some corruption).
inline void check_padding(const char* codec, const std::byte* bits, size_t n) {
  if (n % 8 == 0) return;
  const auto last = std::to_integer<uint8_t>(bits[n / 8]);
  if ((last >> (n % 8)) != 0) {
    throw FrameError(fmt::format("codec '{}': padding bits after element {} are not zero "
                                 "(last byte 0x{:02x})",
                                 codec, n, last));
  }
}

// The decoder's answer to the non-finite flag: every element of the sum becomes NaN.
inline void add_nan(std::span<float> sum) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float& s : sum) s += nan;
}

// Decodes the payload of an unscaled sign frame (signsgd, signum: one bit per element, 1 for
// negative) into sum: +-1 per element, or NaN everywhere when the frame is flagged non-finite.
inline void accumulate_unscaled_signs(const char* codec, const FrameHeader& h,
                                      std::span<const std::byte> payload, std::span<float> sum,
                                      int threads) {
  const bool non_finite =
      check_header(codec, h, payload.size(), sign_bits::bytes_for(sum.size()), false);
  check_padding(codec, payload.data(), sum.size());
  if (non_finite) {
    add_nan(sum);
    return;
  }
  sign_bits::accumulate_chunks(payload.data(), sum, -1.0f, 1.0f, threads);
}

}  // namespace gradcomp::casts
