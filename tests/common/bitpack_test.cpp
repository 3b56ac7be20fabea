#include "common/bitpack.h"

#include <gtest/gtest.h>

#include <vector>

#include "gradcomp/random.h"

namespace gradcomp {
namespace {

TEST(BitPack, LayoutIsLsbFirst) {
  std::vector<std::byte> out(2);
  BitWriter w(out.data(), 3);
  for (uint32_t code : {1u, 2u, 7u, 0u, 5u}) w.put(code);
  w.flush();
  // bits: 1=100, 2=010, 7=111, 0=000, 5=101 -> stream 100 010 111 000 101 (LSB first)
  EXPECT_EQ(std::to_integer<int>(out[0]), 0b11010001);
  EXPECT_EQ(std::to_integer<int>(out[1]), 0b01010001);
}

TEST(BitPack, RoundTripsEveryWidth) {
  const CounterRng rng(1, 0, 0, 0);
  for (unsigned bits = 1; bits <= 24; ++bits) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{33}, size_t{1000}}) {
      std::vector<uint32_t> codes(n);
      for (size_t i = 0; i < n; ++i) codes[i] = rng.bits(static_cast<uint32_t>(i)) & ((1u << bits) - 1);
      std::vector<std::byte> out(packed_bytes(n, bits));
      BitWriter w(out.data(), bits);
      for (uint32_t c : codes) w.put(c);
      w.flush();
      BitReader r(out.data(), out.size(), bits);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(r.get(), codes[i]) << bits << " bits, element " << i;
    }
  }
}

}  // namespace
}  // namespace gradcomp
