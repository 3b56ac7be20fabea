// 1-bit LAMB for libtorch (Li et al. 2021): the counterpart of gradcomp.torch.OneBitLamb
// (python/gradcomp/onebit_lamb.py, docs/optimizers.md). A distributed optimizer of its own:
// step() averages over the ranks, then updates (do not wrap it in DistributedOptimizer, which
// refuses it). Two stages (TwoStageOptimizer, two_stage.h):
//
// - warm-up (the first warmup_steps steps): the gradients are averaged uncompressed and each
//   layer takes LAMB's step (gradcomp::torch::LAMB's, the kernel lamb_step); its trust ratio
//   ||x|| / ||r||, held within [min_coeff, max_coeff], feeds a moving average (decay
//   coeff_beta; the first step's ratio starts it), in double;
// - compression stage: rank r hands over its momentum b1 m + (1 - b1) g_r, averaged through
//   `compression` (by default "onebit:block=256|ef|twoway"), and v stays as it froze (on the
//   first compressed step, its coordinates the warm-up never saw take the mean of the tensor's
//   others). Each layer steps by the warm-up's average ratio, frozen, times a factor that
//   follows a fresh variance of the gradient reconstructed from two averaged momenta (started
//   as a copy of v), within [factor_min, factor_max] and within factor_threshold of the last
//   step's factor (the kernel onebit_lamb_step, gradcomp/optimizer.h).
//
//   auto transport = std::shared_ptr<gradcomp::Transport>(gradcomp::make_transport());
//   gradcomp::torch::OneBitLamb opt(model->named_parameters(), transport,
//                                   gradcomp::torch::OneBitLambOptions(1e-3).total_steps(n));
//   loss.backward(); opt.step(); opt.zero_grad();
//
// save() / load() (torch::save / torch::load) hold the moments, the fresh variance, each
// layer's coefficient and factor, the step clock, the warm-up and the knobs, and the compressed
// engine's state (both sides' error feedback): resuming is bit-exact in either stage.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gradcomp/torch/two_stage.h"

namespace gradcomp::torch {

// LAMB's hyper-parameters per parameter group (lr 1e-3, betas (0.9, 0.999), eps 1e-6,
// weight_decay 0.01, bias_correction) and the exchange's options, as gradcomp::torch::LAMB's
// and OneBitAdam's (TwoStageOptions, two_stage.h); warmup_steps: 15% of total_steps when
// given, else 1000.
struct OneBitLambOptions : public TwoStageOptions<OneBitLambOptions> {
  OneBitLambOptions(double lr = 1e-3)  // NOLINT: implicit, as torch's options
      : TwoStageOptions(lr, /*eps=*/1e-6, /*weight_decay=*/0.01) {}
  // The optimizer's own (read at construction): OneBitLambHyper's (gradcomp/optimizer.h).
  TORCH_ARG(double, coeff_beta) = 0.9;  // the warm-up's moving average of the trust ratios
  TORCH_ARG(double, max_coeff) = 10.0;  // each ratio is held within these before it enters
  TORCH_ARG(double, min_coeff) = 0.01;
  TORCH_ARG(double, factor_max) = 4.0;  // the compression stage's factor's bounds
  TORCH_ARG(double, factor_min) = 0.5;
  TORCH_ARG(double, factor_threshold) = 0.1;  // its largest change from one step to the next

 public:
  OneBitLambHyper lamb_hyper() const;
};

struct OneBitLambParamState : public TwoStageParamStateOf<OneBitLambParamState> {
  TORCH_ARG(double, lamb_coeff) = 0;   // the warm-up's average trust ratio (then frozen)
  TORCH_ARG(double, lamb_factor) = 1;  // the compression stage's last factor
  // v', from the first compressed step on (undefined before).
  TORCH_ARG(at::Tensor, fresh_exp_avg_sq);

 protected:
  void write_extra(::torch::serialize::OutputArchive& archive) const override;
  void read_extra(::torch::serialize::InputArchive& archive) override;
};

class OneBitLamb : public TwoStageOptimizerOf<OneBitLambParamState, OneBitLambOptions> {
 public:
  // A collective: every rank constructs it together, with the same parameters (by name and
  // size, in the same order) and options. Parameters that do not require gradients are
  // skipped; the others must be float32 contiguous CPU tensors (Error naming the parameter
  // otherwise). Bad options are a SpecError naming the option and what is allowed.
  OneBitLamb(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
             std::shared_ptr<Transport> transport, OneBitLambOptions options = {});

  // step(), save(), load() (all or nothing: a state of another warm-up or other knobs, saved
  // by another optimizer (a OneBitAdam) or from another model, is an Error and leaves this
  // optimizer as it was), steps(), plan(), last_step(), transport(): TwoStageOptimizer's.

  // Whether the next step is a warm-up step (exchanged exactly, LAMB's).
  bool exact() const override { return steps() < warmup_; }
  // Whether the warm-up is over: the variance and the coefficients are frozen.
  bool frozen() const { return steps() >= warmup_; }
  int64_t warmup_steps() const { return warmup_; }
  const OneBitLambHyper& lamb_hyper() const { return lamb_hyper_; }

 private:
  std::vector<Setting> settings() const override;
  void update(size_t i, bool exact, int threads) override;
  bool adopt_loaded(TwoStageParamState& state, const at::Tensor& p) const override;
  // The warm-up's average of the layer's trust ratio, each held within the bounds.
  void average_ratio(OneBitLambParamState& state, double ratio) const;

  int64_t warmup_;
  OneBitLambHyper lamb_hyper_;
};

}  // namespace gradcomp::torch
