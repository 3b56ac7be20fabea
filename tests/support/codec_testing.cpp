#include "support/codec_testing.h"

#include <cmath>
#include <memory>

#include "gradcomp/random.h"

namespace gradcomp::testing {

std::vector<float> gradient(size_t n, uint64_t seed, float scale) {
  const CounterRng rng(seed, 0, 0, 0, 7);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {  // Box-Muller from two counter draws
    const double u1 = (rng.bits(static_cast<uint32_t>(2 * i)) + 1.0) * 0x1.0p-32;
    const double u2 = rng.bits(static_cast<uint32_t>(2 * i + 1)) * 0x1.0p-32;
    x[i] = scale * static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  return x;
}

std::vector<std::byte> encode(Codec& codec, std::span<const float> input, const Context& ctx,
                              std::span<float> residual) {
  std::vector<std::byte> frame(codec.max_frame_bytes(input.size()));
  frame.resize(codec.encode(input, frame, ctx, residual));
  return frame;
}

std::vector<float> decode(const Codec& codec, std::span<const std::byte> frame, size_t n,
                          const Context& ctx) {
  std::vector<float> out(n, 0.0f);
  codec.decode_accumulate(frame, out, ctx);
  return out;
}

std::vector<float> roundtrip(Codec& codec, std::span<const float> input, const Context& ctx) {
  return decode(codec, encode(codec, input, ctx), input.size(), ctx);
}

std::vector<float> aggregate_allreduce(const std::string& spec,
                                       const std::vector<std::vector<float>>& inputs,
                                       Context ctx) {
  const auto world = static_cast<uint32_t>(inputs.size());
  const size_t n = inputs.front().size();
  std::vector<std::unique_ptr<Codec>> codecs;
  for (uint32_t r = 0; r < world; ++r) codecs.push_back(make_codec(spec));
  const CodecTraits traits = codecs[0]->traits();
  ctx.world_size = world;
  auto rank_ctx = [&](uint32_t r) { Context c = ctx; c.rank = r; return c; };

  for (int round = 0; round + 1 < traits.rounds; ++round) {
    std::vector<std::vector<std::byte>> frames(world);
    for (uint32_t r = 0; r < world; ++r) {
      frames[r].resize(codecs[r]->max_round_bytes(round, n));
      frames[r].resize(codecs[r]->encode_round(round, inputs[r], frames[r], rank_ctx(r)));
    }
    for (uint32_t r = 1; r < world; ++r) {
      reduce_frame_into(frames[0], frames[r], DType::kF32, codecs[0]->round_op(round));
    }
    for (uint32_t r = 0; r < world; ++r) codecs[r]->absorb_round(round, frames[0], rank_ctx(r));
  }

  std::vector<float> sum(n, 0.0f);
  if (traits.summable) {
    std::vector<std::vector<std::byte>> frames(world);
    for (uint32_t r = 0; r < world; ++r) frames[r] = encode(*codecs[r], inputs[r], rank_ctx(r));
    for (uint32_t r = 1; r < world; ++r) {
      reduce_frame_into(frames[0], frames[r], traits.payload_type, ReduceOp::kSum);
    }
    if (traits.rounds > 1) {
      for (uint32_t r = 0; r < world; ++r) {
        codecs[r]->absorb_round(traits.rounds - 1, frames[0], rank_ctx(r));
      }
    }
    codecs[0]->decode_accumulate(frames[0], sum, rank_ctx(0));
  } else {  // allgather: every rank decodes all W frames in rank order
    for (uint32_t r = 0; r < world; ++r) {
      codecs[0]->decode_accumulate(encode(*codecs[r], inputs[r], rank_ctx(r)), sum, rank_ctx(0));
    }
  }
  codecs[0]->finalize(sum, world);
  return sum;
}

std::string hex(std::span<const std::byte> bytes) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::byte b : bytes) {
    s += digits[std::to_integer<int>(b) >> 4];
    s += digits[std::to_integer<int>(b) & 15];
  }
  return s;
}

}  // namespace gradcomp::testing
