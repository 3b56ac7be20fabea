// DistributedOptimizer (libtorch): step() = wait for the exchange, then the wrapped step.
#include "gradcomp/torch/distributed_optimizer.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <optional>
#include <unordered_set>

#include "gradcomp/error.h"
#include "gradcomp/recommended.h"
#include "gradcomp/torch/layerwise_optimizers.h"
#include "gradcomp/torch/two_stage.h"

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

// The optimizer's name and kind: Adam-family (a per-coordinate normalised step), SGD, or
// neither (no kind: nothing to say).
struct OptimizerKind {
  const char* name = "";
  std::optional<OptimizerFamily> family;
};

OptimizerKind kind_of(::torch::optim::Optimizer& optimizer) {
  namespace o = ::torch::optim;
  if (dynamic_cast<o::Adam*>(&optimizer)) return {"Adam", OptimizerFamily::kAdam};
  if (dynamic_cast<o::AdamW*>(&optimizer)) return {"AdamW", OptimizerFamily::kAdam};
  if (dynamic_cast<o::RMSprop*>(&optimizer)) return {"RMSprop", OptimizerFamily::kAdam};
  if (dynamic_cast<o::Adagrad*>(&optimizer)) return {"Adagrad", OptimizerFamily::kAdam};
  if (dynamic_cast<LANS*>(&optimizer)) return {"LANS", OptimizerFamily::kLans};
  if (auto* layerwise = dynamic_cast<LayerwiseAdam*>(&optimizer)) {
    return {layerwise->name(), OptimizerFamily::kAdam};  // LAMB: no evidence of its own
  }
  if (dynamic_cast<o::SGD*>(&optimizer)) return {"SGD", OptimizerFamily::kSgd};
  return {};
}

// The accuracy tables do not back this plan's compression under this optimizer: say so once.
void warn_if_not_recommended(::torch::optim::Optimizer& optimizer, const Plan& plan) {
  const auto kind = kind_of(optimizer);
  if (!kind.family) return;
  for (const auto& bucket : plan.buckets) {
    const std::string warning =
        recommendation_warning(bucket.option, *kind.family, kind.name);
    if (warning.empty()) continue;
    TORCH_WARN("gradcomp: ", warning);
    return;
  }
}

// Throws Error when the optimizer holds a parameter not in `exchanged` (not among the
// named_parameters given, or added since by its add_param_group): its gradient is this rank's.
void check_exchanged(::torch::optim::Optimizer& optimizer,
                     const std::unordered_set<const c10::TensorImpl*>& exchanged) {
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (exchanged.contains(params[i].unsafeGetTensorImpl())) continue;
      throw Error(fmt::format(
          "gradcomp: the wrapped optimizer's parameter {} of group {} (shape [{}]) is not in "
          "named_parameters, so its gradient is not exchanged: a step would move it by this "
          "rank's gradient alone and the ranks would drift apart. Pass the named_parameters() "
          "of the model the optimizer trains, and build the DistributedOptimizer again after "
          "the optimizer's add_param_group",
          i, g, fmt::join(params[i].sizes(), ", ")));
    }
  }
}

// named_parameters' tensors, checked to hold every parameter of the optimizer.
std::unordered_set<const c10::TensorImpl*> exchanged_tensors(
    ::torch::optim::Optimizer& optimizer,
    const ::torch::OrderedDict<std::string, at::Tensor>& named) {
  std::unordered_set<const c10::TensorImpl*> tensors;
  for (const auto& item : named) tensors.insert(item.value().unsafeGetTensorImpl());
  check_exchanged(optimizer, tensors);
  return tensors;
}

// OneBitAdam and OneBitLamb exchange by themselves: wrapping one would average twice (and its
// momentum exchange would be lost). Refused before the exchange is built (a collective).
::torch::optim::Optimizer& not_self_exchanging(::torch::optim::Optimizer& optimizer) {
  if (const auto* two_stage = dynamic_cast<TwoStageOptimizer*>(&optimizer)) {
    throw Error(fmt::format(
        "{} averages over the ranks by itself: use it instead of DistributedOptimizer, not "
        "inside it (its compression option sets the exchange)",
        two_stage->name()));
  }
  return optimizer;
}

// compression="auto" without candidates: the options the accuracy tables back under this kind
// of optimizer (under both kinds when it is neither), except those that held only after a
// warm-up of their own (start=N).
GradientOptions with_auto_candidates(GradientOptions&& options,
                                     ::torch::optim::Optimizer& optimizer) {
  if (!options.auto_settings || !options.auto_settings->candidates.empty()) {
    return std::move(options);
  }
  const auto family = kind_of(optimizer).family;
  const auto recommended = family ? recommended_options({*family})
                                  : recommended_options({OptimizerFamily::kSgd,
                                                         OptimizerFamily::kAdam});
  for (const auto& option : recommended) {
    if (option != "none" && parse_option(option).start_step == 0) {
      options.auto_settings->candidates.push_back(option);
    }
  }
  return std::move(options);
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
    : optimizer_(not_self_exchanging(optimizer)),
      exchanged_(exchanged_tensors(optimizer, named_parameters)),
      gradients_(to_pairs(named_parameters), std::move(transport),
                 with_auto_candidates(std::move(options), optimizer)) {
  gradients_.set_learning_rate(first_learning_rate(optimizer_));
  // Every rank has the same options: rank 0 says it for the job.
  if (default_plan && gradients_.transport().rank() == 0) {
    warn_if_not_recommended(optimizer_, gradients_.plan());
  }
}

void DistributedOptimizer::synchronize() { gradients_.synchronize(); }

void DistributedOptimizer::step() {
  gradients_.synchronize();  // waits only if backward left something to exchange
  if (auto refusal = gradients_.aborted_step(); !refusal.empty()) {
    gradients_.step_done();
    throw Error(refusal);
  }
  try {
    check_exchanged(optimizer_, exchanged_);
  } catch (const Error&) {
    gradients_.step_done();
    throw;
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
  // A step skipped after an overflow or a backward that raised ends here, as in Python: its
  // non-finite mean must not also skip the next step on this rank only.
  gradients_.step_done();
  if (!set_to_none) {
    optimizer_.zero_grad();
    return;
  }
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
  }
}

}  // namespace gradcomp::torch
