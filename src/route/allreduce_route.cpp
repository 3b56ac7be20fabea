// allreduce: summable codecs. The transport adds the payloads of every rank's frame, so each
// rank sends and receives one frame's payload per round, whatever W. Multi-round codecs run
// their earlier rounds here too (codec.h). The codec "none" without feedback skips framing:
// the float32 bucket is allreduced in place in the engine's own buffer (route.h lets a route
// work there until decode), so the engine adds one scaling pass to a raw allreduce.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "gradcomp/error.h"
#include "route/flat_route.h"

namespace gradcomp::route {
namespace {

constexpr const char* kAllreduceName = "allreduce";

class AllreduceRoute final : public CodedRoute {
 public:
  explicit AllreduceRoute(const RouteConfig& config);

  void encode(std::span<float> grad, const StepState& step, const Phases& p) override;
  void exchange(const StepState& step, const Phases& p) override;
  float decode_unscaled(std::span<float> out, const StepState& step, const Phases& p) override;
  size_t memory_bytes() const override;

 private:
  Context context(const StepState& step) const { return CodedRoute::context(step, rank_); }
  // Allreduces the payload of `frame` (its first `bytes` bytes) and waits.
  void reduce_payload(std::span<std::byte> frame, size_t bytes, DType type, ReduceOp op,
                      const char* phase, const Phases& p);
  void run_early_rounds(const StepState& step, const Phases& p);
  void reduce_last_round(const Phases& p);

  Codec& codec_;
  CodecTraits traits_;
  bool direct_;  // codec none, feedback none: the bucket itself is allreduced
  std::span<float> bucket_data_;  // the direct path: the engine's bucket buffer of this step

  // The compensated input of this step (multi-round codecs encode it once per round): the
  // feedback's buffer, or the engine's bucket buffer, which stays untouched until decode.
  std::span<const float> x_;
  Buffer<std::byte> round_frame_;  // frames of the rounds before the last
  Buffer<std::byte> frame_;        // the last round's frame, summed in place
  size_t round_bytes_ = 0;
  size_t frame_bytes_ = 0;
  int32_t non_finite_ = 0;  // OR-ed across ranks (as a max) when the payload cannot carry it
};

AllreduceRoute::AllreduceRoute(const RouteConfig& c)
    : CodedRoute(kAllreduceName, c),
      codec_(coder_.codec()),
      traits_(codec_.traits()),
      direct_(codec_.id() == CodecId::kNone && coder_.feedback().spec() == "none") {
  if (direct_) return;
  frame_.resize(codec_.max_frame_bytes(n_));
  size_t round_max = 0;
  for (int r = 0; r + 1 < traits_.rounds; ++r) {
    round_max = std::max(round_max, codec_.max_round_bytes(r, n_));
  }
  round_frame_.resize(round_max);
}

void AllreduceRoute::encode(std::span<float> grad, const StepState& step, const Phases& p) {
  start_step(grad);
  p.run("encode", [&] {
    if (direct_) {
      bucket_data_ = grad;
      return;
    }
    if (traits_.rounds == 1) {  // the whole encoding happens here; grad is read only now
      frame_bytes_ = coder_.encode(grad, frame_, context(step), step, world_size_);
      return;
    }
    x_ = coder_.compensate(grad, step, world_size_);
    round_bytes_ = codec_.encode_round(0, x_, round_frame_, context(step));
  });
}

void AllreduceRoute::reduce_payload(std::span<std::byte> frame, size_t bytes, DType type,
                                    ReduceOp op, const char* phase, const Phases& p) {
  const auto payload = frame.subspan(kFrameHeaderBytes, bytes - kFrameHeaderBytes);
  const auto issued = Clock::now();
  p.wait(world_.allreduce(payload, type, op), phase, issued);
  sent_ += payload.size();
}

void AllreduceRoute::run_early_rounds(const StepState& step, const Phases& p) {
  const Context ctx = context(step);
  for (int r = 0; r + 1 < traits_.rounds; ++r) {
    if (r > 0) p.run("encode", [&] { round_bytes_ = codec_.encode_round(r, x_, round_frame_, ctx); });
    const auto phase = r == 0 ? "round 0" : "round";
    reduce_payload(round_frame_, round_bytes_, DType::kF32, codec_.round_op(r), phase, p);
    const auto frame = std::span(round_frame_).first(round_bytes_);
    finish_summed_header(frame, world_size_, frame_non_finite(frame));
    p.run("absorb", [&] { codec_.absorb_round(r, frame, ctx); });
  }
  p.run("encode", [&] { frame_bytes_ = coder_.finish(x_, frame_, ctx); });
}

void AllreduceRoute::reduce_last_round(const Phases& p) {
  const auto frame = std::span(frame_).first(frame_bytes_);
  const auto payload = frame.subspan(kFrameHeaderBytes);
  // Both collectives in flight at once: the flag costs no extra round trip.
  const auto issued = Clock::now();
  const WorkPtr sum = world_.allreduce(payload, traits_.payload_type, ReduceOp::kSum);
  WorkPtr flag;
  if (!traits_.payload_carries_nonfinite) {
    non_finite_ = frame_non_finite(frame) ? 1 : 0;
    flag = world_.allreduce(std::as_writable_bytes(std::span(&non_finite_, 1)), DType::kI32,
                            ReduceOp::kMax);
    sent_ += sizeof non_finite_;
  }
  p.wait(sum, "allreduce", issued);
  if (flag) p.wait(flag, "non-finite flag", issued);
  sent_ += payload.size();
  const bool non_finite =
      traits_.payload_carries_nonfinite ? frame_non_finite(frame) : non_finite_ != 0;
  finish_summed_header(frame, world_size_, non_finite);
}

void AllreduceRoute::exchange(const StepState& step, const Phases& p) {
  if (direct_) {
    const auto issued = Clock::now();
    p.wait(world_.allreduce(bucket_data_), "allreduce", issued);
    sent_ += n_ * sizeof(float);
    return;
  }
  if (traits_.rounds > 1) run_early_rounds(step, p);
  reduce_last_round(p);
  if (traits_.rounds > 1) {  // e.g. PowerSGD keeps the aggregated Q as its warm start
    const auto frame = std::span<const std::byte>(frame_).first(frame_bytes_);
    p.run("absorb", [&] { codec_.absorb_round(traits_.rounds - 1, frame, context(step)); });
  }
}

float AllreduceRoute::decode_unscaled(std::span<float> out, const StepState& step,
                                      const Phases& p) {
  check_output(out);
  float factor = 1.0f;
  p.run("decode", [&] {
    if (direct_) {
      // The sum is where decode_accumulate into zeros would have left it, normally out itself
      // (route.h): the factor's pass, (0 + x) * factor, turns -0 into +0 as that would, so both
      // paths produce the same bits. One rank has no factor to leave; it gets the +0 here.
      const float* s = bucket_data_.data();
      if (s == out.data() && world_size_ > 1) {
        factor = mean_factor(world_size_);
        return;
      }
      const float inv = mean_factor(world_size_);
      for (size_t i = 0; i < n_; ++i) out[i] = (0.0f + s[i]) * inv;
      return;
    }
    codec_.decode_into(std::span(frame_).first(frame_bytes_), out, context(step));
    factor = finish_sum(out);
  });
  return factor;
}

size_t AllreduceRoute::memory_bytes() const {
  return round_frame_.size() + frame_.size() + coder_.memory_bytes();
}

}  // namespace

std::unique_ptr<Route> make_allreduce_route(const RouteConfig& config) {
  return std::make_unique<AllreduceRoute>(config);
}

}  // namespace gradcomp::route
