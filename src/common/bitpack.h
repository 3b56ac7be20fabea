// Bit-packing of small unsigned codes, LSB-first: element i's b-bit code occupies bits
// [i*b, (i+1)*b) of the little-endian bit stream (bit j is bit j%8 of byte j/8).
// A chunk of kChunk elements always starts on a byte boundary, so chunks pack in parallel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace gradcomp {

inline constexpr size_t packed_bytes(size_t n, unsigned bits) { return (n * bits + 7) / 8; }

// Streams codes of `bits` (1..24) bits into `out`, starting at byte 0. Call flush() at the end.
class BitWriter {
 public:
  BitWriter(std::byte* out, unsigned bits) : out_(out), bits_(bits) {}
  void put(uint32_t code) {
    acc_ |= uint64_t{code} << fill_;
    fill_ += bits_;
    if (fill_ >= 32) {
      const auto word = static_cast<uint32_t>(acc_);
      std::memcpy(out_, &word, 4);
      out_ += 4;
      acc_ >>= 32;
      fill_ -= 32;
    }
  }
  void flush() {
    for (; fill_ > 0; fill_ = fill_ > 8 ? fill_ - 8 : 0, acc_ >>= 8) *out_++ = std::byte(acc_);
  }

 private:
  std::byte* out_;
  unsigned bits_;
  uint64_t acc_ = 0;
  unsigned fill_ = 0;
};

// Reads codes written by BitWriter. `in` must hold packed_bytes(count, bits) bytes; the reader
// never touches a byte past them.
class BitReader {
 public:
  BitReader(const std::byte* in, size_t bytes, unsigned bits)
      : in_(in), end_(in + bytes), bits_(bits), mask_((uint64_t{1} << bits) - 1) {}
  uint32_t get() {
    if (fill_ < bits_) refill();
    const auto code = static_cast<uint32_t>(acc_ & mask_);
    acc_ >>= bits_;
    fill_ -= bits_;
    return code;
  }

 private:
  void refill() {
    if (end_ - in_ >= 4) {
      uint32_t word;
      std::memcpy(&word, in_, 4);
      acc_ |= uint64_t{word} << fill_;
      in_ += 4;
      fill_ += 32;
    } else {
      while (in_ < end_ && fill_ <= 56) {
        acc_ |= uint64_t{std::to_integer<uint8_t>(*in_++)} << fill_;
        fill_ += 8;
      }
    }
  }
  const std::byte* in_;
  const std::byte* end_;
  unsigned bits_;
  uint64_t mask_;
  uint64_t acc_ = 0;
  unsigned fill_ = 0;
};

}  // namespace gradcomp
