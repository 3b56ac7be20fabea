// OneBitAdam (libtorch): the variance policy picks one of TwoStageOptimizer's two engines per
// step, then the fused kernels of gradcomp/optimizer.h update. The same algorithm as
// python/gradcomp/onebit_adam.py.
#include "gradcomp/torch/onebit_adam.h"

#include <fmt/format.h>
#include <torch/serialize/archive.h>

#include "gradcomp/error.h"

namespace gradcomp::torch {
namespace {

constexpr const char* kOneBitAdamName = "OneBitAdam";

// The warm-up under "freeze" (nullopt under "doubling"), after checking the policy's options.
std::optional<int64_t> checked_policy(const OneBitAdamOptions& o) {
  if (o.variance() != "freeze" && o.variance() != "doubling") {
    throw SpecError(
        fmt::format("OneBitAdam: variance is '{}'; allowed: 'freeze', 'doubling'", o.variance()));
  }
  if (o.variance_interval() < 1) {
    throw SpecError(fmt::format("OneBitAdam: variance_interval is {}; allowed: an int >= 1",
                                o.variance_interval()));
  }
  if (o.variance() == "doubling") {
    if (o.warmup_steps()) {
      throw SpecError(
          "OneBitAdam: warmup_steps applies to variance=\"freeze\"; the \"doubling\" policy's "
          "exact steps are set by variance_interval");
    }
    return std::nullopt;
  }
  return warmup_steps_of(o.warmup_steps(), o.total_steps(), kOneBitAdamName,
                         "Adam's variance must see gradients before it freezes");
}

// Checks this optimizer's own options before the base class is built (and before any
// collective); the base checks the exchange's.
const OneBitAdamOptions& checked_adam_options(const OneBitAdamOptions& o) {
  check_adam_hyper(o.hyper(), kOneBitAdamName);
  checked_policy(o);
  return o;
}

}  // namespace

void OneBitAdamParamState::write_extra(::torch::serialize::OutputArchive& archive) const {
  archive.write("filled", c10::IValue(filled()));
}

void OneBitAdamParamState::read_extra(::torch::serialize::InputArchive& archive) {
  c10::IValue v;
  if (archive.try_read("filled", v)) filled(v.toBool());
}

bool is_exact_step(int64_t step, int64_t interval) {
  int64_t begin = 0;
  int64_t every = 1;
  while (step >= begin + interval * every) {
    begin += interval * every;
    every *= 2;
  }
  return (step - begin) % every == 0;
}

OneBitAdam::OneBitAdam(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                       std::shared_ptr<Transport> transport, OneBitAdamOptions options)
    : TwoStageOptimizerOf(named_parameters, std::move(transport), checked_adam_options(options),
                          kOneBitAdamName, "variance policy's (warmup_steps, variance_interval)"),
      variance_(options.variance()),
      interval_(options.variance_interval()),
      warmup_(checked_policy(options)) {}

bool OneBitAdam::exact() const {
  if (warmup_) return steps() < *warmup_;
  return is_exact_step(steps(), interval_);
}

bool OneBitAdam::frozen() const { return warmup_ && steps() >= *warmup_; }

// The checkpoint's settings, in the order OneBitAdam has always written them.
std::vector<OneBitAdam::Setting> OneBitAdam::settings() const {
  return {{"variance", c10::IValue(variance_)},
          {"variance_interval", c10::IValue(interval_)},
          {"warmup_steps", c10::IValue(warmup_.value_or(0))}};  // 0: none ("doubling")
}

void OneBitAdam::update(size_t i, bool is_exact, int threads) {
  OneBitAdamParamState& state = state_of(i);
  state.step(state.step() + 1);
  const AdamHyper hyper = hyper_of(i);
  LayerSlot slot = layer(i);
  if (is_exact) {  // m and v take the mean gradient
    state.variance_updates(state.variance_updates() + 1);
    if (state.variance_updates() == state.step()) {  // every step so far was exact
      adamw_step(slot, state.step(), hyper, threads);
    } else {
      zero_one_adam_step(slot, state.step(), state.variance_updates(), true, hyper, threads);
    }
    return;
  }
  if (frozen() && !state.filled()) {
    fill_unseen(state.exp_avg_sq());  // it will not learn them any more
    state.filled(true);
  }
  state.exp_avg().copy_(exchanged(i));  // the averaged momentum, the same on every rank
  slot.grad = {};
  frozen_adam_step(slot, state.step(), state.variance_updates(), hyper, threads);
}

}  // namespace gradcomp::torch
