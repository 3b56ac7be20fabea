// The Codec interface: a float32 span <-> a self-describing frame (see frame.h).
//
// Encoding writes one frame. Decoding *accumulates* a frame into a float32 sum buffer, so a
// route that receives W frames adds them one after another with no scratch copy; finalize()
// then turns the sum of W decoded frames into the aggregate (the mean, or a majority vote).
//
// Codecs that need communication between phases (PowerSGD: P then Q; intq: agree on a max,
// then quantize) declare rounds() > 1. A route drives them as:
//   for r in 0 .. rounds-2:  f = encode_round(r, x); allreduce f with round_op(r);
//                            absorb_round(r, reduced f)
//   last round: encode(x) -> frame; allreduce it (the last round's frames are summable);
//               absorb_round(rounds-1, reduced frame)   (e.g. PowerSGD's warm start)
//               decode_accumulate(reduced frame) -> sum; finalize(sum, W)
// with the same input x in every round. Frames of rounds before the last carry float32
// payloads. Single-round codecs never see absorb_round; decode is a pure function of the
// frame for them.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradcomp/dtype.h"
#include "gradcomp/frame.h"

namespace gradcomp {

// Wire identifiers; stable across versions (they are written into every frame).
enum class CodecId : uint8_t {
  kNone = 1,
  kFp16 = 2,
  kBf16 = 3,
  kQsgd = 4,
  kTernGrad = 5,
  kNatural = 6,
  kDither = 7,
  kSignSgd = 8,
  kEfSignSgd = 9,
  kSignum = 10,
  kOneBit = 11,
  kTopK = 12,
  kRandomK = 13,
  kDgc = 14,
  kThreshold = 15,
  kPowerSgd = 16,
  kIntQ = 17,
};

// How finalize() turns the sum of W decoded frames into the aggregate.
enum class Aggregation : uint8_t { kMean, kMajorityVote };


struct CodecTraits {
  // Payloads of frames encoded on different ranks add element-wise (as payload_type) into a
  // valid frame of their sum, so an allreduce can carry them.
  bool summable = false;
  DType payload_type = DType::kNone;
  // Encoding a slice of the input is meaningful on its own (the two-way route encodes W shards).
  bool shardable = true;
  // All ranks must use the same seed: the frame relies on randomness they share.
  bool shared_randomness = false;
  // Phases with communication between them; > 1 needs an allreduce route.
  int rounds = 1;
  // Nominal wire bits per input element, indices and scales included, for large n.
  double bits_per_element = 32;
  // The fraction of the elements a frame carries (a sparsifier's ratio; 1 for a dense codec, and
  // where it depends on the data). Under error feedback an element left behind waits about
  // 1 / kept_fraction steps for its turn, so the memory takes that long to reach its steady size.
  double kept_fraction = 1;
  // E[decode(encode(x))] == x.
  bool unbiased = true;
  Aggregation aggregation = Aggregation::kMean;
  // NaN and Inf in the input survive a payload sum by themselves (the payload holds the values,
  // or values computed from them), so an allreduce route need not OR the header's non-finite
  // flag across ranks. False for codecs that signal them only through the flag.
  bool payload_carries_nonfinite = false;
  // encode() always returns max_frame_bytes(n): every rank knows every frame's size before the
  // exchange, so the allgather and two-way routes send no sizes first (one collective, and its
  // round trips, fewer per bucket). False where the count depends on the data or the step.
  bool fixed_frame_size = true;
  // The codec keeps state across steps (save_state is not empty after a step: Signum's
  // momentum, PowerSGD's warm start), which discard() must take back when a step is skipped.
  bool stateful = false;
  // The codec compresses each tensor of the bucket on its own when set_layout gives their
  // shapes (powersgd); a front end that fuses tensors itself then passes them one by one.
  bool uses_layout = false;
};

// One tensor of a bucket as a codec may see it: its element count and, when known, its shape
// (outermost dimension first; empty: unknown). A bucket is its tensors fused in this order.
struct TensorShape {
  size_t elements = 0;
  std::vector<size_t> dims;

  bool operator==(const TensorShape&) const = default;
};

// Where and when a codec call happens; keys the counter-based randomness.
struct Context {
  uint64_t seed = 0;
  uint64_t bucket = 0;
  uint64_t step = 0;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  int threads = 1;  // worker threads a codec may use; results never depend on it
};

class Codec {
 public:
  virtual ~Codec() = default;

