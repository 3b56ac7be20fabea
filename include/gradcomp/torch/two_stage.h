// What gradcomp's two-stage optimizers for libtorch share: OneBitAdam (onebit_adam.h) and
// OneBitLamb (onebit_lamb.h), as python/gradcomp/two_stage.py is for their Python counterparts.
// Each is a distributed optimizer of its own (DistributedOptimizer refuses to wrap one): step()
// averages over the ranks, then updates, and every step is one of two kinds, picked alike on
// every rank by the subclass's schedule (exact()):
//
// - exact: the gradients are averaged uncompressed (an engine with a "none" plan), and the
//   moments take the mean gradient (the variance learns the gradients' scale);
// - compressed: rank r hands over its momentum b1 m + (1 - b1) g_r, averaged through
//   `compression` (by default scaled 1-bit codes with error feedback on both sides), so every
//   rank holds the same m.
//
// Two engines on one transport carry the two kinds (only one is busy at a time). A step whose
// average is not finite is skipped on every rank. save() / load() hold the moments, the step
// clock, the settings a resumed optimizer must agree with (settings()) and the compressed
// engine's state, so resuming is bit-exact after a step of either kind.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "gradcomp/engine.h"
#include "gradcomp/optimizer.h"
#include "gradcomp/transport.h"

