// LAMB and LANS for libtorch (torch::optim ships neither): ordinary torch::optim optimizers
// over gradcomp's fused kernels (gradcomp/optimizer.h), with param groups, learning-rate
// schedulers, torch::save / torch::load of their state, and as the inner optimizer of
// gradcomp::torch::DistributedOptimizer. docs/optimizers.md.
//
//   gradcomp::torch::LANS lans(model->parameters(), gradcomp::torch::LayerwiseOptions(2e-3));
//   gradcomp::torch::DistributedOptimizer opt(lans, model->named_parameters(), transport,
//       {.compression = parse_compression("onebit|ef|twoway")});
//
// Contiguous float32 CPU tensors are updated in place by the kernel; others (another device, a
// half-precision dtype) through a float32 CPU copy, with float32 moments.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <string>
#include <tuple>
#include <vector>

#include "gradcomp/optimizer.h"

namespace gradcomp::torch {

struct LayerwiseOptions
    : public ::torch::optim::OptimizerCloneableOptions<LayerwiseOptions> {
  LayerwiseOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit, as torch's options
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 1e-2;  // decoupled, as AdamW's
  TORCH_ARG(bool, bias_correction) = true;
  TORCH_ARG(bool, normalize_grad) = true;  // LANS only: each tensor's gradient to unit norm

 public:
  void serialize(::torch::serialize::InputArchive& archive) override;
  void serialize(::torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  AdamHyper hyper() const;
};

struct LayerwiseParamState
    : public ::torch::optim::OptimizerCloneableParamState<LayerwiseParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);

 public:
  void serialize(::torch::serialize::InputArchive& archive) override;
  void serialize(::torch::serialize::OutputArchive& archive) const override;
};

// What LAMB and LANS share: the state, the loop over parameters, saving and loading.
class LayerwiseAdam : public ::torch::optim::Optimizer {
 public:
  at::Tensor step(LossClosure closure = nullptr) override;
  void save(::torch::serialize::OutputArchive& archive) const override;
  void load(::torch::serialize::InputArchive& archive) override;
  // "LAMB" or "LANS".
  virtual const char* name() const = 0;

 protected:
  LayerwiseAdam(std::vector<::torch::optim::OptimizerParamGroup> groups,
                const LayerwiseOptions& defaults, const char* name);
  virtual LayerStep update(const LayerSlot& layer, int64_t step,
                           const LayerwiseOptions& options) const = 0;
};

class LAMB : public LayerwiseAdam {
 public:
  explicit LAMB(std::vector<::torch::optim::OptimizerParamGroup> groups,
                LayerwiseOptions defaults = {});
  explicit LAMB(std::vector<at::Tensor> params, LayerwiseOptions defaults = {});
  const char* name() const override { return "LAMB"; }

 private:
  LayerStep update(const LayerSlot& layer, int64_t step,
                   const LayerwiseOptions& options) const override;
};

class LANS : public LayerwiseAdam {
 public:
  explicit LANS(std::vector<::torch::optim::OptimizerParamGroup> groups,
                LayerwiseOptions defaults = {});
  explicit LANS(std::vector<at::Tensor> params, LayerwiseOptions defaults = {});
  const char* name() const override { return "LANS"; }

 private:
  LayerStep update(const LayerSlot& layer, int64_t step,
                   const LayerwiseOptions& options) const override;
};

}  // namespace gradcomp::torch
