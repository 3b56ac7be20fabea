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

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "gradcomp/engine.h"
#include "gradcomp/optimizer.h"
#include "gradcomp/transport.h"

namespace gradcomp::torch {

// 0/1 Adam's kappa: exact steps per interval before the interval doubles.
inline constexpr int64_t kDefaultVarianceInterval = 16;
// "freeze" without warmup_steps: 15% of total_steps when given, else this.
inline constexpr int64_t kDefaultWarmupSteps = 1000;

struct OneBitAdamOptions : public ::torch::optim::OptimizerCloneableOptions<OneBitAdamOptions> {
  OneBitAdamOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit, as torch's options
  // Per parameter group (saved with the group): AdamW's hyper-parameters.
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;  // decoupled, as AdamW's
  TORCH_ARG(bool, bias_correction) = true;
  // The optimizer's own (read at construction): which steps are exact, and the exchange.
  TORCH_ARG(std::string, variance) = "freeze";                       // "freeze" or "doubling"
  TORCH_ARG(int64_t, variance_interval) = kDefaultVarianceInterval;  // "doubling"
  // "freeze" only (>= 1); an error under "doubling". Default: 15% of total_steps, else 1000.
  TORCH_ARG(std::optional<int64_t>, warmup_steps) = std::nullopt;
  TORCH_ARG(std::optional<int64_t>, total_steps) = std::nullopt;
  // The momentum's exchange on compressed steps, "codec|feedback|route" without start=.
  TORCH_ARG(std::string, compression) = "onebit:block=256|ef|twoway";
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(int64_t, bucket_bytes) = int64_t{25} << 20;
  TORCH_ARG(int64_t, min_compress_elements) = 16384;  // smaller tensors stay uncompressed
  TORCH_ARG(int64_t, codec_threads) = 1;
  // The compressed steps' Chrome trace (empty: GRADCOMP_TIMELINE, if set); the exact steps'
  // beside it ("trace.json" -> "trace-exact.json"), each per rank as usual.
  TORCH_ARG(std::string, timeline) = "";
  TORCH_ARG(bool, broadcast) = true;  // rank 0's parameters to every rank, at the start

 public:
  void serialize(::torch::serialize::InputArchive& archive) override;
  void serialize(::torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  AdamHyper hyper() const;
};

struct OneBitAdamParamState
    : public ::torch::optim::OptimizerCloneableParamState<OneBitAdamParamState> {
  TORCH_ARG(int64_t, step) = 0;              // updates taken (skipped steps do not count)
  TORCH_ARG(int64_t, variance_updates) = 0;  // of them, exact ones (v's count)
  TORCH_ARG(bool, filled) = false;           // "freeze": v's unseen coordinates were filled
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);

 public:
  void serialize(::torch::serialize::InputArchive& archive) override;
  void serialize(::torch::serialize::OutputArchive& archive) const override;
};

// Whether step `step` (counted from 0) is exact under "doubling": every step for the first
// `interval` exact steps, then every 2nd step for `interval` more, every 4th, ...
bool is_exact_step(int64_t step, int64_t interval);

class OneBitAdam : public ::torch::optim::Optimizer {
 public:
  // A collective: every rank constructs it together, with the same parameters (by name and
  // size, in the same order) and options. Parameters that do not require gradients are
  // skipped; the others must be float32 contiguous CPU tensors (Error naming the parameter
  // otherwise). Bad options are a SpecError naming the option and what is allowed. The two
  // engines (exact, compressed) exchange over `transport` itself, one at a time.
  OneBitAdam(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
             std::shared_ptr<Transport> transport, OneBitAdamOptions options = {});
  ~OneBitAdam() override;

  // Averages over the ranks (a collective), then updates. A step whose average is not finite
  // is skipped on every rank, with a TORCH_WARN; the step clock advances all the same.
  at::Tensor step(LossClosure closure = nullptr) override;
  void save(::torch::serialize::OutputArchive& archive) const override;
  // All or nothing: a state of another policy, interval or warm-up, or not saved by a
  // OneBitAdam (or from another model), is an Error and leaves this optimizer as it was.
  void load(::torch::serialize::InputArchive& archive) override;

  // Whether the next step exchanges the gradient exactly and updates the variance.
  bool exact() const;
  // Whether the variance is frozen for good ("freeze", after the warm-up).
  bool frozen() const;
  int64_t steps() const { return steps_; }  // steps taken, skipped ones included
  const std::string& variance() const { return variance_; }
  int64_t variance_interval() const { return interval_; }
  std::optional<int64_t> warmup_steps() const { return warmup_; }
  // The compressed engine's plan (the exact one has the same buckets, uncompressed).
  const Plan& plan() const;
  // The figures of the last step's exchange (bytes_sent, uncompressed_bytes, ...; finite:
  // every mean was finite, also on exact steps, which the engine does not check itself).
  const StepStats& last_step() const { return last_; }
  Transport& transport() const { return *transport_; }

 private:
  void local_input(size_t i, bool exact);
  void update(size_t i, bool exact, int threads);
  OneBitAdamParamState& state_of(size_t i);

  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;     // exchange order
  std::vector<size_t> group_index_;    // each parameter's group
  std::vector<at::Tensor> exchanged_;  // what each step hands to the engine, then its mean
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Engine> engine_;        // the compressed plan
  std::unique_ptr<Engine> exact_engine_;  // the "none" plan
  std::string variance_;
  int64_t interval_ = kDefaultVarianceInterval;
  std::optional<int64_t> warmup_;  // "freeze" only
  int64_t steps_ = 0;
  StepStats last_{};
};

}  // namespace gradcomp::torch
