// One bucket of the plan as the engine runs it: where its tensors sit in the fused buffer,
// how many are still missing this step, its route, and how far each stage got.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "gradcomp/plan.h"
#include "route/frames.h"
#include "route/route.h"

namespace gradcomp {

// Where a registered tensor goes.
struct TensorSlot {
  size_t bucket = 0;
  size_t position = 0;  // among the bucket's tensors
  size_t offset = 0;  // in the bucket's fused buffer
  size_t elements = 0;
  bool ready = false;  // handed over in this step
};

inline constexpr uint64_t kNoStep = std::numeric_limits<uint64_t>::max();

class LiveBucket {
 public:
  // Builds the route and fills in the slots of this bucket's tensors.
  LiveBucket(const Plan& plan, size_t index, const BucketOption& option, const RouteEnv& env,
             std::vector<TensorSlot>& slots, Milliseconds timeout);

  // Takes a tensor's gradient: copies it into the fused buffer, or hands it to the route when
  // the route takes this step's gradient in parts (Route::take_part: compensated as it comes,
  // no copy); a bucket of one tensor uses the caller's memory directly and copies nothing.
  // Remembers where the result goes.
  void take(const TensorSlot& slot, std::span<float> grad, const StepState& step);
  // The fused gradient (stage 1 input), which is also where the mean goes (stage 3 output).
  std::span<float> buffer();
  // Writes the mean, the decoded sum in the fused buffer times `factor` (what
  // Route::decode_unscaled left), into the callers' tensors in one pass that also checks it
  // (route::write_mean; its sum of squares when `squares`).
  route::Scan give_back(float factor, bool squares);
  // Prepares the next step.
  void reset();

  // "bucket 3: 12 tensors, 4.2 MB, topk:ratio=0.01 / ef / allgather" (the timeline lane).
  std::string describe(const Plan& plan) const;
  size_t memory_bytes() const;

  size_t index;
  size_t elements = 0;
  size_t pending = 0;  // tensors not yet handed over this step
  std::unique_ptr<Route> route;
  Phases phases;
  uint64_t encoded_step = kNoStep;  // the last cycle each stage finished
  uint64_t exchanged_step = kNoStep;
  uint64_t decoded_step = kNoStep;
  bool finite = true;  // the last decoded mean holds no NaN or Inf
  double mean_sum_of_squares = 0;  // of the last mean measured (Engine::measure_mean_norms)
  Clock::time_point first_ready_at{};
  Clock::time_point complete_at{};

 private:
  size_t tensor_count_;
  Buffer<float> fused_;                     // empty for a bucket of one tensor
  std::vector<std::span<float>> targets_;   // per tensor of the bucket, in fusion order
  std::vector<size_t> offsets_;             // per tensor of the bucket
};

}  // namespace gradcomp
