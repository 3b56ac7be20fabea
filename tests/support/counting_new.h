// Replaces the global operator new of the test binary that includes this header (in exactly
// one of its files) so that a test can count the allocations made on its thread: the checks
// that a step, once warm, allocates nothing.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

// Allocations made by operator new on each thread since it started.
thread_local long g_allocations = 0;

void* operator new(std::size_t size) {
  ++g_allocations;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
// Not inlined: GCC 12 sees a pointer from operator new reach std::free in an inlined delete and
// warns (-Wmismatched-new-delete), though this new allocates with malloc.
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t /*size*/) noexcept { std::free(p); }
