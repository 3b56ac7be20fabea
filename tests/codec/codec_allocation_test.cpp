// A step of a codec allocates nothing once warm: encoding (with error feedback's residual),
// every round a route runs, and decoding, with the frames and sums a route keeps from one step
// to the next. A step that allocates puts blocks at new places of its thread's malloc arena
// after every plan change, and that is what made a long run's resident memory creep
// (docs/soak.md). Two ranks' codecs run in this process, on one thread (threads = 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <memory>
#include <string>
#include <vector>

#include "gradcomp/codec.h"
#include "support/codec_testing.h"
#include "support/counting_new.h"

namespace gradcomp {
namespace {

constexpr uint32_t kWorld = 2;
constexpr size_t kElements = 64 * 96;  // a 64 x 96 matrix (PowerSGD's layout)

// What a route keeps for one bucket: each rank's codec, gradient, residual and frame, and the
// sum it decodes into.
struct Bucket {
  explicit Bucket(const std::string& spec) {
    const std::vector<TensorShape> layout{{kElements, {64, 96}}};
    for (uint32_t r = 0; r < kWorld; ++r) {
      codecs.push_back(make_codec(spec));
      codecs[r]->set_layout(layout);
      inputs.push_back(testing::gradient(kElements, r + 1));
      residuals.emplace_back(kElements, 0.0f);
      frames.emplace_back();
    }
    traits = codecs[0]->traits();
    size_t bytes = codecs[0]->max_frame_bytes(kElements);
    for (int round = 0; round + 1 < traits.rounds; ++round) {
      bytes = std::max(bytes, codecs[0]->max_round_bytes(round, kElements));
    }
    for (auto& f : frames) f.resize(bytes);
    reduced.resize(bytes);
    sum.resize(kElements);
  }

  Context context(uint32_t rank) const {
    Context c;
    c.rank = rank;
    c.world_size = kWorld;
    c.step = step;
    c.threads = 1;
    return c;
  }

  // One exchange, as the allreduce route (summable codecs) or the allgather route runs it.
  void run_step() {
    for (int round = 0; round + 1 < traits.rounds; ++round) {
      size_t size = 0;
      for (uint32_t r = 0; r < kWorld; ++r) {
        size = codecs[r]->encode_round(round, inputs[r], frames[r], context(r));
      }
      reduce_all(size, codecs[0]->round_op(round), DType::kF32);
      for (uint32_t r = 0; r < kWorld; ++r) {
        codecs[r]->absorb_round(round, std::span(reduced).first(size), context(r));
      }
    }
    std::fill(sum.begin(), sum.end(), 0.0f);
    size_t size = 0;
    for (uint32_t r = 0; r < kWorld; ++r) {
      size = codecs[r]->encode(inputs[r], frames[r], context(r), residuals[r]);
      if (!traits.summable) {
        codecs[0]->decode_accumulate(std::span(frames[r]).first(size), sum, context(0));
      }
    }
    if (traits.summable) {
      reduce_all(size, ReduceOp::kSum, traits.payload_type);
      if (traits.rounds > 1) {
        for (uint32_t r = 0; r < kWorld; ++r) {
          codecs[r]->absorb_round(traits.rounds - 1, std::span(reduced).first(size), context(r));
        }
      }
      codecs[0]->decode_accumulate(std::span(reduced).first(size), sum, context(0));
    }
    codecs[0]->finalize(sum, kWorld);
    ++step;
  }

  // reduced = the sum over ranks of frames[r] (their first `size` bytes).
  void reduce_all(size_t size, ReduceOp op, DType type) {
    std::copy(frames[0].begin(), frames[0].begin() + static_cast<std::ptrdiff_t>(size),
              reduced.begin());
    for (uint32_t r = 1; r < kWorld; ++r) {
      reduce_frame_into(std::span(reduced).first(size), std::span(frames[r]).first(size), type, op);
    }
  }

  std::vector<std::unique_ptr<Codec>> codecs;
  std::vector<std::vector<float>> inputs, residuals;
  std::vector<std::vector<std::byte>> frames;
  std::vector<std::byte> reduced;
  std::vector<float> sum;
  CodecTraits traits;
  uint64_t step = 0;
};

class CodecAllocation : public ::testing::TestWithParam<std::string> {};

TEST_P(CodecAllocation, AStepAllocatesNothingOnceWarm) {
  Bucket bucket(GetParam());
  // The first steps size what the codec keeps; the sparsifiers' candidate buffers grow to the
  // most candidates a step has had (it depends on the step's sample), then stay.
  for (int i = 0; i < 6; ++i) bucket.run_step();
  const long before = g_allocations;
  bucket.run_step();
  bucket.run_step();
  EXPECT_EQ(g_allocations - before, 0) << GetParam() << ": allocations in two steps";
}

// Every codec of the soak's rotation (bench/soak), and the codecs recommended by default.
INSTANTIATE_TEST_SUITE_P(Codecs, CodecAllocation,
                         ::testing::Values("none", "fp16", "bf16", "qsgd:levels=15,block=512",
                                           "qsgd:block=256", "powersgd:rank=4", "dither",
                                           "natural", "intq:bits=8", "topk:ratio=0.01",
                                           "randomk:ratio=0.01", "dgc:ratio=0.01"),
                         [](const auto& info) {
                           std::string name;
                           for (char c : info.param) name += std::isalnum(c) ? c : '_';
                           return name;
                         });

}  // namespace
}  // namespace gradcomp
