// What the routes share: codec contexts and randomness keys, the feedback step and its
// rollback, the header fix after a transport summed payloads, u64 size arrays, and the
// versioned route state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "common/buffer.h"
#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/feedback.h"
#include "gradcomp/frame.h"
#include "gradcomp/random.h"
#include "route/route.h"

namespace gradcomp::route {

// The sum of the frames laid end to end in `frames` (frame r of counts[r] bytes, from rank r)
// into `out`: the first is decoded over what `out` holds (Codec::decode_into: no zeroing pass),
// the others accumulate. `context_of(r)` is the Context frame r was encoded with.
template <class ContextOf>
void decode_sum(const Codec& codec, std::span<const std::byte> frames,
                std::span<const size_t> counts, std::span<float> out, ContextOf context_of) {
  size_t at = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    const auto frame = frames.subspan(at, counts[r]);
    if (r == 0) {
      codec.decode_into(frame, out, context_of(static_cast<uint32_t>(r)));
    } else {
      codec.decode_accumulate(frame, out, context_of(static_cast<uint32_t>(r)));
    }
    at += counts[r];
  }
}

// The Context of a codec call on this rank. `key` goes into Context::bucket: the bucket id, or
// a key derived from it (shard_key) when one bucket encodes several independent streams.
inline Context codec_context(const RouteEnv& env, uint64_t key, const StepState& step,
                             uint32_t rank, uint32_t world) {
  return {.seed = env.seed, .bucket = key, .step = step.step, .rank = rank,
          .world_size = world, .threads = env.threads};
}

// The state a route keeps across steps (its feedbacks and stateful codecs) and its rollback.
// When the aggregate decode wrote holds NaN or Inf, every rank sees it (the aggregate is the
// same bits everywhere) and a loss scaler skips the step on every rank, so every part of that
// state goes back to what it was before the step: one overflow must not poison later steps.
// A route without state never scans its output.
class StepKeeper {
 public:
  StepKeeper(std::vector<Feedback*> feedbacks, std::vector<Codec*> codecs);

  // The feedback's view of `step`. The previous learning rate and loss scale are those of the
  // last step this route kept (its memory was accumulated under them), not those of a step it
  // rolled back; the engine's values until this route has kept a step.
  StepInfo info(const StepState& step, uint32_t world) const;
  bool stateful() const { return stateful_; }
  // Keeps the step (its learning rate and loss scale become the memory's), or rolls every
  // feedback and codec back to what they were before it.
  void settle(bool keep, const StepState& step);
  // After load_state: the loaded memory's step is the engine's previous one.
  void forget() { kept_ = false; }
  // The loss scale the memory is in: that of the last step kept; 0 when unknown (nothing kept
  // since construction or load_state).
  double memory_scale() const { return kept_ ? kept_scale_ : 0.0; }

 private:
  std::vector<Feedback*> feedbacks_;
  std::vector<Codec*> codecs_;
  bool stateful_;
  bool kept_ = false;  // a step was kept since construction or load_state
  double kept_lr_ = 0;
  double kept_scale_ = 0;
};

// True when no element of `x` is NaN or Inf (one read pass, no early exit).
bool all_finite(std::span<const float> x);

// all_finite and the sum of squares (in float lanes, then double) in the same read pass: the
// norm of a mean for compression="auto"'s watch, or of a feedback's memory.
struct Scan {
  bool finite = true;
  double sum_of_squares = 0;  // 0 unless asked for
};
Scan scan(std::span<const float> x);

// The engine's one pass over a decoded bucket (Route::decode_unscaled): writes the mean,
// (0 + sum[i]) * factor, into `mean` (sum[i] itself when the factor is 1; `mean` may be `sum`,
// and then a factor of 1 writes nothing), and returns what scan() would of the mean written
// (its sum of squares only when `squares`). Reads the bucket once where decode's finalize, a
// check and a copy read it three times.
Scan write_mean(std::span<const float> sum, std::span<float> mean, float factor, bool squares);

// The factor that turns a sum over `count` ranks into their mean (Codec::finalize's).
inline float mean_factor(uint32_t count) {
  return count > 1 ? 1.0f / static_cast<float>(count) : 1.0f;
}

