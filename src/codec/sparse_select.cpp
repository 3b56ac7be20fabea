#include "codec/sparse_select.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "codec/sparse_payload.h"
#include "codec/sparse_strata.h"
#include "common/parallel.h"

namespace gradcomp::sparse {
namespace {

struct BlockCount {
  size_t greater = 0;
  size_t ties = 0;
};

// Filters x[b, e) for magnitude key > `key`: writes their indices and float bits to idx_out
// and bits_out and counts the elements whose key equals `key`. The outputs need room for
// e - b + 16 entries: the vector path stores 16 lanes at a time, unconditionally, because a
// data-dependent branch per 16 elements mispredicts far more often than it saves a store.
// With kCopy it also copies x[b, e) to copy[b, e) (the residual), saving a second read.
template <bool kCopy>
BlockCount filter_block(const float* x, float* copy, size_t b, size_t e, uint32_t key,
                        uint32_t* idx_out, uint32_t* bits_out) {
  size_t found = 0, ties = 0, i = b;
#if defined(__AVX512F__)
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i threshold = _mm512_set1_epi32(static_cast<int>(key));
  const __m512i lane_step = _mm512_set1_epi32(16);
  __m512i lane_index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(b))),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                          12, 13, 14, 15));
  for (; i + 16 <= e; i += 16) {
    const __m512i bits = _mm512_loadu_si512(x + i);
    if constexpr (kCopy) _mm512_storeu_si512(copy + i, bits);
    const __m512i magnitude = _mm512_and_si512(bits, abs_mask);
    const __mmask16 greater = _mm512_cmpgt_epu32_mask(magnitude, threshold);
    const __mmask16 equal = _mm512_cmpeq_epu32_mask(magnitude, threshold);
    _mm512_storeu_si512(idx_out + found, _mm512_maskz_compress_epi32(greater, lane_index));
    _mm512_storeu_si512(bits_out + found, _mm512_maskz_compress_epi32(greater, bits));
    // The masks go through _cvtmask16_u32, not a cast: GCC 12, spilling a mask under register
    // pressure (the ThreadSanitizer build), stored 16 bits and popcounted 32 from the slot,
    // counting stack garbage (more candidates than elements).
    found += _mm_popcnt_u32(_cvtmask16_u32(greater));
    ties += _mm_popcnt_u32(_cvtmask16_u32(equal));
    lane_index = _mm512_add_epi32(lane_index, lane_step);
  }
#endif
  for (; i < e; ++i) {  // branch-free: write every element, advance only past the kept ones
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    if constexpr (kCopy) copy[i] = x[i];
    idx_out[found] = static_cast<uint32_t>(i);
    bits_out[found] = bits;
    found += magnitude_key(bits) > key;
    ties += magnitude_key(bits) == key;
  }
  return {found, ties};
}

// A chunk is filtered a block at a time into room on the stack (the block's candidates plus the
// vector path's overhang: 2 x 16 KiB), and each block's candidates are appended to the chunk's.
// No per-thread heap buffer: a thread_local one of a whole chunk (2 x 256 KiB) was allocated
// by every engine's encoder thread and freed when the thread ended (at every plan change or
// resume); glibc then raised its mmap threshold above 256 KiB, the next engines' buffers came
// from the threads' arenas, and the arenas kept the freed memory: RSS grew by 1 to 2 MiB over
// 100,000 soak steps with malloc's bytes in use flat (docs/soak.md).
constexpr size_t kFilterBlock = 4096;
static_assert(kChunk % kFilterBlock == 0);

float from_bits(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

size_t total_candidates(const std::vector<ChunkCandidates>& parts) {
  size_t total = 0;
  for (const auto& p : parts) total += p.indices.size();
  return total;
}

}  // namespace

size_t default_sample_count(size_t n) {
  return std::clamp<size_t>(n / 128, 4096, size_t{1} << 17);
}

