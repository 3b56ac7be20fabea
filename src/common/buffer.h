// Buffer<T>: the engine's gradient-sized memory (fused buckets, error-feedback residuals, codec
// state, frames), a std::vector whose blocks of a page or more come straight from the operating
// system and go back to it when freed.
//
// Why not malloc: these buffers live for a plan, and a plan change (compression="auto", a resume)
// frees one set and allocates another of other sizes, often from the engine's own threads.
// glibc serves a block from its arenas unless it is above the mmap threshold, which rises to the
// size of the largest mmapped block ever freed (up to 32 MiB: any framework freeing a large
// tensor raises it), and an arena keeps freed memory behind any chunk still in use. The old
// plan's buffers then stay resident: the soak measured RSS +5 to +7% over 100,000 steps with
// malloc's bytes in use flat (docs/soak.md). Pages of our own are released exactly.
//
// Small blocks (under a page, e.g. a vector of a few sizes) stay with operator new: an mmap
// each would waste most of a page. Growth by push_back maps a new block and unmaps the old one,
// so hot paths size their buffers once and reuse them; steps allocate no such block.
//
// A GPU build would give buffers that cross the PCIe bus pinned memory here.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <new>
#include <vector>

namespace gradcomp {

namespace page_memory {

// Blocks of at least this many bytes are mapped pages; smaller ones come from operator new.
inline constexpr size_t kMinMappedBytes = 4096;

inline void* allocate(size_t bytes) {
  if (bytes < kMinMappedBytes) return ::operator new(bytes);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}

inline void release(void* p, size_t bytes) noexcept {
  if (bytes < kMinMappedBytes) {
    ::operator delete(p);
  } else {
    ::munmap(p, bytes);
  }
}

}  // namespace page_memory

template <class T>
struct PageAllocator {
  using value_type = T;

  PageAllocator() noexcept = default;
  template <class U>
  PageAllocator(const PageAllocator<U>& /*other*/) noexcept {}  // NOLINT: rebinding converts

  T* allocate(size_t n) {
    if (n > static_cast<size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(page_memory::allocate(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) noexcept { page_memory::release(p, n * sizeof(T)); }

  template <class U>
  bool operator==(const PageAllocator<U>& /*other*/) const noexcept {
    return true;
  }
};

template <class T>
using Buffer = std::vector<T, PageAllocator<T>>;

}  // namespace gradcomp
