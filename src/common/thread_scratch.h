// Scratch space per thread that keeps its capacity from one call to the next, so that a codec's
// per-step work allocates nothing once warm (docs/soak.md: allocations at new places in a
// thread's malloc arena are what made resident memory creep). Each `Tag` is a separate buffer:
// give every call site its own, so two live scratches never alias. A buffer keeps the largest
// size asked of it until its thread ends: the engine's threads are kept for the next engine
// (gradcomp/kept_thread.h), so keep these to small things (a row, a basis, decoded factors).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

namespace gradcomp {

template <typename T, typename Tag>
std::span<T> thread_scratch(size_t n) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return {buffer.data(), n};
}

}  // namespace gradcomp
