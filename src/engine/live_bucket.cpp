#include "engine/live_bucket.h"

#include <algorithm>

#include <fmt/format.h>

namespace gradcomp {

LiveBucket::LiveBucket(const Plan& plan, size_t index_in, const BucketOption& option,
                       const RouteEnv& env, std::vector<TensorSlot>& slots, Milliseconds timeout)
    : index(index_in), phases(index_in, timeout, nullptr) {
  const auto& tensors = plan.buckets[index].tensors;
  tensor_count_ = tensors.size();
  std::vector<TensorShape> layout;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t t = tensors[i];
    slots[t] = TensorSlot{.bucket = index, .position = i, .offset = elements,
                          .elements = plan.tensors[t].elements};
    offsets_.push_back(elements);
    elements += plan.tensors[t].elements;
    layout.push_back({plan.tensors[t].elements, plan.tensors[t].shape});
  }
  targets_.resize(tensor_count_);
  if (tensor_count_ > 1) fused_.assign(elements, 0.0f);
  pending = tensor_count_;
  route = make_route(option, index, elements, env, layout);
}

void LiveBucket::take(const TensorSlot& slot, std::span<float> grad, const StepState& step) {
  if (pending == tensor_count_) first_ready_at = Clock::now();
  targets_[slot.position] = grad;
  if (!fused_.empty()) {
    if (route->takes_parts(step)) {
      route->take_part(slot.offset, grad, step);
    } else {
      std::copy(grad.begin(), grad.end(), fused_.begin() + slot.offset);
    }
  }
  --pending;
}

std::span<float> LiveBucket::buffer() {
  if (tensor_count_ == 1) return targets_[0];
  return fused_;
}

route::Scan LiveBucket::give_back(float factor, bool squares) {
  if (tensor_count_ == 1) return route::write_mean(targets_[0], targets_[0], factor, squares);
  route::Scan all;
  for (size_t i = 0; i < tensor_count_; ++i) {
    const auto sum = std::span<const float>(fused_).subspan(offsets_[i], targets_[i].size());
    const route::Scan one = route::write_mean(sum, targets_[i], factor, squares);
    all.finite = all.finite && one.finite;
    all.sum_of_squares += one.sum_of_squares;
  }
  return all;
}

void LiveBucket::reset() {
  pending = tensor_count_;
  std::fill(targets_.begin(), targets_.end(), std::span<float>());
}

std::string LiveBucket::describe(const Plan& plan) const {
  const Option& o = plan.buckets[index].option;
  const std::string from =
      o.start_step == 0 ? "" : fmt::format(" from step {}", o.start_step);
  return fmt::format("bucket {}: {} tensor{}, {:.3g} MB, {} / {} / {}{}", index, tensor_count_,
                     tensor_count_ == 1 ? "" : "s", elements * 4.0 / 1e6, o.codec, o.feedback,
                     o.route, from);
}

size_t LiveBucket::memory_bytes() const {
  return fused_.size() * sizeof(float) + route->memory_bytes();
}

}  // namespace gradcomp