namespace gradcomp::torch {

// Without warmup_steps: 15% of total_steps when given, else this.
inline constexpr int64_t kDefaultWarmupSteps = 1000;

// How the momentum is exchanged (read at construction, the same on every rank).
struct TwoStageExchange {
  std::string compression;  // "codec|feedback|route" without start=
  uint64_t seed = 0;
  int64_t bucket_bytes = 0;
  int64_t min_compress_elements = 0;  // smaller tensors stay uncompressed
  int64_t codec_threads = 1;
  std::string timeline;   // the compressed steps' trace; the exact steps' is "<stem>-exact<ext>"
  bool broadcast = true;  // rank 0's parameters to every rank, at the start
  bool find_unused = false;  // TwoStageOptions::find_unused_parameters
};

// The warm-up's length (>= 1): warmup_steps, else 15% of total_steps, else
// kDefaultWarmupSteps; SpecError naming `optimizer` otherwise (`why`: what the warm-up is for).
// As python/gradcomp/two_stage.py's warmup_steps_of.
int64_t warmup_steps_of(const std::optional<int64_t>& warmup_steps,
                        const std::optional<int64_t>& total_steps, std::string_view optimizer,
                        std::string_view why);

// What a two-stage optimizer reads from its options, whatever their type.
class TwoStageGroupOptions : public ::torch::optim::OptimizerOptions {
 public:
  virtual AdamHyper hyper() const = 0;  // the group's (saved with it)
  virtual TwoStageExchange exchange() const = 0;
};

// A torch-style option of TwoStageOptions: a setter returning the derived options (so calls
// chain as with TORCH_ARG) and getters.
#define GRADCOMP_TWO_STAGE_ARG(T, name)              \
 public:                                             \
  Derived& name(const T& value) {                    \
    name##_ = value;                                 \
    return static_cast<Derived&>(*this);             \
  }                                                  \
  Derived& name(T&& value) {                         \
    name##_ = std::move(value);                      \
    return static_cast<Derived&>(*this);             \
  }                                                  \
  const T& name() const noexcept { return name##_; } \
  T& name() noexcept { return name##_; }             \
                                                     \
 protected:                                          \
  T name##_ /* NOLINT */

// The options both optimizers have; Derived adds its own with TORCH_ARG.
template <typename Derived>
class TwoStageOptions : public TwoStageGroupOptions {
 public:
  using betas_t = std::tuple<double, double>;
  // Per parameter group (saved with the group): Adam's hyper-parameters.
  GRADCOMP_TWO_STAGE_ARG(double, lr);
  GRADCOMP_TWO_STAGE_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  GRADCOMP_TWO_STAGE_ARG(double, eps);
  GRADCOMP_TWO_STAGE_ARG(double, weight_decay);  // decoupled, as AdamW's
  GRADCOMP_TWO_STAGE_ARG(bool, bias_correction) = true;
  // The optimizer's own (read at construction). The warm-up of exact steps (>= 1); default:
  // 15% of total_steps when given, else kDefaultWarmupSteps.
  GRADCOMP_TWO_STAGE_ARG(std::optional<int64_t>, warmup_steps) = std::nullopt;
  GRADCOMP_TWO_STAGE_ARG(std::optional<int64_t>, total_steps) = std::nullopt;
  // The momentum's exchange on compressed steps, "codec|feedback|route" without start=.
  GRADCOMP_TWO_STAGE_ARG(std::string, compression) = "onebit:block=256|ef|twoway";
  GRADCOMP_TWO_STAGE_ARG(uint64_t, seed) = 0;
  GRADCOMP_TWO_STAGE_ARG(int64_t, bucket_bytes) = int64_t{25} << 20;
  GRADCOMP_TWO_STAGE_ARG(int64_t, min_compress_elements) = 16384;
  GRADCOMP_TWO_STAGE_ARG(int64_t, codec_threads) = 1;
  // The compressed steps' Chrome trace (empty: GRADCOMP_TIMELINE, if set); the exact steps'
  // beside it ("trace.json" -> "trace-exact.json"), each per rank as usual.
  GRADCOMP_TWO_STAGE_ARG(std::string, timeline) = "";
  GRADCOMP_TWO_STAGE_ARG(bool, broadcast) = true;
  // As DDP's: a parameter no rank has a gradient for in a step keeps its value, variance and
  // step count, as torch's Adam leaves it (false: it moves by its momentum and weight decay,
  // as if its gradient were 0); one small collective a step. The same on every rank.
  GRADCOMP_TWO_STAGE_ARG(bool, find_unused_parameters) = false;

 public:
  std::unique_ptr<::torch::optim::OptimizerOptions> clone() const override {
    return std::make_unique<Derived>(static_cast<const Derived&>(*this));
  }
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  AdamHyper hyper() const override {
    return {.lr = lr_,
            .beta1 = std::get<0>(betas_),
            .beta2 = std::get<1>(betas_),
            .eps = eps_,
            .weight_decay = weight_decay_,
            .bias_correction = bias_correction_};
  }
  TwoStageExchange exchange() const override {
    return {.compression = compression_,
            .seed = seed_,
            .bucket_bytes = bucket_bytes_,
            .min_compress_elements = min_compress_elements_,
            .codec_threads = codec_threads_,
            .timeline = timeline_,
            .broadcast = broadcast_,
            .find_unused = find_unused_parameters_};
  }
  // Only the per-group hyper-parameters travel with a group (torch's macros name `torch::`,
  // which means gradcomp::torch here: the entries are written out).
  void serialize(::torch::serialize::OutputArchive& archive) const override {
    archive.write("lr", c10::IValue(lr_));
    archive.write("betas", c10::IValue(betas_));
    archive.write("eps", c10::IValue(eps_));
    archive.write("weight_decay", c10::IValue(weight_decay_));
    archive.write("bias_correction", c10::IValue(bias_correction_));
  }
  void serialize(::torch::serialize::InputArchive& archive) override {
    c10::IValue v;
    if (archive.try_read("lr", v)) lr_ = v.toDouble();
    if (archive.try_read("betas", v)) betas_ = v.to<betas_t>();
    if (archive.try_read("eps", v)) eps_ = v.toDouble();
    if (archive.try_read("weight_decay", v)) weight_decay_ = v.toDouble();
    if (archive.try_read("bias_correction", v)) bias_correction_ = v.toBool();
  }

 protected:
  TwoStageOptions(double lr, double eps, double weight_decay)
      : lr_(lr), eps_(eps), weight_decay_(weight_decay) {}
};

#undef GRADCOMP_TWO_STAGE_ARG

// A parameter's state: the moments and their counts; subclasses add theirs (write_extra,
// read_extra: entries of the same archive) and derive from TwoStageParamStateOf<Derived>.
struct TwoStageParamState : public ::torch::optim::OptimizerParamState {
  TORCH_ARG(int64_t, step) = 0;              // updates taken (skipped steps do not count)
  TORCH_ARG(int64_t, variance_updates) = 0;  // of them, exact ones (v's count)
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);

 public:
  void serialize(::torch::serialize::InputArchive& archive) final;
  void serialize(::torch::serialize::OutputArchive& archive) const final;

 protected:
  virtual void write_extra(::torch::serialize::OutputArchive& /*archive*/) const {}
  virtual void read_extra(::torch::serialize::InputArchive& /*archive*/) {}
};

template <typename Derived>
struct TwoStageParamStateOf : public TwoStageParamState {
  std::unique_ptr<::torch::optim::OptimizerParamState> clone() const override {
    return std::make_unique<Derived>(static_cast<const Derived&>(*this));
  }
};

class TwoStageOptimizer : public ::torch::optim::Optimizer {
 public:
  ~TwoStageOptimizer() override;

  // Averages over the ranks (a collective), then updates. A step whose average is not finite
  // is skipped on every rank, with a TORCH_WARN; the step clock advances all the same.
  at::Tensor step(LossClosure closure = nullptr) override;
  // The moments (the same on every rank) and this rank's error feedback: every rank saves its
  // own file (torch::save(opt, path)).
  void save(::torch::serialize::OutputArchive& archive) const override;
  // The same with every rank's error feedback, gathered: a collective (every rank calls it),
  // after which rank 0 alone may write the one file every rank resumes from; load() takes
  // this rank's part.
  void save_all_ranks(::torch::serialize::OutputArchive& archive);
  // All or nothing: a state of other settings, saved by another optimizer (or from another
  // model, or by all the ranks of a world of another size), is an Error and leaves this
  // optimizer as it was.
  void load(::torch::serialize::InputArchive& archive) override;

  // Whether the next step exchanges the gradient exactly and updates the variance.
  virtual bool exact() const = 0;
  int64_t steps() const { return steps_; }  // steps taken, skipped ones included
  // The compressed engine's plan (the exact one has the same buckets, uncompressed).
  const Plan& plan() const;
  // The figures of the last step's exchange (bytes_sent, uncompressed_bytes, ...; finite:
  // every mean was finite).
  const StepStats& last_step() const { return last_; }
  Transport& transport() const { return *transport_; }
  const std::string& name() const { return name_; }  // "OneBitAdam", "OneBitLamb"

 protected:
  // A collective: every rank constructs it together, with the same parameters (by name and
  // size, in the same order) and options. Parameters that do not require gradients are
  // skipped; the others must be float32 contiguous CPU tensors (Error naming the parameter
  // otherwise). Bad exchange options are a SpecError naming the option; `schedule` names what
  // sets the exact steps, for the refusal of a compression with a start= of its own.
  TwoStageOptimizer(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                    std::shared_ptr<Transport> transport, const TwoStageGroupOptions& defaults,
                    std::string name, std::string_view schedule);

  // A setting a checkpoint holds and a resumed optimizer must agree with (an int, a double or
  // a string). An entry "optimizer" names the class; a state without one was saved by a
  // OneBitAdam (whose format predates the entry).
  struct Setting {
    std::string key;
    c10::IValue value;
  };
  virtual std::vector<Setting> settings() const = 0;
  // Parameter i after a step of the given kind: exchanged(i) holds the mean gradient (exact)
  // or the mean momentum (compressed).
  virtual void update(size_t i, bool exact, int threads) = 0;
  virtual std::unique_ptr<TwoStageParamState> new_state() const = 0;
  // torch's serialisation of the groups and states, with the subclass's types.
  virtual void save_states(::torch::serialize::OutputArchive& archive) const = 0;
  virtual void load_states(::torch::serialize::InputArchive& archive) = 0;
  // Whether a loaded state's own entries fit parameter p (the moments are checked here); may
  // make its tensors contiguous.
  virtual bool adopt_loaded(TwoStageParamState& /*state*/, const at::Tensor& /*p*/) const {
    return true;
  }

  TwoStageParamState& param_state(size_t i);  // made by new_state() with zero moments
  const at::Tensor& param(size_t i) const { return params_[i]; }
  const at::Tensor& exchanged(size_t i) const { return exchanged_[i]; }
  AdamHyper hyper_of(size_t i) const;  // parameter i's group's
  // {param, exchanged, exp_avg, exp_avg_sq} of parameter i, as float spans.
  LayerSlot layer(size_t i);

  static std::span<float> float_span(const at::Tensor& t);
  // Coordinates whose gradient was always 0 before the variance froze (an embedding row not
  // seen yet) have v = 0: frozen so, their first gradient would step by m / eps. They take the
  // mean of the tensor's other variances (in double, single-threaded, in numpy's pairwise order
  // as the Python front end: the same bits on every rank).
  static void fill_unseen(const at::Tensor& v);

 private:
  void local_input(size_t i, bool exact);
  // Throws Error naming a parameter whose requires_grad changed since construction in a way
  // the step would get wrong: left out then and with a gradient now (never updated), or
  // exchanged and now frozen without a gradient (moved by its momentum and weight decay).
  void check_trainable(const std::vector<uint8_t>& unused) const;
  // find_unused_parameters: 1 for each parameter no rank had a gradient for (a collective);
  // all 0 without the option.
  std::vector<uint8_t> unused_everywhere() const;
  // A parameter no rank used keeps its value, variance and step count; what the exchange gave
  // it is kept in its momentum (two_stage.cpp).
  void leave(size_t i, bool exact);
  void agree_on_find_unused() const;
  // Whether parameter i's variance holds more than zeros: some exact step updated it with a
  // gradient not all 0. Not so for a parameter first used after the warm-up: with
  // find_unused_parameters no exact step updated it; without, they all averaged zeros (no rank
  // had a gradient), and so did one whose exact steps were all skipped. A compressed step
  // divides by that variance (a step of m / eps, clamped: a sign-like step of about 3 lr in
  // every coordinate, for the codes' error alone where it has no gradient). The same on every
  // rank (the states are).
  bool learned(size_t i);
  // On a compressed step: the parameters not left alone (`unused`) whose variance has learned
  // nothing. Each takes an exact step of its own instead; the same list on every rank (the
  // states are, and so is `unused`).
  std::vector<size_t> unlearned(const std::vector<uint8_t>& unused);
  // The mean over the ranks of those parameters' gradients (zeros where this rank has none),
  // concatenated, uncompressed, as an exact step's exchange would give. They handed the
  // compressed exchange b1 m, as a parameter without a gradient does (local_input), so nothing
  // of the gradient goes twice. The ranks first agree which of them some rank has a gradient
  // for (one small allreduce): only those are averaged (one allreduce); the others' mean is 0,
  // so a parameter no rank uses (without find_unused_parameters) costs no exchange of zeros.
  at::Tensor exact_means(const std::vector<size_t>& unlearned) const;
  // 1 for each of these parameters that some rank has a gradient for (a collective).
  std::vector<uint8_t> some_rank_has_gradient(const std::vector<size_t>& indices) const;
  // Parameter i's exact step of its own, on its `mean` gradient (two_stage.cpp).
  void step_exactly_alone(size_t i, const at::Tensor& mean, int threads);
  // save() and save_all_ranks(): the gradcomp part with these engine states (one: this rank's,
  // written as "engine"; else every rank's, as "engine.<rank>").
  void write_state(::torch::serialize::OutputArchive& archive,
                   const std::vector<std::vector<std::byte>>& engine_states, bool all) const;
  // load(): this rank's engine state of the gradcomp part, either form.
  at::Tensor engine_state_of(::torch::serialize::InputArchive& ours) const;

  std::string name_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;     // exchange order
  // Required no gradient at construction, so not exchanged (check_trainable).
  std::vector<std::pair<std::string, at::Tensor>> left_out_;
  std::vector<size_t> group_index_;    // each parameter's group
  std::vector<at::Tensor> exchanged_;  // what each step hands to the engine, then its mean
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Engine> engine_;        // the compressed plan
  std::unique_ptr<Engine> exact_engine_;  // the "none" plan
  bool find_unused_ = false;
  // Parameters whose variance is known to hold more than zeros (learned()): found once, as it
  // never returns to zeros; load() forgets them.
  std::vector<uint8_t> learned_variance_;
  int64_t steps_ = 0;
  StepStats last_{};
};

// A subclass's types: State (a TwoStageParamState) and Options (a TwoStageOptions<Options>).
template <typename State, typename Options>
class TwoStageOptimizerOf : public TwoStageOptimizer {
 protected:
  using TwoStageOptimizer::TwoStageOptimizer;
  State& state_of(size_t i) { return static_cast<State&>(param_state(i)); }

 private:
  std::unique_ptr<TwoStageParamState> new_state() const override {
    return std::make_unique<State>();
  }
  void save_states(::torch::serialize::OutputArchive& archive) const override {
    ::torch::optim::serialize<State, Options>(archive, *this);
  }
  void load_states(::torch::serialize::InputArchive& archive) override {
    ::torch::optim::serialize<State, Options>(archive, *this);
  }
};

}  // namespace gradcomp::torch
