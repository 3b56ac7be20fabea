// The base of the flat routes (one transport, every rank alike: allreduce, allgather, twoway):
// what each of them holds and checks, so a route's file holds only its own pattern. CodedRoute
// adds the one coder (codec + feedback) of a route that compresses the whole bucket once, and
// its state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "route/coder.h"
#include "route/frames.h"
#include "route/routes.h"

namespace gradcomp::route {

class FlatRoute : public Route {
 public:
  size_t bytes_sent() const override { return sent_; }

 protected:
  FlatRoute(const char* name, const RouteConfig& config)
      : name_(name),
        world_(*config.env.world),
        env_(config.env),
        bucket_(config.bucket),
        key_(config.key),
        n_(config.elements),
        rank_(static_cast<uint32_t>(world_.rank())),
        world_size_(static_cast<uint32_t>(world_.size())) {}

  // The Context of a codec call: `key` is the bucket (or a stream of it, shard_key), `rank`
  // the encoding rank (decoding uses the encoder's, so shared randomness matches).
  Context context(const StepState& step, uint64_t key, uint32_t rank) const {
    return codec_context(env_, key, step, rank, world_size_);
  }
  // encode()'s first lines: the gradient has the bucket's length; a new step's bytes count.
  void start_step(std::span<const float> grad) {
    check_length(name_, bucket_, "gradient", grad.size(), n_);
    sent_ = 0;
  }
  void check_output(std::span<const float> out) const {
    check_length(name_, bucket_, "output", out.size(), n_);
  }
  StateShape shape() const { return {n_, world_size_}; }

  const char* name_;
  Transport& world_;
  RouteEnv env_;
  size_t bucket_;
  uint64_t key_;  // the randomness key (RouteConfig::key)
  size_t n_;
  uint32_t rank_;
  uint32_t world_size_;
  size_t sent_ = 0;  // bytes this rank sent in the current step
};

class CodedRoute : public FlatRoute {
 public:
  // Decodes into the sum (and finishes a majority vote) in decode_unscaled; decode adds the
  // mean's factor.
  float decode_unscaled(std::span<float> out, const StepState& step, const Phases& p) override = 0;
  void decode(std::span<float> out, const StepState& step, const Phases& p) final {
    apply_factor(out, decode_unscaled(out, step, p));
  }
  bool takes_parts(const StepState& /*step*/) const override { return coder_.takes_parts(); }
  void take_part(size_t offset, std::span<const float> part, const StepState& step) override {
    coder_.take_part(n_, offset, part, step, world_size_);
  }
  bool stateful() const override { return coder_.stateful(); }
  void settle(bool keep, const StepState& step) override { coder_.settle(keep, step); }
  double carry(std::span<float> into) const override {
    coder_.feedback().add_unsent(into);
    return coder_.memory_scale();
  }
  std::vector<std::byte> save_state() const override {
    return save_parts(name_, shape(), coder_.save_state());
  }
  void load_state(std::span<const std::byte> state) override {
    const auto parts = load_parts(name_, state, shape(), 2);
    coder_.load_state(parts[0], parts[1]);
  }

 protected:
  // The codec knows the bucket's layout (make_bucket_codec); it must fit the route.
  CodedRoute(const char* name, const RouteConfig& config)
      : FlatRoute(name, config), coder_(make_bucket_codec(config), make_feedback(config.feedback())) {
    check_codec_fits(name, coder_.codec());
  }
  Context context(const StepState& step, uint32_t rank) const {
    return FlatRoute::context(step, key_, rank);
  }
  // The end of a decode into the sum of the W ranks' frames: a mean is left to the caller as
  // the factor 1/W (Route::decode_unscaled); any other aggregation (a majority vote) is done
  // here, leaving 1.
  float finish_sum(std::span<float> sum) const {
    const Codec& codec = coder_.codec();
    if (codec.traits().aggregation == Aggregation::kMean) return mean_factor(world_size_);
    codec.finalize(sum, world_size_);
    return 1.0f;
  }

  Coder coder_;
};

}  // namespace gradcomp::route
