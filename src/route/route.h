// Route: how one bucket's frames travel between ranks, one class per pattern (route/*.cpp):
//   allreduce     summable codecs: every round's frames are summed by the transport
//   allgather     any codec: every rank decodes all W frames in rank order
//   twoway        BytePS-Compress with co-located servers: W shards, alltoallv, each rank
//                 reduces its shard, applies server-side feedback, re-encodes, allgatherv
//   hierarchical  reduce inside the node (none or fp16), an inner route among node leaders,
//                 broadcast back inside the node
//   sharded       reduce-scatter inside the node, an inner route per shard across nodes (every
//                 rank runs one), allgather inside the node
//   servers       BytePS-Compress with dedicated parameter servers: S shards to S server
//                 processes over the server link, their re-encoded frames back
// A route object belongs to one bucket and keeps its codec, feedback and buffers across steps
// (buffers are sized once, so memory does not grow). The engine drives it in three stages,
// each on its own thread, so buckets pipeline:
//   encode(bucket) compensate + first encoding (the caller's thread or the encoder thread)
//   exchange()     every collective and the computation between them (the exchange thread)
//   decode(out)    the aggregate, the mean over ranks, into `out` (the decoder thread)
// Every rank ends with bit-identical output: all ranks decode the same bytes in the same order.
// When the mean of any bucket of a step holds NaN or Inf (an overflow: a loss scaler skips the
// whole step), the engine settles the step as not kept, and every stateful route rolls its
// feedbacks and codecs back to where they were before the step, on every rank alike
// (settle(); route/frames.h, StepKeeper). Without stateful routes the engine pays nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/feedback.h"
#include "gradcomp/option.h"
#include "gradcomp/timeline.h"
#include "gradcomp/transport.h"

namespace gradcomp {

namespace route {
class ServerLink;
}

// The transports a route may use.
struct RouteEnv {
  Transport* world = nullptr;
  Transport* intra = nullptr;    // over nodes: the ranks of this node (rank 0 is the leader)
  Transport* leaders = nullptr;  // hierarchical: one rank per node; nullptr on non-leaders
  Transport* cross = nullptr;    // sharded: this local rank's peers, one per node (same index)
  route::ServerLink* servers = nullptr;  // route servers: the link to the parameter servers
  uint64_t seed = 0;             // the job's seed: Context::seed of every codec call
  int threads = 1;               // threads a codec call may use
};

// What changes from step to step.
struct StepState {
  uint64_t step = 0;
  double lr = 0;
  double prev_lr = 0;
  double scale = 1;       // the loss scale this step's gradients carry (Engine::set_loss_scale)
  double prev_scale = 1;  // that of the previous step (0: unknown, e.g. after load_state)
};

// Times phases into the timeline and turns failures into errors that name the bucket and the
// phase. One per bucket; used from the thread running the stage.
class Phases {
 public:
  Phases(size_t bucket, Milliseconds timeout, Timeline* timeline)
      : bucket_(bucket), timeout_(timeout), timeline_(timeline) {}

  // Waits for `work` (issued at `issued`) and records [issued, now) as `phase`. Rethrows a
  // CommError or TimeoutError as "bucket B, phase P: ...".
  void wait(const WorkPtr& work, const char* phase, Clock::time_point issued) const;
  // Runs `f` as computation phase `phase` (encode, decode, ...) and records it.
  template <class F>
  void run(const char* phase, F&& f) const {
    const auto start = Clock::now();
    f();
    record(phase, start, Clock::now());
  }
  void record(const char* phase, Clock::time_point start, Clock::time_point end) const;

  size_t bucket() const { return bucket_; }
  Milliseconds timeout() const { return timeout_; }

 private:
  size_t bucket_;
  Milliseconds timeout_;
  Timeline* timeline_;
};

class Route {
 public:
  virtual ~Route() = default;

