// Selection of large-magnitude elements for the sparsifiers.
//
// Exact top-k without a global heap: estimate the k-th largest magnitude from a stratified
// sample, collect in one filtering pass every element above the estimate (chunk-parallel,
// vectorised), then fix the result up exactly on those few candidates (nth_element). Ties at
// the k-th magnitude go to the lower indices, NaN counts as the largest magnitude, and the
// result is the same whatever the sample or the thread count: only the speed depends on them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/buffer.h"
#include "gradcomp/random.h"

namespace gradcomp::sparse {

// Selected elements: ascending indices and the input's values at them.
struct Selection {
  Buffer<uint32_t> indices;
  Buffer<float> values;
};

// Candidates found by one filtering pass, kept per chunk so chunks are filtered in parallel
// and read back in chunk (= index) order.
struct ChunkCandidates {
  Buffer<uint32_t> indices;  // elements with key > threshold, ascending
  Buffer<uint32_t> bits;     // their float bits
  size_t ties = 0;                // elements with key == threshold
};

class TopKSelector {
 public:
  // Writes exactly min(k, n) elements of x into `out`: those with the largest magnitude
  // keys (magnitude_key), ties broken towards lower indices. `sample_count` magnitudes
  // (clamped to [1, n]) drawn from `rng` estimate the threshold. Requires n < 2^32.
  // When `copy` is not null (n floats, not overlapping x) it also receives a copy of x, made
  // during the filtering pass: the residual's starting point at no extra read.
  void select(std::span<const float> x, size_t k, size_t sample_count, const CounterRng& rng,
              int threads, Selection& out, float* copy = nullptr);

 private:
  enum class Outcome { kDone, kTooMany, kTooFew };
  // Fills sample_ with the magnitude keys of one element from each of s equal strata.
  void draw_sample(std::span<const float> x, size_t s, const CounterRng& rng);
  // One filtering pass at threshold `key`: kTooMany when more than `cap` elements lie above
  // it, kTooFew when fewer than k lie at or above it; otherwise `out` holds the answer.
  Outcome try_threshold(std::span<const float> x, size_t k, uint32_t key, size_t cap,
                        int threads, Selection& out, float* copy);
  void finish_above(size_t k, size_t candidates, Selection& out);
  void finish_with_ties(std::span<const float> x, size_t k, uint32_t key, Selection& out);

  Buffer<uint32_t> sample_;
  Buffer<uint32_t> keys_;
  Buffer<uint32_t> ties_;
  std::vector<ChunkCandidates> parts_;
};

// The sample count topk uses for n elements: 1/128 of them, at least 4096 and at most 2^17.
size_t default_sample_count(size_t n);

// Filters x for key > `key` into per-chunk candidates (resized to chunk_count(n)). Returns false
// (and stops filtering) once more than `cap` candidates were found. A non-null `copy` receives
// all of x either way.
bool collect_above(std::span<const float> x, uint32_t key, size_t cap, int threads,
                   std::vector<ChunkCandidates>& parts, float* copy = nullptr);

// Every element with magnitude key >= `key` (> 0), ascending: the threshold codec's selection.
// A non-null `copy` receives x, as in TopKSelector::select.
void select_at_least(std::span<const float> x, uint32_t key, int threads,
                     std::vector<ChunkCandidates>& parts, Selection& out, float* copy = nullptr);

}  // namespace gradcomp::sparse
