// 1-bit Adam for libtorch: the counterpart of gradcomp.torch.OneBitAdam (python/gradcomp/
// onebit_adam.py, docs/optimizers.md). A distributed optimizer of its own: step() averages
// over the ranks, then updates (do not wrap it in DistributedOptimizer, which refuses it).
// Each step is one of two kinds, picked alike on every rank by the variance policy:
//
// - exact: the gradients are averaged uncompressed (an engine with a "none" plan); m and v take
//   the mean gradient;
// - compressed: rank r hands over its momentum b1 m + (1 - b1) g_r, averaged through
//   `compression` (by default "onebit:block=256|ef|twoway"), so every rank holds the same m;
//   v stays as it is.
// Either way x -= lr (m^ / (sqrt(v^) + eps) + wd x), v^ corrected by its own number of updates
// (the fused kernels of gradcomp/optimizer.h).
//
// Policies: "freeze" (the default; 1-bit Adam as published: the first warmup_steps steps, then
// v is frozen for good) or "doubling" (0/1 Adam's schedule: exact steps for the first
// variance_interval steps, then every 2nd for variance_interval more, every 4th, ...).
//
//   auto transport = std::shared_ptr<gradcomp::Transport>(gradcomp::make_transport());
//   gradcomp::torch::OneBitAdam opt(model->named_parameters(), transport,
//                                   gradcomp::torch::OneBitAdamOptions(1e-3));
//   loss.backward(); opt.step(); opt.zero_grad();
//
// save() / load() (torch::save / torch::load) hold the moments, the step clock, the policy and
// the compressed engine's state (both sides' error feedback): resuming is bit-exact after a
// step of either kind.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradcomp/torch/two_stage.h"

namespace gradcomp::torch {

// 0/1 Adam's kappa: exact steps per interval before the interval doubles.
inline constexpr int64_t kDefaultVarianceInterval = 16;

// AdamW's hyper-parameters per parameter group (lr, betas, eps 1e-8, weight_decay 0,
// bias_correction) and the exchange's options: TwoStageOptions (two_stage.h).
struct OneBitAdamOptions : public TwoStageOptions<OneBitAdamOptions> {
  OneBitAdamOptions(double lr = 1e-3)  // NOLINT: implicit, as torch's options
      : TwoStageOptions(lr, /*eps=*/1e-8, /*weight_decay=*/0) {}
  // The optimizer's own (read at construction): which steps are exact. warmup_steps applies to
  // "freeze" only (an error under "doubling").
  TORCH_ARG(std::string, variance) = "freeze";                       // "freeze" or "doubling"
  TORCH_ARG(int64_t, variance_interval) = kDefaultVarianceInterval;  // "doubling"
};

struct OneBitAdamParamState : public TwoStageParamStateOf<OneBitAdamParamState> {
  TORCH_ARG(bool, filled) = false;  // "freeze": v's unseen coordinates were filled

 protected:
  void write_extra(::torch::serialize::OutputArchive& archive) const override;
  void read_extra(::torch::serialize::InputArchive& archive) override;
};

// Whether step `step` (counted from 0) is exact under "doubling": every step for the first
// `interval` exact steps, then every 2nd step for `interval` more, every 4th, ...
bool is_exact_step(int64_t step, int64_t interval);

class OneBitAdam : public TwoStageOptimizerOf<OneBitAdamParamState, OneBitAdamOptions> {
 public:
  // A collective: every rank constructs it together, with the same parameters (by name and
  // size, in the same order) and options. Parameters that do not require gradients are
  // skipped; the others must be float32 contiguous CPU tensors (Error naming the parameter
  // otherwise). Bad options are a SpecError naming the option and what is allowed. The two
  // engines (exact, compressed) exchange over `transport` itself, one at a time.
  OneBitAdam(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
             std::shared_ptr<Transport> transport, OneBitAdamOptions options = {});

  // step(), save(), load() (all or nothing: a state of another policy, interval or warm-up, or
  // not saved by a OneBitAdam, or from another model, is an Error and leaves this optimizer as
  // it was), steps(), plan(), last_step(), transport(): TwoStageOptimizer's.

  // Whether the next step exchanges the gradient exactly and updates the variance.
  bool exact() const override;
  // Whether the variance is frozen for good ("freeze", after the warm-up).
  bool frozen() const;
  const std::string& variance() const { return variance_; }
  int64_t variance_interval() const { return interval_; }
  std::optional<int64_t> warmup_steps() const { return warmup_; }

 private:
  std::vector<Setting> settings() const override;
  void update(size_t i, bool exact, int threads) override;

  std::string variance_;
  int64_t interval_ = kDefaultVarianceInterval;
  std::optional<int64_t> warmup_;  // "freeze" only
};

}  // namespace gradcomp::torch
