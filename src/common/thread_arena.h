// Faults in the pages of the calling thread's malloc arena when a long-lived thread of
// gradcomp's starts (a KeptThread: the engine's stages, a transport's queue).
//
// Why: glibc gives each thread an arena of its own, a heap of 132 KiB at first, and a page of
// it becomes resident only when an allocation first reaches it. The small allocations of a
// thread's collectives vary in size with the plan (Open MPI's schedules of non-blocking
// collectives, allocated on the queue thread, are 16-43 KiB), so they kept reaching new pages
// for tens of thousands of steps: resident memory crept up by a few hundred KiB with nothing
// leaked (docs/soak.md). Touching the heap once at the start moves that to the first moment,
// and keeps the page faults out of the first training steps too.
#pragma once

#include <cstddef>
#include <cstdlib>

namespace gradcomp {

inline void fault_in_thread_arena() {
#ifdef __GLIBC__
  // Below the mmap threshold (128 KiB), so it comes from this thread's arena; freed, it joins
  // the arena's top chunk, which glibc keeps (it trims only beyond its 128 KiB top pad).
  constexpr size_t kBytes = 96 << 10;
  constexpr size_t kPage = 4096;
  auto* block = static_cast<volatile char*>(std::malloc(kBytes));
  if (block == nullptr) return;  // nothing gained, nothing lost
  for (size_t i = 0; i < kBytes; i += kPage) block[i] = 0;  // volatile: the writes stay
  std::free(const_cast<char*>(block));
#endif
}

}  // namespace gradcomp
