// Deterministic parallelism: work is cut into fixed-size chunks whose boundaries do not depend
// on the thread count, and partial results are combined in chunk order. So a codec returns the
// same bytes on 1 thread or 16.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
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

// Maps each chunk to a partial value, then folds the partials in chunk order. The partials of
// up to 256 chunks (16M elements) live on the stack: a codec's step allocates nothing.
template <typename T, typename Map, typename Fold>
T reduce_chunks(size_t n, int threads, T init, Map&& map, Fold&& fold) {
  constexpr size_t kOnStack = 256;
  const size_t chunks = chunk_count(n);
  std::array<T, kOnStack> local;
  std::vector<T> heap(chunks > kOnStack ? chunks : 0);
  const std::span<T> partial = chunks > kOnStack ? std::span<T>(heap)
                                                 : std::span<T>(local).first(chunks);
  for_chunks(n, threads, [&](size_t b, size_t e, size_t c) { partial[c] = map(b, e); });
  T acc = init;
  for (const T& p : partial) acc = fold(acc, p);
  return acc;
}

}  // namespace gradcomp