  virtual CodecId id() const = 0;
  // The canonical spec, every parameter spelled out: "qsgd:levels=16,bucket=0".
  virtual std::string spec() const = 0;
  virtual CodecTraits traits() const = 0;

  // The tensors the bucket is made of (element counts summing to the bucket's), given once
  // before the first encode; routes pass the plan's shapes. A codec that compresses each
  // tensor on its own (powersgd: every tensor of two or more dimensions its own matrix) uses
  // it, and then refuses any other element count; the others ignore it.
  virtual void set_layout(std::span<const TensorShape> /*tensors*/) {}

  // An upper bound on the frame size (header included) for n elements in the last round.
  virtual size_t max_frame_bytes(size_t n) const = 0;

  // Encodes `input` into `out` (at least max_frame_bytes(input.size()) long) and returns the
  // frame's size. When `residual` is not empty (it has input.size() elements and may alias
  // input) it receives input - decode(frame), computed in the same pass: error feedback's
  // memory. For multi-round codecs this is the last round.
  virtual size_t encode(std::span<const float> input, std::span<std::byte> out,
                        const Context& ctx, std::span<float> residual = {}) = 0;

  // Adds the decoded frame into `sum` (sum.size() must equal the frame's element count).
  // Throws FrameError before reading out of bounds on any malformed frame.
  virtual void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                                 const Context& ctx) const = 0;

  // decode_accumulate into zeros, in one pass: `out` receives 0 + each decoded value (so a -0
  // becomes +0, exactly as the accumulation gives), whatever it held. The default zeroes
  // `out` and accumulates; a dense codec overrides it to write each element once.
  virtual void decode_into(std::span<const std::byte> frame, std::span<float> out,
                           const Context& ctx) const;

  // Turns the sum of `count` decoded frames into the aggregate: the mean by default.
  virtual void finalize(std::span<float> sum, uint32_t count) const;

  // Multi-round codecs (rounds > 1) override these: round_op, max_round_bytes and
  // encode_round for rounds 0 .. rounds-2, absorb_round for every round.
  virtual ReduceOp round_op(int round) const;
  virtual size_t max_round_bytes(int round, size_t n) const;
  virtual size_t encode_round(int round, std::span<const float> input,
                              std::span<std::byte> out, const Context& ctx);
  virtual void absorb_round(int round, std::span<const std::byte> reduced,
                            const Context& ctx);

  // Codec state carried across steps (PowerSGD's warm-start Q, Signum's momentum), for
  // checkpoints. Stateless codecs save nothing.
  virtual std::vector<std::byte> save_state() const { return {}; }
  virtual void load_state(std::span<const std::byte> state);

  // The step's aggregate was not finite (every rank skips the step together): puts the state
  // back exactly as it was before the step (its first encode_round or encode), so save_state()
  // gives the bytes it gave then. Called after the step's decode, at most once per step; a
  // stateful codec throws Error otherwise. Stateless codecs have nothing to take back.
  virtual void discard() {}

  // The frame header fields this codec writes: id, parameter hash, element count.
  FrameExpectation expectation(uint64_t elements, uint8_t round = 0) const;
  const char* name() const;
  uint32_t param_hash() const;

 private:
  // fnv1a32(spec()) with bit 32 set once computed: spec() formats a string, and every frame of
  // every step carries the hash, while a codec's parameters never change after construction.
  mutable std::atomic<uint64_t> param_hash_{0};
};

// Builds a codec from a spec string ("topk:ratio=0.01"). Throws SpecError naming the codec,
// the parameter and what is allowed; an unknown name lists the available codecs.
std::unique_ptr<Codec> make_codec(const std::string& spec);
// The names make_codec accepts, in documentation order.
const std::vector<std::string>& codec_names();
// The name of a codec id ("topk"), or "unknown".
const char* codec_name(CodecId id);

// Adds the payload of frame `src` into frame `dst` as a transport's allreduce would
// (element-wise, as the codec's payload_type, with `op`), and adds the summands. Both frames
// must be from the same codec, round and parameters, with equal aux. This is the reference
// for routes and tests; routes reduce payloads with their transport directly.
void reduce_frame_into(std::span<std::byte> dst, std::span<const std::byte> src, DType type,
                       ReduceOp op);

}  // namespace gradcomp
