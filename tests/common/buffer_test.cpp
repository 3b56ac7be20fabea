// Buffer<T>: blocks of a page or more are the process's own pages, given back to the system the
// moment they are freed (what keeps a plan change from leaving the old plan's buffers resident).
#include "common/buffer.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <numeric>

namespace gradcomp {
namespace {

// Whether the page holding `p` is mapped: mincore fails with ENOMEM on an unmapped address.
bool mapped(const void* p) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  auto* start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~(page - 1));
  unsigned char resident = 0;
  if (mincore(start, 1, &resident) == 0) return true;
  EXPECT_EQ(errno, ENOMEM);
  return false;
}

TEST(Buffer, ABlockOfAPageOrMoreIsUnmappedWhenFreed) {
  // 16 KiB: well below glibc's mmap threshold, so malloc would keep it in an arena (mapped).
  const float* data = nullptr;
  {
    Buffer<float> b(4096, 1.5f);
    data = b.data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % sysconf(_SC_PAGESIZE), 0u);
    EXPECT_TRUE(mapped(data));
    EXPECT_EQ(b[4095], 1.5f);
  }
  EXPECT_FALSE(mapped(data));
}

TEST(Buffer, GrowingKeepsTheValuesAndReleasesTheOldBlock) {
  Buffer<uint32_t> b(2048);
  std::iota(b.begin(), b.end(), 0u);
  const uint32_t* old = b.data();
  b.resize(1 << 20);
  EXPECT_FALSE(mapped(old));
  for (uint32_t i = 0; i < 2048; ++i) ASSERT_EQ(b[i], i);
  EXPECT_EQ(b.back(), 0u);  // value-initialised like std::vector
}

TEST(Buffer, SmallBlocksAndMovesWork) {
  Buffer<std::byte> small(100, std::byte{7});  // operator new, not a page of its own
  Buffer<std::byte> moved = std::move(small);
  EXPECT_EQ(moved.size(), 100u);
  EXPECT_EQ(moved[99], std::byte{7});
  Buffer<float> a(5000, 1.0f), b(10, 2.0f);
  a.swap(b);
  EXPECT_EQ(a.size(), 10u);
  EXPECT_EQ(b.size(), 5000u);
  b = a;  // copy into a block of another size class
  EXPECT_EQ(b.size(), 10u);
  EXPECT_EQ(b[9], 2.0f);
}

TEST(Buffer, AnImpossibleSizeIsBadAllocNotACrash) {
  PageAllocator<double> allocator;
  EXPECT_THROW(static_cast<void>(allocator.allocate(static_cast<size_t>(-1) / 4)), std::bad_alloc);
}

}  // namespace
}  // namespace gradcomp
