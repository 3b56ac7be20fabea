// allgather: any single-round codec. Every rank receives all W frames and decodes them in rank
// order into the same sum, so every rank ends with the same bits. Where frames may differ in
// size (threshold, DGC) the sizes travel first (8 bytes per rank); a codec of fixed frame size
// needs no such round.
#include <fmt/format.h>

#include <numeric>

#include "gradcomp/error.h"
#include "route/frames.h"
#include "route/routes.h"

namespace gradcomp::route {
namespace {

constexpr const char* kName = "allgather";

class AllgatherRoute final : public Route {
 public:
  explicit AllgatherRoute(const RouteConfig& config);

  void encode(std::span<float> grad, const StepState& step, const Phases& p) override;
  void exchange(const StepState& step, const Phases& p) override;
  void decode(std::span<float> out, const StepState& step, const Phases& p) override;

  bool stateful() const override { return keeper_.stateful(); }
  void settle(bool keep, const StepState& step) override { keeper_.settle(keep, step); }
  double carry(std::span<float> into) const override {
    feedback_->add_unsent(into);
    return keeper_.memory_scale();
  }
  size_t bytes_sent() const override { return sent_; }
  size_t memory_bytes() const override;
  std::vector<std::byte> save_state() const override;
  void load_state(std::span<const std::byte> state) override;

 private:
  // The context frame `rank` was encoded with (decoding uses the encoder's, so that shared
  // randomness matches and no rank decodes differently from another).
  Context context(const StepState& step, uint32_t rank) const {
    return codec_context(env_, bucket_, step, rank, world_size_);
  }
  // Where frames may differ in size: every rank's size first, checked, into counts_.
  void exchange_sizes(const Phases& p);

  Transport& world_;
  RouteEnv env_;
  size_t bucket_;
  size_t n_;
  uint32_t rank_;
  uint32_t world_size_;
  std::unique_ptr<Codec> codec_;
  std::unique_ptr<Feedback> feedback_;
  StepKeeper keeper_;
  size_t max_frame_;
  bool fixed_;  // every frame is max_frame_ bytes: counts_ is known, no size exchange

  Buffer<std::byte> frame_;     // this rank's frame
  Buffer<std::byte> gathered_;  // all frames, in rank order
  std::vector<uint64_t> my_size_;    // one element: what the size allgather sends
  std::vector<uint64_t> sizes_;      // every rank's frame size
  std::vector<size_t> counts_;       // every rank's frame size for allgatherv (checked)
  size_t frame_bytes_ = 0;
  size_t sent_ = 0;
};

AllgatherRoute::AllgatherRoute(const RouteConfig& c)
    : world_(*c.env.world),
      env_(c.env),
      bucket_(c.bucket),
      n_(c.elements),
      rank_(static_cast<uint32_t>(world_.rank())),
      world_size_(static_cast<uint32_t>(world_.size())),
      codec_(make_bucket_codec(c)),
      feedback_(make_feedback(c.feedback)),
      keeper_({feedback_.get()}, {codec_.get()}),
      max_frame_(codec_->max_frame_bytes(n_)),
      fixed_(codec_->traits().fixed_frame_size),
      frame_(max_frame_),
      gathered_(max_frame_ * world_size_),
      my_size_(1),
      sizes_(world_size_),
      counts_(world_size_, max_frame_) {
  check_codec_fits(kName, *codec_);
}

void AllgatherRoute::encode(std::span<float> grad, const StepState& step, const Phases& p) {
  check_length(kName, bucket_, "gradient", grad.size(), n_);
  sent_ = 0;
  p.run("encode", [&] {
    const auto x = feedback_->compensate(grad, keeper_.info(step, world_size_));
    frame_bytes_ = codec_->encode(x, frame_, context(step, rank_), feedback_->residual());
    feedback_->commit();
    if (fixed_) checked_fixed_size(*codec_, frame_bytes_, max_frame_);
  });
}

void AllgatherRoute::exchange(const StepState&, const Phases& p) {
  if (!fixed_) exchange_sizes(p);
  const size_t total = std::accumulate(counts_.begin(), counts_.end(), size_t{0});
  const auto issued = Clock::now();
  p.wait(world_.allgatherv(std::span(frame_).first(frame_bytes_),
                           std::span(gathered_).first(total), counts_),
         "allgather", issued);
  sent_ += frame_bytes_;
}

void AllgatherRoute::exchange_sizes(const Phases& p) {
  my_size_[0] = frame_bytes_;
  const auto issued = Clock::now();
  p.wait(world_.allgather(bytes_of(my_size_), bytes_of(sizes_)), "sizes", issued);
  for (uint32_t r = 0; r < world_size_; ++r) {
    counts_[r] = checked_size(sizes_[r], max_frame_, static_cast<int>(r), "frame size");
  }
  sent_ += sizeof(uint64_t);
}

void AllgatherRoute::decode(std::span<float> out, const StepState& step, const Phases& p) {
  check_length(kName, bucket_, "output", out.size(), n_);
  p.run("decode", [&] {
    zero(out);
    size_t at = 0;
    for (uint32_t r = 0; r < world_size_; ++r) {
      codec_->decode_accumulate(std::span(gathered_).subspan(at, counts_[r]), out,
                                context(step, r));
      at += counts_[r];
    }
    codec_->finalize(out, world_size_);
  });
}

size_t AllgatherRoute::memory_bytes() const {
  return frame_.size() + gathered_.size() + feedback_->memory_bytes();
}

std::vector<std::byte> AllgatherRoute::save_state() const {
  return save_parts(kName, {n_, world_size_}, {codec_->save_state(), feedback_->save_state()});
}

void AllgatherRoute::load_state(std::span<const std::byte> state) {
  const auto parts = load_parts(kName, state, {n_, world_size_}, 2);
  codec_->load_state(parts[0]);
  feedback_->load_state(parts[1]);
  keeper_.forget();
}

}  // namespace

std::unique_ptr<Route> make_allgather_route(const RouteConfig& config) {
  return std::make_unique<AllgatherRoute>(config);
}

}  // namespace gradcomp::route
