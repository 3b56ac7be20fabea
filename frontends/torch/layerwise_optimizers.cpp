#include "gradcomp/torch/layerwise_optimizers.h"

#include <ATen/Parallel.h>
#include <torch/serialize/archive.h>

#include <span>

#include "gradcomp/error.h"
#include "optimizer_closure.h"

namespace gradcomp::torch {
namespace {

namespace o = ::torch::optim;

std::span<float> float_span(const at::Tensor& t) {
  return {t.data_ptr<float>(), static_cast<size_t>(t.numel())};
}

// Whether the kernel can update t in place.
bool in_place(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous();
}

at::Tensor float_cpu(const at::Tensor& t) {
  return t.to(at::kCPU, at::kFloat, /*non_blocking=*/false, /*copy=*/!in_place(t)).contiguous();
}

}  // namespace

AdamHyper LayerwiseOptions::hyper() const {
  return {.lr = lr(), .beta1 = std::get<0>(betas()), .beta2 = std::get<1>(betas()),
          .eps = eps(), .weight_decay = weight_decay(), .bias_correction = bias_correction()};
}

// torch's serialisation macros name `torch::`, which means gradcomp::torch here: the same
// archive entries, written out.
void LayerwiseOptions::serialize(::torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("betas", c10::IValue(betas()));
  archive.write("eps", c10::IValue(eps()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("bias_correction", c10::IValue(bias_correction()));
  archive.write("normalize_grad", c10::IValue(normalize_grad()));
}

void LayerwiseOptions::serialize(::torch::serialize::InputArchive& archive) {
  c10::IValue v;
  if (archive.try_read("lr", v)) lr(v.toDouble());
  if (archive.try_read("betas", v)) betas(v.to<betas_t>());
  if (archive.try_read("eps", v)) eps(v.toDouble());
  if (archive.try_read("weight_decay", v)) weight_decay(v.toDouble());
  if (archive.try_read("bias_correction", v)) bias_correction(v.toBool());
  if (archive.try_read("normalize_grad", v)) normalize_grad(v.toBool());
}

void LayerwiseParamState::serialize(::torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  archive.write("exp_avg", exp_avg());
  archive.write("exp_avg_sq", exp_avg_sq());
}

void LayerwiseParamState::serialize(::torch::serialize::InputArchive& archive) {
  c10::IValue v;
  if (archive.try_read("step", v)) step(v.toInt());
  at::Tensor t;
  if (archive.try_read("exp_avg", t)) exp_avg(t);
  at::Tensor u;
  if (archive.try_read("exp_avg_sq", u)) exp_avg_sq(u);
}

LayerwiseAdam::LayerwiseAdam(std::vector<o::OptimizerParamGroup> groups,
                             const LayerwiseOptions& defaults, const char* name)
    : Optimizer(std::move(groups), std::make_unique<LayerwiseOptions>(defaults)) {
  check_adam_hyper(defaults.hyper(), name);
}

at::Tensor LayerwiseAdam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  const at::Tensor loss = closure_loss(closure);
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const LayerwiseOptions&>(group.options());
    check_adam_hyper(options.hyper(), name());  // a scheduler or the caller may change them
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), name(), " does not support sparse gradients");
      auto key = c10::guts::to_string(p.unsafeGetTensorImpl());
      auto& slot = state_[key];
      if (!slot) {
        // float32 moments for half-precision parameters (their squares underflow)
        const auto dtype = p.element_size() < 4 ? at::kFloat : p.scalar_type();
        auto fresh = std::make_unique<LayerwiseParamState>();
        fresh->exp_avg(at::zeros(p.sizes(), p.options().dtype(dtype)));
        fresh->exp_avg_sq(at::zeros(p.sizes(), p.options().dtype(dtype)));
        slot = std::move(fresh);
      }
      auto& state = static_cast<LayerwiseParamState&>(*slot);
      state.step(state.step() + 1);
      const at::Tensor param = float_cpu(p);
      const at::Tensor grad = float_cpu(p.grad());
      const at::Tensor exp_avg = float_cpu(state.exp_avg());
      const at::Tensor exp_avg_sq = float_cpu(state.exp_avg_sq());
      update({float_span(param), float_span(grad), float_span(exp_avg), float_span(exp_avg_sq)},
             state.step(), options);
      // Copies back what was not updated in place (another device or dtype).
      if (!in_place(p)) p.copy_(param);
      if (!in_place(state.exp_avg())) state.exp_avg().copy_(exp_avg);
      if (!in_place(state.exp_avg_sq())) state.exp_avg_sq().copy_(exp_avg_sq);
    }
  }
  return loss;
}

void LayerwiseAdam::save(::torch::serialize::OutputArchive& archive) const {
  o::serialize<LayerwiseParamState, LayerwiseOptions>(archive, *this);
}

void LayerwiseAdam::load(::torch::serialize::InputArchive& archive) {
  o::serialize<LayerwiseParamState, LayerwiseOptions>(archive, *this);
  // A state from another model (or another optimizer) fails here, not inside a later step.
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      const auto it = state_.find(c10::guts::to_string(p.unsafeGetTensorImpl()));
      if (it == state_.end()) continue;
      const auto& state = static_cast<const LayerwiseParamState&>(*it->second);
      TORCH_CHECK(state.exp_avg().defined() && state.exp_avg_sq().defined() &&
                      state.exp_avg().sizes() == p.sizes() &&
                      state.exp_avg_sq().sizes() == p.sizes() && state.step() >= 1,
                  name(), ": the loaded state does not fit a parameter of shape ", p.sizes(),
                  " (moments of shape ", state.exp_avg().defined() ? state.exp_avg().sizes()
                                                                   : at::IntArrayRef{},
                  ", step ", state.step(), "); was it saved from another model or optimizer?");
    }
  }
}

LAMB::LAMB(std::vector<o::OptimizerParamGroup> groups, LayerwiseOptions defaults)
    : LayerwiseAdam(std::move(groups), defaults, "LAMB") {}
LAMB::LAMB(std::vector<at::Tensor> params, LayerwiseOptions defaults)
    : LAMB({o::OptimizerParamGroup(std::move(params))}, defaults) {}

LayerStep LAMB::update(const LayerSlot& layer, int64_t step,
                       const LayerwiseOptions& options) const {
  return lamb_step(layer, step, options.hyper(), at::get_num_threads());
}

LANS::LANS(std::vector<o::OptimizerParamGroup> groups, LayerwiseOptions defaults)
    : LayerwiseAdam(std::move(groups), defaults, "LANS") {}
LANS::LANS(std::vector<at::Tensor> params, LayerwiseOptions defaults)
    : LANS({o::OptimizerParamGroup(std::move(params))}, defaults) {}

LayerStep LANS::update(const LayerSlot& layer, int64_t step,
                       const LayerwiseOptions& options) const {
  return lans_step(layer, step, options.hyper(), options.normalize_grad(),
                   at::get_num_threads());
}

}  // namespace gradcomp::torch
