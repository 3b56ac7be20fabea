// The self-describing frame every codec writes: a 40-byte little-endian header, then the
// codec's payload. docs/wire-format.md is the normative description.
//
//   offset size field
//   0      4    magic "GCFR"
//   4      1    version (kFrameVersion)
//   5      1    codec id (CodecId)
//   6      1    round (0 for single-round codecs; the phase of a multi-round codec)
//   7      1    flags (bit 0: the input held NaN or Inf; set by codecs whose payload
//                      cannot carry them, so the decoder can propagate them)
//   8      4    parameter hash (FNV-1a of the codec's canonical spec)
//   12     4    summands: how many encoded frames were added into this one (1 when fresh)
//   16     8    element count n
//   24     8    payload length in bytes
//   32     4    aux: codec-defined (e.g. a shared scale); equal in frames that are summed
//   36     4    header checksum (CRC-32 of bytes 0..35)
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace gradcomp {

inline constexpr uint32_t kFrameMagic = 0x52464347;  // "GCFR" read as little-endian u32
inline constexpr uint8_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 40;
inline constexpr uint8_t kFlagNonFinite = 1;

struct FrameHeader {
  uint8_t version = kFrameVersion;
  uint8_t codec_id = 0;
  uint8_t round = 0;
  uint8_t flags = 0;
  uint32_t param_hash = 0;
  uint32_t summands = 1;
  uint64_t elements = 0;
  uint64_t payload_bytes = 0;
  uint32_t aux = 0;
};

// Writes the header (with its checksum) into the first kFrameHeaderBytes of `out`.
void write_frame_header(const FrameHeader& header, std::span<std::byte> out);

// Reads and checks a header: size, magic, version, checksum, and that the payload length fits
// in `frame`. Throws FrameError naming what is wrong. Does not look at the payload.
FrameHeader read_frame_header(std::span<const std::byte> frame);

// What a decoder expects of a frame; check_frame throws FrameError on any difference.
struct FrameExpectation {
  uint8_t codec_id;
  const char* codec_name;
  uint32_t param_hash;
  uint8_t round;
  uint64_t elements;  // the length of the sum buffer
};

// Reads the header, checks it against `expect`, and returns the payload (exactly
// payload_bytes long). Trailing bytes after the payload are an error.
std::span<const std::byte> check_frame(std::span<const std::byte> frame,
                                       const FrameExpectation& expect, FrameHeader* header);

// The payload of a frame whose header was written into out[0, kFrameHeaderBytes).
inline std::span<std::byte> frame_payload(std::span<std::byte> out) {
  return out.subspan(kFrameHeaderBytes);
}

// For codecs that keep no data in aux: checks that no flag outside `allowed_flags` is set (a
// codec whose payload carries NaN and Inf itself, such as none, never writes the non-finite
// flag and passes 0), aux is 0, and summands is 1 unless the codec's frames can be summed.
// Throws FrameError.
void check_plain_header(const FrameHeader& header, const char* codec, bool summable,
                        uint8_t allowed_flags = kFlagNonFinite);

uint32_t crc32(std::span<const std::byte> bytes);
uint32_t fnv1a32(std::string_view text);
// 64-bit FNV-1a: plan hashes and the ranks' consistency check.
uint64_t fnv1a64(std::string_view text);

}  // namespace gradcomp
