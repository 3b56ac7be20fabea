#include "route/coder.h"

#include <utility>

namespace gradcomp::route {

Coder::Coder(std::unique_ptr<Codec> codec, std::unique_ptr<Feedback> feedback)
    : codec_(std::move(codec)),
      feedback_(std::move(feedback)),
      keeper_({feedback_.get()}, {codec_.get()}) {}

size_t Coder::finish(std::span<const float> x, std::span<std::byte> frame,
                     const Context& ctx) const {
  const size_t bytes = codec_->encode(x, frame, ctx, feedback_->residual());
  feedback_->commit();
  return bytes;
}

std::vector<std::vector<std::byte>> Coder::save_state() const {
  return {codec_->save_state(), feedback_->save_state()};
}

void Coder::load_state(std::span<const std::byte> codec, std::span<const std::byte> feedback) {
  codec_->load_state(codec);
  feedback_->load_state(feedback);
  keeper_.forget();
}

}  // namespace gradcomp::route
