// Counter-based randomness: every random number is a pure function of
// (seed, bucket, step, rank, stream, element index). No hidden state, so the same input and
// seed give the same bytes on any thread count, after a restart, and on every rank that
// shares the key.
#pragma once

#include <cstdint>

namespace gradcomp {

// SplitMix64 finaliser: a strong 64-bit mixer used to derive keys.
constexpr uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A 32-bit bijective mixer (low-bias xorshift-multiply), cheap enough to vectorise.
constexpr uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// One stream of random numbers indexed by a counter. Build it once per (key) and draw
// bits(i) for element i; draws for different i are independent of evaluation order.
class CounterRng {
 public:
  // Streams separate independent uses inside one codec call (e.g. rounding vs sampling).
  // Pass rank = kSharedRank for randomness all ranks must agree on (random-k indices).
  static constexpr uint32_t kSharedRank = 0xffffffffU;

  constexpr CounterRng(uint64_t seed, uint64_t bucket, uint64_t step, uint32_t rank,
                       uint32_t stream = 0) {
    uint64_t key = mix64(seed);
    key = mix64(key ^ bucket);
    key = mix64(key ^ step);
    key = mix64(key ^ ((uint64_t{rank} << 32) | stream));
    k0_ = static_cast<uint32_t>(key);
    k1_ = static_cast<uint32_t>(key >> 32);
  }

  // 32 random bits for counter i: a keyed permutation of i (two keyed mixing rounds).
  constexpr uint32_t bits(uint32_t i) const { return mix32(mix32(i ^ k0_) + k1_); }

  // Uniform float in [0, 1) with 24 random bits.
  constexpr float uniform(uint32_t i) const {
    return static_cast<float>(bits(i) >> 8) * 0x1.0p-24f;
  }

  // Uniform integer in [0, bound) (bound > 0), by multiply-shift (bias < bound / 2^32).
  constexpr uint32_t below(uint32_t i, uint32_t bound) const {
    return static_cast<uint32_t>((uint64_t{bits(i)} * bound) >> 32);
  }

 private:
  uint32_t k0_ = 0;
  uint32_t k1_ = 0;
};

}  // namespace gradcomp