bool collect_above(std::span<const float> x, uint32_t key, size_t cap, int threads,
                   std::vector<ChunkCandidates>& parts, float* copy) {
  const size_t n = x.size();
  parts.resize(chunk_count(n));
  // The running total only decides whether to give up; it exceeds cap exactly when the full
  // count does, so the outcome does not depend on the order chunks finish in.
  std::atomic<size_t> total{0};
  std::atomic<bool> too_many{false};
  for_chunks(n, threads, [&](size_t b, size_t e, size_t c) {
    ChunkCandidates& part = parts[c];
    part.indices.clear();
    part.bits.clear();
    part.ties = 0;
    std::array<uint32_t, kFilterBlock + 16> indices, bits;  // uninitialised: written first
    for (size_t s = b; s < e; s += kFilterBlock) {
      if (too_many.load(std::memory_order_relaxed)) {
        if (copy != nullptr) std::memcpy(copy + s, x.data() + s, 4 * (e - s));  // still owed
        return;
      }
      const size_t end = std::min(e, s + kFilterBlock);
      const BlockCount count =
          copy != nullptr
              ? filter_block<true>(x.data(), copy, s, end, key, indices.data(), bits.data())
              : filter_block<false>(x.data(), copy, s, end, key, indices.data(), bits.data());
      part.indices.insert(part.indices.end(), indices.begin(), indices.begin() + count.greater);
      part.bits.insert(part.bits.end(), bits.begin(), bits.begin() + count.greater);
      part.ties += count.ties;
      if (total.fetch_add(count.greater, std::memory_order_relaxed) + count.greater > cap) {
        too_many.store(true, std::memory_order_relaxed);
      }
    }
  });
  return !too_many.load();
}

void select_at_least(std::span<const float> x, uint32_t key, int threads,
                     std::vector<ChunkCandidates>& parts, Selection& out, float* copy) {
  collect_above(x, key - 1, std::numeric_limits<size_t>::max(), threads, parts, copy);
  out.indices.clear();
  out.values.clear();
  out.indices.reserve(total_candidates(parts));
  out.values.reserve(total_candidates(parts));
  for (const auto& part : parts) {
    out.indices.insert(out.indices.end(), part.indices.begin(), part.indices.end());
    for (uint32_t bits : part.bits) out.values.push_back(from_bits(bits));
  }
}

// Positions are computed (and prefetched) a batch ahead of the loads: each load is a cache
// miss, and interleaved with the position arithmetic too few of them would be in flight.
void TopKSelector::draw_sample(std::span<const float> x, size_t s, const CounterRng& rng) {
  constexpr size_t kBatch = 256;
  sample_.resize(s);
  Strata::Cursor cursor(Strata(x.size(), s), 0);
  uint32_t position[kBatch];
  for (size_t j0 = 0; j0 < s; j0 += kBatch) {
    const size_t m = std::min(kBatch, s - j0);
    for (size_t t = 0; t < m; ++t, cursor.next()) {
      position[t] = static_cast<uint32_t>(stratum_pick(rng, j0 + t, cursor.lo(), cursor.size()));
      __builtin_prefetch(&x[position[t]]);
    }
    for (size_t t = 0; t < m; ++t) sample_[j0 + t] = magnitude_key(x[position[t]]);
  }
}

void TopKSelector::select(std::span<const float> x, size_t k, size_t sample_count,
                          const CounterRng& rng, int threads, Selection& out, float* copy) {
  const size_t n = x.size();
  out.indices.clear();
  out.values.clear();
  k = std::min(k, n);
  if (copy != nullptr && (k == 0 || k == n)) {  // no filtering pass to copy on the way
    for_chunks(n, threads, [&](size_t b, size_t e, size_t) {
      std::memcpy(copy + b, x.data() + b, 4 * (e - b));
    });
  }
  if (k == 0) return;
  if (k == n) {
    out.indices.resize(n);
    std::iota(out.indices.begin(), out.indices.end(), uint32_t{0});
    out.values.assign(x.begin(), x.end());
    return;
  }
  // One magnitude from each of s equal strata: spread over the tensor, immune to periodic
  // structure that a fixed stride would alias with.
  const size_t s = std::clamp<size_t>(sample_count, 1, n);
  draw_sample(x, s, rng);
  // The k-th largest of n sits near rank k*s/n of the sample. Aim three standard deviations
  // (of a binomial count) lower, so one pass almost always finds at least k candidates while
  // collecting only a few percent more than k.
  const double expect = static_cast<double>(k) * static_cast<double>(s) / static_cast<double>(n);
  size_t rank = static_cast<size_t>(std::ceil(expect + 3.0 * std::sqrt(expect))) + 2;
  for (int attempt = 0; attempt < 2 && rank <= s; ++attempt, rank *= 4) {
    std::nth_element(sample_.begin(), sample_.begin() + static_cast<std::ptrdiff_t>(s - rank),
                     sample_.end());
    const uint32_t key = sample_[s - rank];
    const double expected = static_cast<double>(rank) * static_cast<double>(n) / static_cast<double>(s);
    const size_t cap = std::min(n, std::max(static_cast<size_t>(2 * expected), k + 4096));
    const Outcome outcome = try_threshold(x, k, key, cap, threads, out, copy);
    copy = nullptr;  // the first pass copied everything
    if (outcome == Outcome::kDone) return;
    if (outcome == Outcome::kTooMany) break;  // a lower threshold would only find more
  }
  // The sample misled us: key 0 takes every non-zero element as a candidate and zeros as
  // ties, which always holds the answer.
  try_threshold(x, k, 0, n, threads, out, copy);
}

