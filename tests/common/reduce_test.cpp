// reduce_into (vector bodies + scalar tails) against the scalar kernels, which define the bits
// every backend must produce: exhaustive and structured f16 / bf16 pairs, random data of every
// type, every short length (tails) and unaligned buffers.
#include "common/reduce.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace gradcomp {
namespace {

using Bytes = std::vector<std::byte>;

size_t element_size(DType type) {
  switch (type) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    default:
      return 1;
  }
}

template <typename T>
T load(const std::byte* p, size_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}

// The scalar kernel of (type, op) on element i of a and b, as raw bits widened to 32.
uint32_t reference(DType type, ReduceOp op, const std::byte* a, const std::byte* b, size_t i) {
  using namespace reduce;
  const bool sum = op == ReduceOp::kSum;
  switch (type) {
    case DType::kF32: {
      const float x = load<float>(a, i), y = load<float>(b, i);
      return std::bit_cast<uint32_t>(sum ? sum_f32(x, y) : max_f32(x, y));
    }
    case DType::kF16: {
      const uint16_t x = load<uint16_t>(a, i), y = load<uint16_t>(b, i);
      return sum ? sum_f16(x, y) : max_f16(x, y);
    }
    case DType::kBF16: {
      const uint16_t x = load<uint16_t>(a, i), y = load<uint16_t>(b, i);
      return sum ? sum_bf16(x, y) : max_bf16(x, y);
    }
    case DType::kI8: {
      const int8_t x = load<int8_t>(a, i), y = load<int8_t>(b, i);
      return static_cast<uint8_t>(sum ? sum_int(x, y) : std::max(x, y));
    }
    case DType::kU8: {
      const uint8_t x = load<uint8_t>(a, i), y = load<uint8_t>(b, i);
      return sum ? sum_int(x, y) : std::max(x, y);
    }
    case DType::kI32: {
      const int32_t x = load<int32_t>(a, i), y = load<int32_t>(b, i);
      return static_cast<uint32_t>(sum ? sum_int(x, y) : std::max(x, y));
    }
    case DType::kNone:
      break;
  }
  return 0;
}

uint32_t element_bits(DType type, const std::byte* p, size_t i) {
  switch (element_size(type)) {
    case 4:
      return load<uint32_t>(p, i);
    case 2:
      return load<uint16_t>(p, i);
    default:
      return load<uint8_t>(p, i);
  }
}

// Reduces `count` elements of a and b through reduce_into with the operands placed at the
// given byte offsets (to miss every alignment), and compares each result with the scalar
// kernel. Stops at the first difference.
void expect_matches(DType type, ReduceOp op, const std::byte* a, const std::byte* b, size_t count,
                    size_t dst_offset = 0, size_t src_offset = 0) {
  const size_t bytes = count * element_size(type);
  Bytes dst_store(bytes + dst_offset + 1), src_store(bytes + src_offset + 1);
  std::byte* dst = dst_store.data() + dst_offset;
  std::byte* src = src_store.data() + src_offset;
  if (bytes != 0) {
    std::memcpy(dst, a, bytes);
    std::memcpy(src, b, bytes);
  }
  ASSERT_TRUE(reduce_into(dst, src, count, type, op));
  for (size_t i = 0; i < count; ++i) {
    const uint32_t want = reference(type, op, a, b, i);
    const uint32_t got = element_bits(type, dst, i);
    ASSERT_EQ(got, want) << std::hex << "type " << static_cast<int>(type) << " op "
                         << static_cast<int>(op) << " element " << std::dec << i << " of "
                         << count << std::hex << ": " << element_bits(type, a, i) << " (op) "
                         << element_bits(type, b, i);
  }
  EXPECT_EQ(src_store, [&] {  // the source is not written
    Bytes copy(src_store.size());
    std::memcpy(copy.data() + src_offset, b, bytes);
    return copy;
  }());
}