// Turns a sum into the mean in place: (0 + x) * factor, nothing when the factor is 1 (a route's
// decode is its decode_unscaled and this).
void apply_factor(std::span<float> x, float factor);

// The randomness key of shard `shard` of bucket `bucket`, worker or server side (two-way route):
// every stream gets its own key, so the W worker encodes and the server encode of one bucket
// never draw correlated numbers, and shared randomness (random-k's indices) still agrees on
// every rank that encodes or decodes the same shard.
inline uint64_t shard_key(uint64_t bucket, uint32_t shard, bool server) {
  return mix64(mix64(bucket) ^ ((uint64_t{shard} << 1) | (server ? 1u : 0u)));
}

// Element range [begin, end) of shard s of n elements in W shards: contiguous, deterministic,
// sizes differ by at most one.
struct Range {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
};
inline Range shard_range(size_t n, uint32_t shard, uint32_t world) {
  // floor(n * s / W) without overflow: n = q W + r, so n s / W = q s + r s / W, r s < W^2.
  const size_t q = n / world, r = n % world;
  const auto at = [&](uint32_t s) { return q * s + r * s / world; };
  return {at(shard), at(shard + 1)};
}

// After a transport summed the payloads of W frames, the header is still this rank's own: it
// becomes the header of the sum (W summands, the non-finite flag of any rank), checksum fixed.
inline void finish_summed_header(std::span<std::byte> frame, uint32_t summands, bool non_finite) {
  FrameHeader h = read_frame_header(frame);
  h.summands = summands;
  h.flags = static_cast<uint8_t>((h.flags & ~kFlagNonFinite) | (non_finite ? kFlagNonFinite : 0));
  write_frame_header(h, frame);
}

inline bool frame_non_finite(std::span<const std::byte> frame) {
  return (read_frame_header(frame).flags & kFlagNonFinite) != 0;
}

// u64 size arrays as bytes (the size exchanges are 8 bytes per rank).
inline std::span<const std::byte> bytes_of(const std::vector<uint64_t>& v) {
  return std::as_bytes(std::span(v));
}
inline std::span<std::byte> bytes_of(std::vector<uint64_t>& v) {
  return std::as_writable_bytes(std::span(v));
}

// A frame size received from a peer, checked against the largest frame the codec can write:
// a corrupted or foreign size must not make us read past our buffers.
size_t checked_size(uint64_t size, size_t max_bytes, int peer, const char* what);

// A frame this rank encoded with a codec of fixed frame size (CodecTraits::fixed_frame_size):
// its size must be max_bytes, since peers receive that many bytes without being told. Returns
// it; throws Error naming the codec otherwise (a codec breaking its own declaration).
size_t checked_fixed_size(const Codec& codec, size_t bytes, size_t max_bytes);

// The versioned state of a route: "GCRS", u32 version, u32 FNV-1a of the route name, u64
// elements, u32 world size (the ranks the route's own codec sees), u32 part count, then per part
// a u64 length and its bytes. Parts are the codec and feedback states, in an order each route
// fixes. The shape is checked on load, so a state cannot land in a bucket of another size.
struct StateShape {
  size_t elements = 0;
  uint32_t world = 1;
};
std::vector<std::byte> save_parts(std::string_view route, const StateShape& shape,
                                  const std::vector<std::vector<std::byte>>& parts);
// Checks magic, version, route, shape and part count (`at_least`: that many or more, for a
// route whose first parts tell how many follow); throws Error saying what does not match.
std::vector<std::span<const std::byte>> load_parts(std::string_view route,
                                                   std::span<const std::byte> state,
                                                   const StateShape& shape,
                                                   size_t expected_parts, bool at_least = false);

// Throws Error unless a gradient or output span has the bucket's length.
void check_length(const char* route, size_t bucket, const char* what, size_t size, size_t n);

// intra=fp16 of a route over nodes: `x` as float16 into `out` (its size), as phase "encode".
void encode_half(std::span<const float> x, std::span<uint16_t> out, const Phases& p);

}  // namespace gradcomp::route
