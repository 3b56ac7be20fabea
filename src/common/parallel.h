// Deterministic parallelism: work is cut into fixed-size chunks whose boundaries do not depend
// on the thread count, and partial results are combined in chunk order. So a codec returns the
// same bytes on 1 thread or 16.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace gradcomp {

// Elements per chunk: large enough to amortise a task, a multiple of 64 so bit-packed output
// of any width starts a chunk on a byte (and 64-bit word) boundary.
inline constexpr size_t kChunk = size_t{1} << 16;

inline size_t chunk_count(size_t n) { return (n + kChunk - 1) / kChunk; }

// Calls fn(begin, end, chunk_index) for each chunk of [0, n), on up to `threads` threads.
template <typename Fn>
void for_chunks(size_t n, int threads, Fn&& fn) {
  const auto chunks = static_cast<std::ptrdiff_t>(chunk_count(n));
  const int t = static_cast<int>(std::min<std::ptrdiff_t>(std::max(threads, 1), chunks));
#pragma omp parallel for schedule(static) num_threads(t) if (t > 1)
  for (std::ptrdiff_t c = 0; c < chunks; ++c) {
    const size_t begin = static_cast<size_t>(c) * kChunk;
    fn(begin, std::min(n, begin + kChunk), static_cast<size_t>(c));
  }
}

// Maps each chunk to a partial value, then folds the partials in chunk order. On one thread
// (the default) each partial is folded as it is made, so nothing is stored and a codec's step
// allocates nothing; on several, the partials are stored, then folded in the same order.
template <typename T, typename Map, typename Fold>
T reduce_chunks(size_t n, int threads, T init, Map&& map, Fold&& fold) {
  const size_t chunks = chunk_count(n);
  if (threads <= 1 || chunks <= 1) {
    T acc = init;
    for (size_t c = 0; c < chunks; ++c) {
      acc = fold(acc, map(c * kChunk, std::min(n, (c + 1) * kChunk)));
    }
    return acc;
  }
  std::vector<T> partial(chunks, init);
  for_chunks(n, threads, [&](size_t b, size_t e, size_t c) { partial[c] = map(b, e); });
  T acc = init;
  for (const T& p : partial) acc = fold(acc, p);
  return acc;
}

}  // namespace gradcomp
