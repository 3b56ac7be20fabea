// DistributedOptimizer (libtorch): step() = wait for the exchange, then the wrapped step.
#include "gradcomp/torch/distributed_optimizer.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <optional>

#include "gradcomp/error.h"
#include "gradcomp/recommended.h"

namespace gradcomp::torch {
namespace {

NamedParameters to_pairs(const ::torch::OrderedDict<std::string, at::Tensor>& named) {
  NamedParameters pairs;
  for (const auto& item : named) pairs.emplace_back(item.key(), item.value());
  return pairs;
}

constexpr const char* kNonFiniteStep =
    "gradcomp: this step's mean gradient is not finite (an overflow, or a backward pass that "
    "raised on some rank): the optimizer step is skipped on every rank, as a loss scaler does";

// Adam-family (a per-coordinate normalised step), SGD, or neither.
std::optional<OptimizerFamily> family_of(::torch::optim::Optimizer& optimizer) {
  namespace o = ::torch::optim;
  if (dynamic_cast<o::Adam*>(&optimizer) || dynamic_cast<o::AdamW*>(&optimizer) ||
      dynamic_cast<o::RMSprop*>(&optimizer) || dynamic_cast<o::Adagrad*>(&optimizer)) {
    return OptimizerFamily::kAdam;
  }
  if (dynamic_cast<o::SGD*>(&optimizer)) return OptimizerFamily::kSgd;
  return std::nullopt;
}

// The accuracy tables saw this plan's codec lose under this kind of optimizer: say so once.
void warn_if_not_recommended(::torch::optim::Optimizer& optimizer, const Plan& plan) {
  const auto family = family_of(optimizer);
  if (!family) return;
  for (const auto& bucket : plan.buckets) {
    const auto* r = recommendation_for(bucket.option.codec);
    if (r == nullptr || held_under(*r, *family)) continue;
    const bool sgd = *family == OptimizerFamily::kSgd;
    TORCH_WARN("gradcomp: compression with ", r->codec, " is not recommended with ",
               sgd ? "SGD" : "an Adam-family optimizer", ": ", r->option,
               " lost accuracy under it in gradcomp's accuracy tables (",
               sgd ? "docs/accuracy-5-epochs.md" : "docs/accuracy-lm.md", "); these held: ",
               fmt::format("{}", fmt::join(recommended_options({*family}), ", ")));
    return;
  }
}

double first_learning_rate(::torch::optim::Optimizer& optimizer) {
  auto& groups = optimizer.param_groups();
  return groups.empty() ? 0.0 : groups.front().options().get_lr();
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(
    ::torch::optim::Optimizer& optimizer,
    const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
    std::shared_ptr<Transport> transport, GradientOptions options)
    : DistributedOptimizer(optimizer, named_parameters, std::move(transport), std::move(options),
                           !options.plan.has_value()) {}

DistributedOptimizer::DistributedOptimizer(
    ::torch::optim::Optimizer& optimizer,
    const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
    std::shared_ptr<Transport> transport, GradientOptions&& options, bool default_plan)
    : optimizer_(optimizer),
      gradients_(to_pairs(named_parameters), std::move(transport), std::move(options)) {
  gradients_.set_learning_rate(first_learning_rate(optimizer_));
  if (default_plan) warn_if_not_recommended(optimizer_, gradients_.plan());
}

void DistributedOptimizer::synchronize() { gradients_.synchronize(); }

void DistributedOptimizer::step() {
  gradients_.synchronize();  // waits only if backward left something to exchange
  if (auto refusal = gradients_.aborted_step(); !refusal.empty()) {
    gradients_.step_done();
    throw Error(refusal);
  }
  if (!gradients_.mean_is_finite()) {
    // Stepping on NaN would ruin the parameters; every rank sees the same mean, so every
    // rank skips alike (as a loss scaler does), and says so.
    gradients_.step_done();
    TORCH_WARN(kNonFiniteStep);
    return;
  }
  optimizer_.step();
  gradients_.step_done();
  // Feedbacks that rescale by the learning-rate ratio see the rate of the coming step.
  gradients_.set_learning_rate(first_learning_rate(optimizer_));
}

void DistributedOptimizer::zero_grad(bool set_to_none) {
  if (!set_to_none) {
    optimizer_.zero_grad();
    return;
  }
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
  }
}

}  // namespace gradcomp::torch
