// What the libtorch optimizers' step() do first: the closure's loss, if any, evaluated with
// gradients on (the step itself runs without them, as torch's optimizers do).
#pragma once

#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>

namespace gradcomp::torch {

// The closure's loss; undefined without a closure.
inline at::Tensor closure_loss(const ::torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

}  // namespace gradcomp::torch
