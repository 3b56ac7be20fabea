// One compression side of a route: a codec, the feedback that compensates its input and keeps
// what it did not send, and the rollback of both (StepKeeper). A route holds one (worker side);
// the two-way route a second one for its server side.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "gradcomp/codec.h"
#include "gradcomp/feedback.h"
#include "route/frames.h"

namespace gradcomp::route {

class Coder {
 public:
  Coder(std::unique_ptr<Codec> codec, std::unique_ptr<Feedback> feedback);

  Codec& codec() const { return *codec_; }
  Feedback& feedback() const { return *feedback_; }

  // The feedback's compensated input of this step (`world` ranks take part in the mean): of
  // `grad`, or, when this step's gradient came in parts (take_part), of those parts (`grad`
  // is then not read).
  std::span<const float> compensate(std::span<const float> grad, const StepState& step,
                                    uint32_t world) {
    if (parts_step_ == step.step) {
      parts_step_ = kNoParts;
      return feedback_->end_parts();
    }
    return feedback_->compensate(grad, keeper_.info(step, world));
  }
  // Whether the feedback compensates in parts (Feedback::in_parts).
  bool takes_parts() const { return feedback_->in_parts(); }
  // A part of this step's gradient of `n` elements, at `offset`: compensated now, into the
  // feedback's buffer. The parts of a step cover the gradient before compensate() is called.
  void take_part(size_t n, size_t offset, std::span<const float> part, const StepState& step,
                 uint32_t world) {
    if (parts_step_ != step.step) {
      feedback_->begin_parts(n, keeper_.info(step, world));
      parts_step_ = step.step;
    }
    feedback_->compensate_part(offset, part);
  }
  // The last encoding of a step: `x` (from compensate) into `frame` with the residual fused,
  // then the feedback commits. Returns the frame's bytes.
  size_t finish(std::span<const float> x, std::span<std::byte> frame, const Context& ctx) const;
  // compensate + finish: a single-round encoding of the whole input.
  size_t encode(std::span<const float> grad, std::span<std::byte> frame, const Context& ctx,
                const StepState& step, uint32_t world) {
    return finish(compensate(grad, step, world), frame, ctx);
  }

  bool stateful() const { return keeper_.stateful(); }
  void settle(bool keep, const StepState& step) { keeper_.settle(keep, step); }
  // The loss scale of the memory (StepKeeper::memory_scale).
  double memory_scale() const { return keeper_.memory_scale(); }
  size_t memory_bytes() const { return feedback_->memory_bytes(); }

  // Codec state, then feedback state: the two parts of a route's saved state.
  std::vector<std::vector<std::byte>> save_state() const;
  void load_state(std::span<const std::byte> codec, std::span<const std::byte> feedback);

 private:
  static constexpr uint64_t kNoParts = ~uint64_t{0};

  std::unique_ptr<Codec> codec_;
  std::unique_ptr<Feedback> feedback_;
  StepKeeper keeper_;
  uint64_t parts_step_ = kNoParts;  // the step whose parts the feedback holds, uncompensated yet
};

// The worker side of the two-way routes (twoway, servers): the bucket, compensated once by
// `coder`'s feedback, encoded shard by shard into consecutive frames, each shard's residual
// going into the matching slice of the feedback's residual; then the feedback commits.
// `context_of(s)` is shard s's Context; frame s's size goes into bytes[s] (checked against
// max_frames[s] when the codec's frames have a fixed size: peers are not told it).
template <class ContextOf>
void encode_shards(Coder& coder, std::span<const float> grad, std::span<const Range> shards,
                   std::span<const size_t> max_frames, std::span<std::byte> frames,
                   const StepState& step, uint32_t world, ContextOf context_of,
                   std::span<size_t> bytes) {
  Codec& codec = coder.codec();
  const bool fixed = codec.traits().fixed_frame_size;
  const auto x = coder.compensate(grad, step, world);
  const auto residual = coder.feedback().residual();
  size_t at = 0;
  for (uint32_t s = 0; s < shards.size(); ++s) {
    const Range r = shards[s];
    const auto shard_residual = residual.empty() ? residual : residual.subspan(r.begin, r.size());
    const size_t b = codec.encode(x.subspan(r.begin, r.size()), frames.subspan(at), context_of(s),
                                  shard_residual);
    bytes[s] = fixed ? checked_fixed_size(codec, b, max_frames[s]) : b;
    at += b;
  }
  coder.feedback().commit();
}

// The servers' frames (frame s of sizes[s] bytes, consecutive, already the aggregate) decoded
// into their shards of `out`, which they cover.
template <class ContextOf, class SizeOf>
void decode_shards(const Codec& codec, std::span<const std::byte> frames,
                   std::span<const Range> shards, std::span<float> out, ContextOf context_of,
                   SizeOf size_of) {
  size_t at = 0;
  for (uint32_t s = 0; s < shards.size(); ++s) {
    const Range r = shards[s];
    const size_t bytes = size_of(s);
    codec.decode_into(frames.subspan(at, bytes), out.subspan(r.begin, r.size()), context_of(s));
    at += bytes;
  }
}

}  // namespace gradcomp::route