template <typename T>
Bytes to_bytes(const std::vector<T>& v) {
  Bytes out(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMax};
constexpr DType kTypes[] = {DType::kF32, DType::kF16, DType::kBF16,
                            DType::kI8,  DType::kU8,  DType::kI32};

// Every sign x exponent x mantissa combination from lists chosen for the edges: zeros,
// subnormals, the normal boundary, 1.0, the exponents where adding 1 is a rounding tie (2048 in
// f16, 256 in bf16, 2^24 in f32), the largest finite values (sums overflow), Inf, and NaNs
// with quiet, signalling and full payloads.
template <typename T>
std::vector<T> special_values(int mantissa_bits, std::vector<uint32_t> exponents) {
  const uint32_t top = 1U << (mantissa_bits - 1), full = (1U << mantissa_bits) - 1;
  const std::vector<uint32_t> mantissas = {0, 1, 2, top - 1, top, top + 1, full - 1, full};
  std::vector<T> out;
  for (uint32_t sign : {0U, 1U})
    for (uint32_t e : exponents)
      for (uint32_t m : mantissas) {
        const uint32_t bits = (sign << (sizeof(T) * 8 - 1)) | (e << mantissa_bits) | m;
        out.push_back(static_cast<T>(bits));
      }
  return out;
}

std::vector<uint16_t> specials_f16() {
  return special_values<uint16_t>(10, {0, 1, 2, 14, 15, 16, 25, 26, 29, 30, 31});
}
std::vector<uint16_t> specials_bf16() {
  return special_values<uint16_t>(7, {0, 1, 2, 126, 127, 128, 134, 135, 253, 254, 255});
}
std::vector<uint32_t> specials_f32() {
  return special_values<uint32_t>(23, {0, 1, 2, 126, 127, 128, 150, 151, 253, 254, 255});
}

// All ordered pairs of `values`, laid out as two arrays.
template <typename T>
void expect_all_pairs(DType type, const std::vector<T>& values) {
  std::vector<T> a, b;
  for (T x : values)
    for (T y : values) {
      a.push_back(x);
      b.push_back(y);
    }
  for (ReduceOp op : kOps) expect_matches(type, op, to_bytes(a).data(), to_bytes(b).data(), a.size());
}

TEST(Reduce, AllPairsOfEdgeValues) {
  expect_all_pairs(DType::kF16, specials_f16());
  expect_all_pairs(DType::kBF16, specials_bf16());
  expect_all_pairs(DType::kF32, specials_f32());
}

// Every 16-bit pattern against 64 permutations of all 16-bit patterns (i * odd + c mod 2^16):
// 4M pairs per type and op, each pattern meeting 64 partners across the whole range.
TEST(Reduce, HalfPatternsAgainstPermutations) {
  std::vector<uint16_t> a(65536), b(65536);
  for (uint32_t i = 0; i < 65536; ++i) a[i] = static_cast<uint16_t>(i);
  const Bytes a_bytes = to_bytes(a);
  for (uint32_t k = 0; k < 64; ++k) {
    const uint32_t multiplier = 2 * (k * 977 + 1) + 1, offset = k * 40503;
    for (uint32_t i = 0; i < 65536; ++i) b[i] = static_cast<uint16_t>(i * multiplier + offset);
    const Bytes b_bytes = to_bytes(b);
    for (DType type : {DType::kF16, DType::kBF16})
      for (ReduceOp op : kOps) {
        expect_matches(type, op, a_bytes.data(), b_bytes.data(), a.size());
        if (HasFatalFailure()) return;
      }
  }
}

Bytes random_bytes(std::mt19937_64& rng, size_t n) {
  Bytes out(n);
  for (auto& x : out) x = static_cast<std::byte>(rng());
  return out;
}

TEST(Reduce, RandomDataEveryType) {
  std::mt19937_64 rng(20241123);
  const size_t count = 10007;
  for (DType type : kTypes) {
    const Bytes a = random_bytes(rng, count * element_size(type));
    const Bytes b = random_bytes(rng, count * element_size(type));
    for (ReduceOp op : kOps) expect_matches(type, op, a.data(), b.data(), count);
  }
}

// Random values in a narrow range of exponents, so that sums are mostly finite and round.
TEST(Reduce, RandomFiniteSums) {
  std::mt19937_64 rng(7);
  const size_t count = 4099;
  std::vector<uint16_t> f16(2 * count), bf16(2 * count);
  std::vector<uint32_t> f32(2 * count);
  for (size_t i = 0; i < 2 * count; ++i) {
    const uint64_t r = rng();
    f16[i] = static_cast<uint16_t>((r & 0x83ff) | (((r >> 16) % 8 + 12) << 10));
    bf16[i] = static_cast<uint16_t>((r & 0x807f) | (((r >> 16) % 8 + 124) << 7));
    f32[i] = static_cast<uint32_t>((r & 0x807fffff) | (((r >> 32) % 8 + 124) << 23));
  }
  const Bytes h = to_bytes(f16), bh = to_bytes(bf16), f = to_bytes(f32);
  for (ReduceOp op : kOps) {
    expect_matches(DType::kF16, op, h.data(), h.data() + 2 * count, count);
    expect_matches(DType::kBF16, op, bh.data(), bh.data() + 2 * count, count);
    expect_matches(DType::kF32, op, f.data(), f.data() + 4 * count, count);
  }
}

// Lengths 0..70 cover every tail after the vector bodies; offsets 0..3 bytes for each operand
// make every load and store unaligned. The data mixes edge values with random patterns.
TEST(Reduce, ShortLengthsAndUnalignedBuffers) {
  std::mt19937_64 rng(11);
  for (DType type : kTypes) {
    const size_t size = element_size(type);
    Bytes a = random_bytes(rng, 70 * size), b = random_bytes(rng, 70 * size);
    const Bytes edges = type == DType::kF16    ? to_bytes(specials_f16())
                        : type == DType::kBF16 ? to_bytes(specials_bf16())
                        : type == DType::kF32  ? to_bytes(specials_f32())
                                               : Bytes{};
    for (size_t i = 0; i < std::min(edges.size(), a.size()); i += 2 * size) {
      std::memcpy(a.data() + i, edges.data() + i, size);
      std::memcpy(b.data() + i + size, edges.data() + edges.size() - i - size, size);
    }
    for (ReduceOp op : kOps)
      for (size_t count = 0; count <= 70; ++count)
        for (size_t dst_offset = 0; dst_offset < 4; ++dst_offset)
          for (size_t src_offset = 0; src_offset < 4; ++src_offset) {
            expect_matches(type, op, a.data(), b.data(), count, dst_offset, src_offset);
            if (HasFatalFailure()) return;
          }
  }
}

TEST(Reduce, CanonicalNanAndSignedZeros) {
  // 33 copies, so the vector body and the scalar tail both compute it; they must agree.
  const auto one = [](DType type, ReduceOp op, uint32_t x, uint32_t y) {
    const size_t size = element_size(type), count = 33;
    Bytes d(count * size), s(count * size);
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(d.data() + i * size, &x, size);  // little endian: the low bytes
      std::memcpy(s.data() + i * size, &y, size);
    }
    reduce_into(d.data(), s.data(), count, type, op);
    const uint32_t first = element_bits(type, d.data(), 0);
    for (size_t i = 1; i < count; ++i) EXPECT_EQ(element_bits(type, d.data(), i), first);
    return first;
  };
  EXPECT_EQ(one(DType::kF16, ReduceOp::kSum, 0x7c00, 0xfc00), 0x7e00U);  // Inf - Inf
  EXPECT_EQ(one(DType::kF16, ReduceOp::kMax, 0x7d23, 0x3c00), 0x7e00U);  // signalling, payload
  EXPECT_EQ(one(DType::kF16, ReduceOp::kMax, 0x8000, 0x0000), 0x0000U);
  EXPECT_EQ(one(DType::kF16, ReduceOp::kSum, 0x7bff, 0x7bff), 0x7c00U);  // overflow
  EXPECT_EQ(one(DType::kBF16, ReduceOp::kSum, 0xff81, 0x3f80), 0x7fc0U);
  EXPECT_EQ(one(DType::kBF16, ReduceOp::kMax, 0x0000, 0x8000), 0x0000U);
  EXPECT_EQ(one(DType::kF32, ReduceOp::kMax, 0x80000000, 0x00000000), 0U);
  EXPECT_EQ(one(DType::kF32, ReduceOp::kSum, 0xffc12345, 0), 0x7fc00000U);
}

TEST(Reduce, UnknownTypeLeavesDestination) {
  uint32_t d = 5, s = 7;
  EXPECT_FALSE(reduce_into(&d, &s, 1, DType::kNone, ReduceOp::kSum));
  EXPECT_EQ(d, 5U);
}

}  // namespace
}  // namespace gradcomp
