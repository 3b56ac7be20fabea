// allgather: any single-round codec. Every rank receives all W frames and decodes them in rank
// order into the same sum, so every rank ends with the same bits. Where frames may differ in
// size (threshold, DGC) the sizes travel first (8 bytes per rank); a codec of fixed frame size
// needs no such round.
#include <fmt/format.h>

#include <numeric>

#include "gradcomp/error.h"
#include "route/flat_route.h"

namespace gradcomp::route {
namespace {

constexpr const char* kAllgatherName = "allgather";

class AllgatherRoute final : public CodedRoute {
 public:
  explicit AllgatherRoute(const RouteConfig& config);

  void encode(std::span<float> grad, const StepState& step, const Phases& p) override;
  void exchange(const StepState& step, const Phases& p) override;
  float decode_unscaled(std::span<float> out, const StepState& step, const Phases& p) override;
  size_t memory_bytes() const override;

 private:
  // Where frames may differ in size: every rank's size first, checked, into counts_.
  void exchange_sizes(const Phases& p);

  Codec& codec_;
  size_t max_frame_;
  bool fixed_;  // every frame is max_frame_ bytes: counts_ is known, no size exchange

  Buffer<std::byte> frame_;     // this rank's frame
  Buffer<std::byte> gathered_;  // all frames, in rank order
  std::vector<uint64_t> my_size_;    // one element: what the size allgather sends
  std::vector<uint64_t> sizes_;      // every rank's frame size
  std::vector<size_t> counts_;       // every rank's frame size for allgatherv (checked)
  size_t frame_bytes_ = 0;
};

AllgatherRoute::AllgatherRoute(const RouteConfig& c)
    : CodedRoute(kAllgatherName, c),
      codec_(coder_.codec()),
      max_frame_(codec_.max_frame_bytes(n_)),
      fixed_(codec_.traits().fixed_frame_size),
      frame_(max_frame_),
      gathered_(max_frame_ * world_size_),
      my_size_(1),
      sizes_(world_size_),
      counts_(world_size_, max_frame_) {}

void AllgatherRoute::encode(std::span<float> grad, const StepState& step, const Phases& p) {
  start_step(grad);
  p.run("encode", [&] {
    frame_bytes_ = coder_.encode(grad, frame_, context(step, rank_), step, world_size_);
    if (fixed_) checked_fixed_size(codec_, frame_bytes_, max_frame_);
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

float AllgatherRoute::decode_unscaled(std::span<float> out, const StepState& step,
                                      const Phases& p) {
  check_output(out);
  float factor = 1.0f;
  p.run("decode", [&] {
    decode_sum(codec_, gathered_, counts_, out, [&](uint32_t r) { return context(step, r); });
    factor = finish_sum(out);
  });
  return factor;
}

size_t AllgatherRoute::memory_bytes() const {
  return frame_.size() + gathered_.size() + coder_.memory_bytes();
}

}  // namespace

std::unique_ptr<Route> make_allgather_route(const RouteConfig& config) {
  return std::make_unique<AllgatherRoute>(config);
}

}  // namespace gradcomp::route
