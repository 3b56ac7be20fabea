// In-process references of the routes: W simulated ranks with their own codecs and feedback,
// kept across steps as a route keeps them, doing the arithmetic each route promises in the
// order it promises it. The allreduce and allgather references follow the protocol of
// tests/support aggregate_allreduce (the sum of frames as a left fold in rank order with
// reduce_frame_into, decode, finalize), with feedback and state added.
#pragma once

#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/half.h"
#include "gradcomp/codec.h"
#include "gradcomp/feedback.h"
#include "gradcomp/plan.h"
#include "route/frames.h"
#include "route/route.h"

namespace gradcomp::testing {

struct SimRank {
  std::unique_ptr<Codec> codec, server_codec;
  std::unique_ptr<Feedback> feedback, server_feedback;
};

// Element s of W contiguous shards: [floor(n s / W), floor(n (s+1) / W)).
inline std::pair<size_t, size_t> reference_shard(size_t n, uint32_t s, uint32_t world) {
  const auto at = [&](uint32_t k) { return n * k / world; };  // test sizes: no overflow
  return {at(s), at(s + 1)};
}

// One flat route (allreduce, allgather, twoway) over W simulated ranks.
class FlatReference {
 public:
  FlatReference(std::string route, const Option& option, const std::string& server_feedback,
                size_t bucket, size_t n, uint32_t world, uint64_t seed)
      : route_(std::move(route)), bucket_(bucket), n_(n), world_(world), seed_(seed) {
    for (uint32_t r = 0; r < world; ++r) {
      ranks_.push_back({make_codec(option.codec), make_codec(option.codec),
                        make_feedback(option.feedback),
                        make_feedback(server_feedback.empty() ? option.feedback : server_feedback)});
    }
  }

  std::vector<float> step(const std::vector<std::vector<float>>& inputs, const StepState& s) {
    if (route_ == "allreduce") return allreduce(inputs, s);
    if (route_ == "allgather") return allgather(inputs, s);
    return twoway(inputs, s);
  }

  SimRank& rank(uint32_t r) { return ranks_[r]; }

 private:
  Context ctx(uint64_t key, const StepState& s, uint32_t rank) const {
    return {.seed = seed_, .bucket = key, .step = s.step, .rank = rank, .world_size = world_};
  }
  StepInfo info(const StepState& s) const {
    return {.step = s.step, .lr = s.lr, .prev_lr = s.prev_lr, .world_size = world_};
  }
  static std::vector<std::byte> encode(Codec& c, std::span<const float> x, const Context& ctx,
                                       std::span<float> residual) {
    std::vector<std::byte> frame(c.max_frame_bytes(x.size()));
    frame.resize(c.encode(x, frame, ctx, residual));
    return frame;
  }

  std::vector<float> allreduce(const std::vector<std::vector<float>>& inputs, const StepState& s) {
    const CodecTraits t = ranks_[0].codec->traits();
    std::vector<std::span<const float>> xs;
    for (uint32_t r = 0; r < world_; ++r) {
      xs.push_back(ranks_[r].feedback->compensate(inputs[r], info(s)));
    }
    for (int round = 0; round + 1 < t.rounds; ++round) {
      std::vector<std::vector<std::byte>> frames(world_);
      for (uint32_t r = 0; r < world_; ++r) {
        Codec& c = *ranks_[r].codec;
        frames[r].resize(c.max_round_bytes(round, n_));
        frames[r].resize(c.encode_round(round, xs[r], frames[r], ctx(bucket_, s, r)));
      }
      for (uint32_t r = 1; r < world_; ++r) {
        reduce_frame_into(frames[0], frames[r], DType::kF32, ranks_[0].codec->round_op(round));
      }
      for (uint32_t r = 0; r < world_; ++r) {
        ranks_[r].codec->absorb_round(round, frames[0], ctx(bucket_, s, r));
      }
    }
    std::vector<std::vector<std::byte>> frames(world_);
    for (uint32_t r = 0; r < world_; ++r) {
      frames[r] = encode(*ranks_[r].codec, xs[r], ctx(bucket_, s, r), ranks_[r].feedback->residual());
      ranks_[r].feedback->commit();
    }
    for (uint32_t r = 1; r < world_; ++r) {
      reduce_frame_into(frames[0], frames[r], t.payload_type, ReduceOp::kSum);
    }
    if (t.rounds > 1) {
      for (uint32_t r = 0; r < world_; ++r) {
        ranks_[r].codec->absorb_round(t.rounds - 1, frames[0], ctx(bucket_, s, r));
      }
    }
    std::vector<float> sum(n_, 0.0f);
    ranks_[0].codec->decode_accumulate(frames[0], sum, ctx(bucket_, s, 0));
    ranks_[0].codec->finalize(sum, world_);
    return sum;
  }

  std::vector<float> allgather(const std::vector<std::vector<float>>& inputs, const StepState& s) {
    std::vector<float> sum(n_, 0.0f);
    std::vector<std::vector<std::byte>> frames(world_);
    for (uint32_t r = 0; r < world_; ++r) {
      const auto x = ranks_[r].feedback->compensate(inputs[r], info(s));
      frames[r] = encode(*ranks_[r].codec, x, ctx(bucket_, s, r), ranks_[r].feedback->residual());
      ranks_[r].feedback->commit();
    }
    for (uint32_t r = 0; r < world_; ++r) {
      ranks_[0].codec->decode_accumulate(frames[r], sum, ctx(bucket_, s, r));
    }
    ranks_[0].codec->finalize(sum, world_);
    return sum;
  }

