// OneBitLamb (libtorch): LAMB's steps during the warm-up, averaging each layer's trust ratio,
// then 1-bit LAMB's compression-stage steps (the fused kernels of gradcomp/optimizer.h) on
// TwoStageOptimizer's engines. The same algorithm as python/gradcomp/onebit_lamb.py; built
// with -ffp-contract=off (frontends/torch/CMakeLists.txt) so the average takes Python's bits.
#include "gradcomp/torch/onebit_lamb.h"

#include <fmt/format.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>

#include "gradcomp/error.h"

namespace gradcomp::torch {
namespace {

constexpr const char* kOneBitLambName = "OneBitLamb";

// Checks this optimizer's own options before the base class is built (and before any
// collective); the base checks the exchange's.
const OneBitLambOptions& checked_lamb_options(const OneBitLambOptions& o) {
  check_adam_hyper(o.hyper(), kOneBitLambName);
  warmup_steps_of(o.warmup_steps(), o.total_steps(), kOneBitLambName,
                  "the variance must see gradients before it freezes");
  check_onebit_lamb_hyper(o.lamb_hyper(), kOneBitLambName);
  return o;
}

}  // namespace

OneBitLambHyper OneBitLambOptions::lamb_hyper() const {
  return {.coeff_beta = coeff_beta(),
          .max_coeff = max_coeff(),
          .min_coeff = min_coeff(),
          .factor_max = factor_max(),
          .factor_min = factor_min(),
          .factor_threshold = factor_threshold()};
}

void OneBitLambParamState::write_extra(::torch::serialize::OutputArchive& archive) const {
  archive.write("lamb_coeff", c10::IValue(lamb_coeff()));
  archive.write("lamb_factor", c10::IValue(lamb_factor()));
  if (fresh_exp_avg_sq().defined()) archive.write("fresh_exp_avg_sq", fresh_exp_avg_sq());
}

void OneBitLambParamState::read_extra(::torch::serialize::InputArchive& archive) {
  c10::IValue v;
  if (archive.try_read("lamb_coeff", v)) lamb_coeff(v.toDouble());
  if (archive.try_read("lamb_factor", v)) lamb_factor(v.toDouble());
  at::Tensor fresh;
  if (archive.try_read("fresh_exp_avg_sq", fresh)) fresh_exp_avg_sq(fresh);
}

OneBitLamb::OneBitLamb(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                       std::shared_ptr<Transport> transport, OneBitLambOptions options)
    : TwoStageOptimizerOf(named_parameters, std::move(transport), checked_lamb_options(options),
                          kOneBitLambName, "warm-up's (warmup_steps)"),
      warmup_(warmup_steps_of(options.warmup_steps(), options.total_steps(), kOneBitLambName, "")),
      lamb_hyper_(options.lamb_hyper()) {}

// What a checkpoint must agree on, as the Python OneBitLamb's.
std::vector<OneBitLamb::Setting> OneBitLamb::settings() const {
  return {{"optimizer", c10::IValue(std::string(kOneBitLambName))},
          {"warmup_steps", c10::IValue(warmup_)},
          {"coeff_beta", c10::IValue(lamb_hyper_.coeff_beta)},
          {"max_coeff", c10::IValue(lamb_hyper_.max_coeff)},
          {"min_coeff", c10::IValue(lamb_hyper_.min_coeff)},
          {"factor_max", c10::IValue(lamb_hyper_.factor_max)},
          {"factor_min", c10::IValue(lamb_hyper_.factor_min)},
          {"factor_threshold", c10::IValue(lamb_hyper_.factor_threshold)}};
}

void OneBitLamb::update(size_t i, bool is_exact, int threads) {
  OneBitLambParamState& state = state_of(i);
  state.step(state.step() + 1);
  const AdamHyper hyper = hyper_of(i);
  const LayerSlot slot = layer(i);  // grad: the mean gradient, or the mean momentum
  if (is_exact) {
    state.variance_updates(state.variance_updates() + 1);
    average_ratio(state, lamb_step(slot, state.step(), hyper, threads).trust_ratio);
    return;
  }
  if (!state.fresh_exp_avg_sq().defined()) {  // the first step after the freeze
    fill_unseen(state.exp_avg_sq());          // it will not learn them any more
    state.fresh_exp_avg_sq(state.exp_avg_sq().clone(at::MemoryFormat::Contiguous));
  }
  OneBitLambLayer layer_state{.coeff = state.lamb_coeff(),
                              .factor = state.lamb_factor(),
                              .fresh_exp_avg_sq = float_span(state.fresh_exp_avg_sq())};
  onebit_lamb_step(slot, layer_state, state.step(), state.variance_updates(), hyper, lamb_hyper_,
                   threads);
  state.lamb_factor(layer_state.factor);
}

void OneBitLamb::average_ratio(OneBitLambParamState& state, double ratio) const {
  ratio = std::min(std::max(ratio, lamb_hyper_.min_coeff), lamb_hyper_.max_coeff);
  if (state.variance_updates() == 1) {
    state.lamb_coeff(ratio);
  } else {
    const double beta = lamb_hyper_.coeff_beta;
    state.lamb_coeff(beta * state.lamb_coeff() + (1 - beta) * ratio);
  }
}

bool OneBitLamb::adopt_loaded(TwoStageParamState& base, const at::Tensor& p) const {
  auto& state = static_cast<OneBitLambParamState&>(base);
  if (!std::isfinite(state.lamb_coeff()) || state.lamb_coeff() < 0 ||
      !std::isfinite(state.lamb_factor()) || state.lamb_factor() <= 0) {
    return false;
  }
  const at::Tensor& fresh = state.fresh_exp_avg_sq();
  if (!fresh.defined()) return true;
  if (fresh.sizes() != p.sizes() || fresh.scalar_type() != at::kFloat) return false;
  state.fresh_exp_avg_sq(fresh.contiguous());
  return true;
}

}  // namespace gradcomp::torch
