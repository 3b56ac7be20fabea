#include "gradcomp/frame.h"

#include <fmt/format.h>

#include <array>
#include <cstring>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

template <typename T>
void put(std::span<std::byte> out, size_t offset, T value) {
  std::memcpy(out.data() + offset, &value, sizeof value);  // little-endian hosts only
}
template <typename T>
T get(std::span<const std::byte> in, size_t offset) {
  T value;
  std::memcpy(&value, in.data() + offset, sizeof value);
  return value;
}

constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320U ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr auto kCrcTable = make_crc_table();

constexpr size_t kChecksumOffset = 36;

}  // namespace

static_assert(std::endian::native == std::endian::little, "frames are little-endian");

uint32_t crc32(std::span<const std::byte> bytes) {
  uint32_t c = 0xffffffffU;
  for (std::byte b : bytes) c = kCrcTable[(c ^ std::to_integer<uint32_t>(b)) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffU;
}

uint32_t fnv1a32(std::string_view text) {
  uint32_t h = 0x811c9dc5U;
  for (char ch : text) h = (h ^ static_cast<uint8_t>(ch)) * 0x01000193U;
  return h;
}

void write_frame_header(const FrameHeader& h, std::span<std::byte> out) {
  if (out.size() < kFrameHeaderBytes) {
    throw FrameError(fmt::format("output buffer of {} bytes cannot hold a {}-byte frame header",
                                 out.size(), kFrameHeaderBytes));
  }
  put(out, 0, kFrameMagic);
  put(out, 4, h.version);
  put(out, 5, h.codec_id);
  put(out, 6, h.round);
  put(out, 7, h.flags);
  put(out, 8, h.param_hash);
  put(out, 12, h.summands);
  put(out, 16, h.elements);
  put(out, 24, h.payload_bytes);
  put(out, 32, h.aux);
  put(out, kChecksumOffset, crc32(out.first(kChecksumOffset)));
}

FrameHeader read_frame_header(std::span<const std::byte> frame) {
  if (frame.size() < kFrameHeaderBytes) {
    throw FrameError(fmt::format("frame truncated: {} bytes, a frame header needs {}",
                                 frame.size(), kFrameHeaderBytes));
  }
  const auto magic = get<uint32_t>(frame, 0);
  if (magic != kFrameMagic) {
    throw FrameError(fmt::format("not a gradcomp frame: magic 0x{:08x}, expected 0x{:08x} (\"GCFR\")",
                                 magic, kFrameMagic));
  }
  FrameHeader h;
  h.version = get<uint8_t>(frame, 4);
  if (h.version != kFrameVersion) {
    throw FrameError(fmt::format("frame version {} is not supported; this build reads version {}",
                                 h.version, kFrameVersion));
  }
  const auto checksum = get<uint32_t>(frame, kChecksumOffset);
  if (checksum != crc32(frame.first(kChecksumOffset))) {
    throw FrameError("frame header is corrupted: its checksum does not match");
  }
  h.codec_id = get<uint8_t>(frame, 5);
  h.round = get<uint8_t>(frame, 6);
  h.flags = get<uint8_t>(frame, 7);
  h.param_hash = get<uint32_t>(frame, 8);
  h.summands = get<uint32_t>(frame, 12);
  h.elements = get<uint64_t>(frame, 16);
  h.payload_bytes = get<uint64_t>(frame, 24);
  h.aux = get<uint32_t>(frame, 32);
  if (h.payload_bytes > frame.size() - kFrameHeaderBytes) {
    throw FrameError(fmt::format("frame truncated: header announces a {}-byte payload, {} bytes follow",
                                 h.payload_bytes, frame.size() - kFrameHeaderBytes));
  }
  if (h.summands == 0) throw FrameError("frame is corrupted: it sums 0 frames");
  return h;
}

std::span<const std::byte> check_frame(std::span<const std::byte> frame,
                                       const FrameExpectation& expect, FrameHeader* out) {
  const FrameHeader h = read_frame_header(frame);
  if (h.codec_id != expect.codec_id) {
    throw FrameError(fmt::format("frame is from codec '{}' (id {}), this decoder is '{}' (id {})",
                                 codec_name(static_cast<CodecId>(h.codec_id)), h.codec_id,
                                 expect.codec_name, expect.codec_id));
  }
  if (h.param_hash != expect.param_hash) {
    throw FrameError(fmt::format("frame was encoded by codec '{}' with other parameters "
                                 "(parameter hash 0x{:08x}, this decoder has 0x{:08x})",
                                 expect.codec_name, h.param_hash, expect.param_hash));
  }
  if (h.round != expect.round) {
    throw FrameError(fmt::format("frame of codec '{}' is from round {}, expected round {}",
                                 expect.codec_name, h.round, expect.round));
  }
  if (h.elements != expect.elements) {
    throw FrameError(fmt::format("frame of codec '{}' holds {} elements, the buffer has {}",
                                 expect.codec_name, h.elements, expect.elements));
  }
  if (frame.size() != kFrameHeaderBytes + h.payload_bytes) {
    throw FrameError(fmt::format("frame of codec '{}' is {} bytes, its header says {}",
                                 expect.codec_name, frame.size(),
                                 kFrameHeaderBytes + h.payload_bytes));
  }
  if (out != nullptr) *out = h;
  return frame.subspan(kFrameHeaderBytes, h.payload_bytes);
}

void check_plain_header(const FrameHeader& h, const char* codec, bool summable,
                        uint8_t allowed_flags) {
  if ((h.flags & ~allowed_flags) != 0) {
    throw FrameError(fmt::format("codec '{}': frame flags 0x{:02x} hold unknown bits; allowed: {}",
                                 codec, h.flags,
                                 allowed_flags == 0 ? std::string("0x00")
                                                    : fmt::format("0x00 or 0x{:02x} (non-finite)",
                                                                  allowed_flags)));
  }
  if (h.aux != 0) {
    throw FrameError(fmt::format("codec '{}': frame aux is 0x{:x}; this codec writes 0", codec,
                                 h.aux));
  }
  if (!summable && h.summands != 1) {
    throw FrameError(fmt::format("codec '{}': frame sums {} frames, but this codec's frames "
                                 "cannot be summed; allowed: 1",
                                 codec, h.summands));
  }
}

uint64_t fnv1a64(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (const unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace gradcomp