  std::vector<float> twoway(const std::vector<std::vector<float>>& inputs, const StepState& s) {
    const auto worker_key = [&](uint32_t shard) { return route::shard_key(bucket_, shard, false); };
    const auto server_key = [&](uint32_t shard) { return route::shard_key(bucket_, shard, true); };
    // frames[r][s]: rank r's frame of shard s
    std::vector<std::vector<std::vector<std::byte>>> frames(world_);
    for (uint32_t r = 0; r < world_; ++r) {
      const auto x = ranks_[r].feedback->compensate(inputs[r], info(s));
      const auto residual = ranks_[r].feedback->residual();
      for (uint32_t sh = 0; sh < world_; ++sh) {
        const auto [b, e] = reference_shard(n_, sh, world_);
        frames[r].push_back(encode(*ranks_[r].codec, x.subspan(b, e - b), ctx(worker_key(sh), s, r),
                                   residual.empty() ? residual : residual.subspan(b, e - b)));
      }
      ranks_[r].feedback->commit();
    }
    std::vector<float> out(n_, 0.0f);
    for (uint32_t sh = 0; sh < world_; ++sh) {  // rank sh serves shard sh
      const auto [b, e] = reference_shard(n_, sh, world_);
      SimRank& server = ranks_[sh];
      std::vector<float> sum(e - b, 0.0f);
      for (uint32_t r = 0; r < world_; ++r) {
        server.codec->decode_accumulate(frames[r][sh], sum, ctx(worker_key(sh), s, r));
      }
      server.codec->finalize(sum, world_);
      const auto x = server.server_feedback->compensate(sum, info(s));
      const auto frame = encode(*server.server_codec, x, ctx(server_key(sh), s, sh),
                                server.server_feedback->residual());
      server.server_feedback->commit();
      server.server_codec->decode_accumulate(frame, std::span(out).subspan(b, e - b),
                                             ctx(server_key(sh), s, sh));
    }
    return out;
  }

  std::string route_;
  size_t bucket_, n_;
  uint32_t world_;
  uint64_t seed_;
  std::vector<SimRank> ranks_;
};

// The hierarchical route over W ranks in nodes of `local` consecutive ranks: the node's sum
// (float32, or float16 added in float32 and rounded per addition as transports do), divided by
// the local size, then the inner flat route among the W / local leaders.
class HierarchicalReference {
 public:
  HierarchicalReference(const std::string& inner, bool fp16, const Option& option,
                        const std::string& server_feedback, size_t bucket, size_t n,
                        uint32_t world, uint32_t local, uint64_t seed)
      : fp16_(fp16), n_(n), world_(world), local_(local),
        inner_(inner, option, server_feedback, bucket, n, world / local, seed) {}

  std::vector<float> step(const std::vector<std::vector<float>>& inputs, const StepState& s) {
    std::vector<std::vector<float>> means;
    for (uint32_t node = 0; node < world_ / local_; ++node) {
      std::vector<float> sum(n_);
      for (size_t i = 0; i < n_; ++i) {
        if (fp16_) {
          uint16_t h = float_to_half(inputs[node * local_][i]);
          for (uint32_t j = 1; j < local_; ++j) {
            h = float_to_half(half_to_float(h) +
                              half_to_float(float_to_half(inputs[node * local_ + j][i])));
          }
          sum[i] = half_to_float(h);
        } else {
          sum[i] = inputs[node * local_][i];
          for (uint32_t j = 1; j < local_; ++j) sum[i] += inputs[node * local_ + j][i];
        }
        if (local_ > 1) sum[i] /= static_cast<float>(local_);
      }
      means.push_back(std::move(sum));
    }
    return inner_.step(means, s);
  }

  FlatReference& inner() { return inner_; }

 private:
  bool fp16_;
  size_t n_;
  uint32_t world_, local_;
  FlatReference inner_;
};

// The sharded route over nodes of `local` consecutive ranks: shard l of every node's mean (the
// sum of its ranks' shard in local-rank order, float16 inputs with fp16, times 1 / local) goes
// through its own flat route across nodes, keyed by the shard's stream.
class ShardedReference {
 public:
  ShardedReference(const std::string& inner, bool fp16, const Option& option,
                   const std::string& server_feedback, size_t bucket, size_t n, uint32_t world,
                   uint32_t local, uint64_t seed)
      : fp16_(fp16), n_(n), world_(world), local_(local) {
    for (uint32_t l = 0; l < local; ++l) {
      shards_.push_back(route::shard_range(n, l, local));
      inner_.push_back(std::make_unique<FlatReference>(inner, option, server_feedback,
                                                       route::shard_key(bucket, l, false),
                                                       shards_[l].size(), world / local, seed));
    }
  }

  std::vector<float> step(const std::vector<std::vector<float>>& inputs, const StepState& s) {
    std::vector<float> out(n_);
    const float inv = 1.0f / static_cast<float>(local_);
    for (uint32_t l = 0; l < local_; ++l) {
      const route::Range r = shards_[l];
      std::vector<std::vector<float>> means;
      for (uint32_t node = 0; node < world_ / local_; ++node) {
        std::vector<float> mean(r.size());
        for (size_t i = 0; i < r.size(); ++i) {
          float sum = value(inputs[node * local_][r.begin + i]);
          for (uint32_t j = 1; j < local_; ++j) sum += value(inputs[node * local_ + j][r.begin + i]);
          mean[i] = sum * inv;
        }
        means.push_back(std::move(mean));
      }
      const auto result = inner_[l]->step(means, s);
      std::copy(result.begin(), result.end(), out.begin() + static_cast<std::ptrdiff_t>(r.begin));
    }
    return out;
  }

 private:
  float value(float x) const { return fp16_ ? half_to_float(float_to_half(x)) : x; }

  bool fp16_;
  size_t n_;
  uint32_t world_, local_;
  std::vector<route::Range> shards_;
  std::vector<std::unique_ptr<FlatReference>> inner_;
};

}  // namespace gradcomp::testing