  // Before stage 1, optional: whether this step's gradient may be handed over in parts as
  // backward produces them (take_part, `offset` in the bucket) instead of being copied into
  // the bucket's buffer: true for a route that compresses the whole bucket with a feedback that
  // compensates element by element (Feedback::in_parts). Then encode() does not read its
  // buffer's contents; the buffer still receives the mean at decode.
  virtual bool takes_parts(const StepState& /*step*/) const { return false; }
  virtual void take_part(size_t /*offset*/, std::span<const float> /*part*/,
                         const StepState& /*step*/) {
    throw Error("this route does not take a gradient in parts");
  }
  // Stage 1. `bucket` holds this rank's fused gradient of the bucket. The engine leaves that
  // memory alone until decode(out) of the same step, and `out` is the same memory: a route
  // may work in it in between (the uncompressed allreduce sums into it in place).
  virtual void encode(std::span<float> bucket, const StepState& step, const Phases& p) = 0;
  // Stage 2. Blocks until every collective of this bucket finished.
  virtual void exchange(const StepState& step, const Phases& p) = 0;
  // Stage 3. Writes the mean over ranks into `out` (the bucket's element count); rolls the
  // route's state back when it is not finite.
  virtual void decode(std::span<float> out, const StepState& step, const Phases& p) = 0;
  // Stage 3 as the engine runs it: decode(out) but for its last pass, the multiplication of
  // every element by the factor returned (1: nothing left to do), so that the engine fuses that
  // pass with its own over the mean (the finite check and the copy into the gradients): two
  // passes over the bucket fewer. A mean is the sum times the factor: (0 + sum) * factor.
  virtual float decode_unscaled(std::span<float> out, const StepState& step, const Phases& p) {
    decode(out, step, p);
    return 1.0f;
  }

  // Whether the route keeps state across steps (feedback memory, codec state such as PowerSGD's
  // warm start): the engine then settles every step as a whole.
  virtual bool stateful() const { return false; }
  // After every bucket of the step was decoded: keeps this step's state, or takes it back to
  // what it was before the step (keep false: the mean of some bucket of the step is not
  // finite, so a loss scaler skips the whole step). The engine decides from the means, which
  // are the same bits on every rank, so every rank decides alike.
  virtual void settle(bool /*keep*/, const StepState& /*step*/) {}

  // Adds into `into` (the bucket's elements) what this rank must hand over with a later
  // gradient so that a later mean delivers what the route holds on this rank and has not
  // delivered: its feedbacks' unsent memory (a co-located server's, scaled to count once in
  // the mean over ranks). Returns the loss scale that memory is in (0: unknown, or nothing
  // held). Between steps only; local (Engine::feedback_health reads it).
  virtual double carry(std::span<float> into) const = 0;
  // The route leaves the plan for good (Engine::set_plan): carry(), and what the route holds
  // beyond this rank (dedicated servers' memory, fetched and dropped there). Between steps, on
  // every rank in bucket order: it may be a collective.
  virtual double retire(std::span<float> into) { return carry(into); }
  // Between steps, on every rank in bucket order (a collective where it communicates): the
  // state the route keeps beyond this rank (dedicated servers') comes here, so that the next
  // save_state() holds it. Nothing for a route whose state is all on this rank.
  virtual void fetch_remote_state() {}

  // Bytes this rank handed to the transport for other ranks in the last step (all phases; the
  // frame of its own shard in an alltoall is not counted: it never leaves the rank).
  virtual size_t bytes_sent() const = 0;
  // Bytes of buffers and feedback state this route holds.
  virtual size_t memory_bytes() const = 0;
  // Codec and feedback state (worker and server side), for checkpoints. A route keeping state
  // beyond this rank throws Error unless fetch_remote_state() ran since its last step.
  virtual std::vector<std::byte> save_state() const = 0;
  virtual void load_state(std::span<const std::byte> state) = 0;
  // For undoing a load_state in this process: save_state(), but state beyond this rank that
  // was not fetched is left out (loading it leaves that state where it is).
  virtual std::vector<std::byte> save_undo_state() const { return save_state(); }
};

// Builds the route of `option` for bucket `bucket` of `elements` elements. Throws SpecError on
// a bad route spec, Error when the codec cannot travel this way (allreduce needs a summable
// codec, twoway a shardable single-round codec) or a transport the route needs is missing.
// `layout` lists the bucket's tensors when known (their elements sum to `elements`): codecs
// that compress each tensor on its own use it.
std::unique_ptr<Route> make_route(const Option& option, size_t bucket, size_t elements,
                                  const RouteEnv& env, std::span<const TensorShape> layout = {});
// The same for an option parsed already (parse_bucket_option, Plan::validate): nothing is
// parsed again.
std::unique_ptr<Route> make_route(const BucketOption& option, size_t bucket, size_t elements,
                                  const RouteEnv& env, std::span<const TensorShape> layout = {});

}  // namespace gradcomp
