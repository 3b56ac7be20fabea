// Feedback: the per-bucket memory around a codec, composable with any codec.
//
// One step on one bucket:
//   p = fb.compensate(g, info);            // the vector to compress (g corrected by memory)
//   n = codec.encode(p, frame, ctx, fb.residual());   // residual <- p - D(C(p)), same pass
//   fb.commit();                            // e.g. momentum-factor masking
//   ... the route decodes the aggregate; when it holds NaN or Inf (a loss scaler skips the
//   step on every rank), fb.discard() puts the memory back as it was before compensate().
// Kinds: "none"; "ef" (error feedback: e <- p - D(C(p)), with optional decay and
// learning-rate-ratio correction); "dgc" (momentum correction, momentum-factor masking and
// local gradient clipping); "nesterov" (momentum before compression, optionally with ef).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace gradcomp {

// What a feedback needs to know about the current step.
struct StepInfo {
  uint64_t step = 0;
  double lr = 0;       // the learning rate of this step (0: unknown, no lr correction)
  double prev_lr = 0;  // the learning rate of the previous step (0: unknown)
  uint32_t world_size = 1;  // for DGC's local clipping threshold
  // The loss scale this step's gradient carries (a GradScaler's scale) and the one the memory
  // was accumulated under (0: unknown, no correction). When both are known and differ, every
  // feedback multiplies its memory by scale / prev_scale as it applies it, so the memory stays
  // in the units of the current gradient, as if it were kept unscaled.
  double scale = 1;
  double prev_scale = 1;
};

class Feedback {
 public:
  virtual ~Feedback() = default;

  // The canonical spec, every parameter spelled out: "ef:decay=1,lr_correction=false".
  virtual std::string spec() const = 0;

  // Returns the vector to compress for gradient `grad` (same length every step). The span
  // stays valid until the next call; it may be the feedback's own buffer.
  virtual std::span<const float> compensate(std::span<const float> grad,
                                            const StepInfo& info) = 0;

  // Compensation in parts, for the feedbacks whose compensated element i depends only on
  // grad[i] and their memory's element i (in_parts() true): the engine then hands a bucket's
  // gradient over tensor by tensor as backward produces them, with no copy into the bucket
  // first. begin_parts(n, info) once per step, compensate_part(offset, part) for disjoint parts
  // that cover [0, n) in any order, then end_parts() returns what compensate(grad, info) would
  // have returned for the whole gradient, bit for bit. The others throw an Error.
  virtual bool in_parts() const { return false; }
  virtual void begin_parts(size_t n, const StepInfo& info);
  virtual void compensate_part(size_t offset, std::span<const float> part);
  virtual std::span<const float> end_parts();
  // Where the codec writes input - decode(frame), or empty when this feedback keeps no
  // residual. Valid after compensate(); may alias the span compensate() returned.
  virtual std::span<float> residual() = 0;

  // Called after the codec encoded the compensated vector `sent` (the span compensate
  // returned, now overwritten by the residual where they alias).
  virtual void commit() {}

  // The step's aggregate was not finite (every rank skips the step together): puts the memory
  // back exactly as it was before the last compensate(), so save_state() gives the bytes it gave
  // then. Called after commit(), at most once per step; otherwise an Error. Feedbacks keep a
  // second set of buffers for this, so the rollback costs no pass over the data.
  virtual void discard() = 0;

  // Adds into `into` (as long as the vectors compensate() takes) what the memory holds of the
  // gradients and has not sent yet: error feedback's residual, DGC's accumulated velocity.
  // Handed over with a later gradient, it reaches the mean as this feedback would have sent it;
  // used when a plan change retires the feedback (Engine::set_plan). Momentum is not added (it
  // is a history of what was sent), nor anything while the memory is empty (never
  // compensated). Between steps only.
  virtual void add_unsent(std::span<float> into) const = 0;

  // False when the feedback keeps no memory at all (none): a route need not check the
  // aggregate for a rollback.
  virtual bool has_memory() const { return true; }

  // Bytes of the buffers this feedback holds, spares for discard() included.
  virtual size_t memory_bytes() const = 0;

  // The whole memory, for checkpoints; load_state(save_state()) restores it bit-exactly.
  virtual std::vector<std::byte> save_state() const = 0;
  virtual void load_state(std::span<const std::byte> state) = 0;
};

// Builds a feedback from a spec ("ef", "ef:decay=0.9", "dgc:momentum=0.9,clip=1").
// Throws SpecError naming the feedback, the parameter and what is allowed.
std::unique_ptr<Feedback> make_feedback(const std::string& spec);
const std::vector<std::string>& feedback_names();

}  // namespace gradcomp
