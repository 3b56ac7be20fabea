// The libtorch front end: wraps any torch::optim optimizer. Gradients are exchanged while
// backward runs and hold the mean over ranks when backward() returns (clip them there if you
// like); step() runs the wrapped optimizer unchanged, so its momentum, weight decay and
// learning-rate schedule behave exactly as without gradcomp.
//
//   auto transport = std::shared_ptr<gradcomp::Transport>(gradcomp::make_transport());
//   torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
//   gradcomp::torch::DistributedOptimizer opt(
//       sgd, model->named_parameters(), transport,
//       {.compression = parse_compression("powersgd:rank=4|ef")});
//   loss.backward(); opt.step(); opt.zero_grad();
#pragma once

#include <torch/torch.h>

#include <memory>
#include <unordered_set>

#include "gradcomp/torch/distributed_gradients.h"

namespace gradcomp::torch {

class DistributedOptimizer {
 public:
  // A collective, like DistributedGradients. `optimizer` must outlive this object. Under the
  // default plan, warns (TORCH_WARN) when the accuracy tables saw the compression's codec lose
  // under this kind of optimizer (gradcomp/recommended.h: Adam, AdamW, RMSprop, Adagrad; SGD).
  DistributedOptimizer(::torch::optim::Optimizer& optimizer,
                       const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                       std::shared_ptr<Transport> transport, GradientOptions options = {});

  // Steps the wrapped optimizer on the mean (exchanging first what backward left pending, see
  // DistributedGradients::synchronize). Throws Error, without stepping, after a backward pass
  // that raised on this rank, and when the optimizer holds a parameter not in named_parameters
  // (one its add_param_group added). Skips the step, with a warning (TORCH_WARN), when the mean is
  // not finite: every rank sees the same mean, so every rank skips alike.
  void step();
  // Makes the gradients hold the mean now (see DistributedGradients::synchronize).
  void synchronize();
  void zero_grad(bool set_to_none = false);

  ::torch::optim::Optimizer& optimizer() { return optimizer_; }
  DistributedGradients& gradients() { return gradients_; }

 private:
  // default_plan: no plan was given, so the caller named the compression (warned about when
  // it lost under this optimizer). options is moved from only here, after that was read.
  DistributedOptimizer(::torch::optim::Optimizer& optimizer,
                       const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                       std::shared_ptr<Transport> transport, GradientOptions&& options,
                       bool default_plan);

  ::torch::optim::Optimizer& optimizer_;
  // named_parameters' tensors: the ones exchanged, so the only ones the optimizer may step.
  std::unordered_set<const c10::TensorImpl*> exchanged_;
  DistributedGradients gradients_;
};

}  // namespace gradcomp::torch