TopKSelector::Outcome TopKSelector::try_threshold(std::span<const float> x, size_t k,
                                                  uint32_t key, size_t cap, int threads,
                                                  Selection& out, float* copy) {
  if (!collect_above(x, key, cap, threads, parts_, copy)) return Outcome::kTooMany;
  size_t above = 0, ties = 0;
  for (const auto& part : parts_) {
    above += part.indices.size();
    ties += part.ties;
  }
  if (above >= k) {
    finish_above(k, above, out);
  } else if (above + ties >= k) {
    finish_with_ties(x, k, key, out);
  } else {
    return Outcome::kTooFew;
  }
  return Outcome::kDone;
}

// The k-th largest key T lies among the candidates: take every candidate above T and the
// lowest-index ones equal to T.
void TopKSelector::finish_above(size_t k, size_t candidates, Selection& out) {
  keys_.resize(candidates);
  size_t m = 0;
  for (const auto& part : parts_) {
    for (uint32_t bits : part.bits) keys_[m++] = magnitude_key(bits);
  }
  const auto kth = keys_.begin() + static_cast<std::ptrdiff_t>(candidates - k);
  std::nth_element(keys_.begin(), kth, keys_.end());
  const uint32_t t = *kth;
  // After nth_element nothing before kth exceeds t.
  const auto greater = static_cast<size_t>(std::count_if(kth, keys_.end(), [t](uint32_t v) { return v > t; }));
  size_t ties_left = k - greater;
  out.indices.resize(k + 1);  // one slot of slack for the branch-free write
  out.values.resize(k + 1);
  m = 0;
  for (const auto& part : parts_) {
    for (size_t j = 0; j < part.indices.size(); ++j) {
      const uint32_t key = magnitude_key(part.bits[j]);
      const bool tie = key == t;
      const bool take = key > t || (tie && ties_left != 0);
      ties_left -= tie && take;
      out.indices[m] = part.indices[j];
      out.values[m] = from_bits(part.bits[j]);
      m += take;
    }
  }
  out.indices.resize(k);
  out.values.resize(k);
}

// Every candidate (all keys above `key`) is in, and the rest are the lowest-index elements
// whose key equals `key`: find them with a scan that stops as soon as it has enough, then
// merge the two ascending lists.
void TopKSelector::finish_with_ties(std::span<const float> x, size_t k, uint32_t key,
                                    Selection& out) {
  size_t above = total_candidates(parts_);
  const size_t need = k - above;
  ties_.clear();
  for (size_t i = 0; i < x.size() && ties_.size() < need; ++i) {
    if (magnitude_key(x[i]) == key) ties_.push_back(static_cast<uint32_t>(i));
  }
  out.indices.resize(k);
  out.values.resize(k);
  size_t m = 0, t = 0;
  for (const auto& part : parts_) {
    for (size_t j = 0; j < part.indices.size(); ++j) {
      for (; t < need && ties_[t] < part.indices[j]; ++t, ++m) {
        out.indices[m] = ties_[t];
        out.values[m] = x[ties_[t]];
      }
      out.indices[m] = part.indices[j];
      out.values[m] = from_bits(part.bits[j]);
      ++m;
    }
  }
  for (; t < need; ++t, ++m) {
    out.indices[m] = ties_[t];
    out.values[m] = x[ties_[t]];
  }
}

}  // namespace gradcomp::sparse
