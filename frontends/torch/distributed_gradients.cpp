// DistributedGradients: parameters -> plan -> engine, and a post hook on each parameter's
// gradient accumulator that hands the accumulated gradient to the engine.
#include "gradcomp/torch/distributed_gradients.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <mutex>

#include "gradcomp/error.h"

namespace gradcomp::torch {

struct DistributedGradients::Shared {
  std::shared_ptr<Transport> transport;
  std::vector<std::string> names;        // plan order
  std::vector<at::Tensor> parameters;    // plan order
  std::vector<int> backward_passes;      // per tensor, since its last hand-over
  std::vector<bool> handed;              // handed to the engine this step
  std::vector<std::shared_ptr<::torch::autograd::Node>> accumulators;  // keep our hooks alive
  int passes_per_step = 1;
  std::unique_ptr<Engine> engine;
  std::mutex mutex;  // hooks may run on autograd's worker threads

  void hand_over(size_t index);
  void before_accumulation(size_t index);
  void on_accumulated(size_t index);
};

namespace {

std::string describe(const at::Tensor& t) {
  return fmt::format("{} {} on {}", std::string(c10::toString(t.scalar_type())),
                     t.is_sparse() ? "sparse" : "dense", t.device().str());
}

// Runs after autograd accumulated a parameter's gradient into .grad.
class AccumulatedHook final : public ::torch::autograd::FunctionPostHook {
 public:
  AccumulatedHook(std::weak_ptr<DistributedGradients::Shared> shared, size_t index)
      : shared_(std::move(shared)), index_(index) {}
  ::torch::autograd::variable_list operator()(
      const ::torch::autograd::variable_list& outputs,
      const ::torch::autograd::variable_list& /*inputs*/) override {
    if (auto shared = shared_.lock()) shared->on_accumulated(index_);
    return outputs;
  }

 private:
  std::weak_ptr<DistributedGradients::Shared> shared_;
  size_t index_;
};

// Runs before autograd adds a new gradient into .grad: a gradient already handed over must not
// change while the engine may still read it (or work in it).
class BeforeAccumulationHook final : public ::torch::autograd::FunctionPreHook {
 public:
  BeforeAccumulationHook(std::weak_ptr<DistributedGradients::Shared> shared, size_t index)
      : shared_(std::move(shared)), index_(index) {}
  ::torch::autograd::variable_list operator()(
      const ::torch::autograd::variable_list& grads) override {
    if (auto shared = shared_.lock()) shared->before_accumulation(index_);
    return grads;
  }

 private:
  std::weak_ptr<DistributedGradients::Shared> shared_;
  size_t index_;
};

void check_parameter(const std::string& name, const at::Tensor& p) {
  if (p.scalar_type() != at::kFloat || p.is_sparse() || !p.device().is_cpu()) {
    throw Error(fmt::format(
        "parameter '{}' is {}; gradcomp exchanges dense float32 CPU gradients (convert the "
        "model with .float(), or leave the parameter out / set requires_grad=False)",
        name, describe(p)));
  }
  if (!p.is_leaf()) {
    throw Error(fmt::format("parameter '{}' is not a leaf tensor; pass the model's parameters",
                            name));
  }
}

Plan make_plan(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
               const GradientOptions& options) {
  std::vector<TensorInfo> tensors;
  for (size_t i = 0; i < names.size(); ++i) {
    tensors.push_back({names[i], static_cast<size_t>(params[i].numel())});
  }
  if (!options.plan) {
    DefaultPlanSettings settings;
    settings.bucket_bytes = options.bucket_bytes;
    settings.min_compress_elements = options.min_compress_elements;
    settings.compressed = options.compression;
    return make_default_plan(std::move(tensors), settings);
  }
  // A given plan must cover exactly the trainable parameters.
  std::map<std::string, size_t> ours;
  for (const auto& t : tensors) ours[t.name] = t.elements;
  for (const auto& t : options.plan->tensors) {
    auto it = ours.find(t.name);
    if (it == ours.end()) {
      throw Error(fmt::format("plan tensor '{}' is not a trainable parameter of the model",
                              t.name));
    }
    if (it->second != t.elements) {
      throw Error(fmt::format("plan tensor '{}' has {} elements, the parameter has {}", t.name,
                              t.elements, it->second));
    }
    ours.erase(it);
  }
  if (!ours.empty()) {
    throw Error(fmt::format("parameter '{}' is in no bucket of the plan", ours.begin()->first));
  }
  return *options.plan;
}

}  // namespace

Option parse_compression(const std::string& text) { return parse_option(text); }

void DistributedGradients::Shared::hand_over(size_t index) {
  at::Tensor grad = parameters[index].grad();
  if (grad.is_sparse()) {
    throw Error(fmt::format(
        "gradcomp: parameter '{}' has a sparse gradient; gradcomp exchanges dense gradients (use "
        "nn.Embedding(sparse=False), or set requires_grad=False on it)",
        names[index]));
  }
  if (grad.scalar_type() != at::kFloat || !grad.is_contiguous() ||
      grad.numel() != parameters[index].numel()) {
    // A gradient autograd made non-contiguous (or a user-assigned one): make it a plain
    // float32 buffer the engine can write the mean into, in place of the old one.
    grad = grad.to(at::kFloat).contiguous().reshape_as(parameters[index]);
    parameters[index].mutable_grad() = grad;
  }
  engine->ready(index, std::span<float>(grad.data_ptr<float>(), grad.numel()));
  handed[index] = true;
}

void DistributedGradients::Shared::before_accumulation(size_t index) {
  std::lock_guard lock(mutex);
  if (handed[index]) {
    throw Error(fmt::format(
        "gradcomp: parameter '{}' got a gradient again after it was handed over for this "
        "step (its .grad is left as it was); call optimizer.step() (or synchronize()) between "
        "steps, or set backward_passes_per_step for gradient accumulation",
        names[index]));
  }
}

void DistributedGradients::Shared::on_accumulated(size_t index) {
  std::lock_guard lock(mutex);
  if (++backward_passes[index] < passes_per_step) return;
  hand_over(index);
}

DistributedGradients::DistributedGradients(NamedParameters parameters,
                                           std::shared_ptr<Transport> transport,
                                           GradientOptions options)
    : shared_(std::make_shared<Shared>()) {
  if (!transport) throw Error("DistributedGradients: the transport is null");
  if (options.backward_passes_per_step < 1) {
    throw Error(fmt::format("backward_passes_per_step is {}; it must be at least 1",
                            options.backward_passes_per_step));
  }
  Shared& s = *shared_;
  s.transport = std::move(transport);
  s.passes_per_step = options.backward_passes_per_step;
  // Backward order: the last registered parameters get their gradients first.
  for (auto it = parameters.rbegin(); it != parameters.rend(); ++it) {
    if (!it->second.requires_grad()) continue;
    check_parameter(it->first, it->second);
    s.names.push_back(it->first);
    s.parameters.push_back(it->second);
  }
  if (s.names.empty()) throw Error("DistributedGradients: no parameter requires a gradient");
  Plan plan = make_plan(s.names, s.parameters, options);
  // The engine's tensor indices follow the plan; map our parameters onto them by name.
  std::map<std::string, size_t> index_of;
  for (size_t i = 0; i < s.names.size(); ++i) index_of[s.names[i]] = i;
  std::vector<at::Tensor> ordered;
  std::vector<std::string> names;
  for (const auto& t : plan.tensors) {
    ordered.push_back(s.parameters[index_of.at(t.name)]);
    names.push_back(t.name);
  }
  s.parameters = std::move(ordered);
  s.names = std::move(names);
  s.backward_passes.assign(s.names.size(), 0);
  s.handed.assign(s.names.size(), false);
  s.engine = std::make_unique<Engine>(s.transport, std::move(plan), options.engine);
  for (size_t i = 0; i < s.parameters.size(); ++i) {
    auto accumulator = ::torch::autograd::impl::grad_accumulator(s.parameters[i]);
    accumulator->add_pre_hook(std::make_unique<BeforeAccumulationHook>(shared_, i));
    accumulator->add_post_hook(std::make_unique<AccumulatedHook>(shared_, i));
    s.accumulators.push_back(std::move(accumulator));
  }
}

DistributedGradients::~DistributedGradients() = default;

void DistributedGradients::synchronize() {
  Shared& s = *shared_;
  std::lock_guard lock(s.mutex);
  for (size_t i = 0; i < s.parameters.size(); ++i) {
    if (s.handed[i]) continue;
    // Not produced this step (an unused parameter, or fewer backward passes than configured):
    // every rank must still contribute, so hand over what .grad holds, or zeros.
    if (!s.parameters[i].grad().defined()) {
      s.parameters[i].mutable_grad() = at::zeros_like(s.parameters[i]);
    }
    s.hand_over(i);
  }
  std::fill(s.handed.begin(), s.handed.end(), false);
  std::fill(s.backward_passes.begin(), s.backward_passes.end(), 0);
  s.engine->synchronize();
}

bool DistributedGradients::pending() const {
  std::lock_guard lock(shared_->mutex);
  for (bool h : shared_->handed) {
    if (h) return true;
  }
  for (int p : shared_->backward_passes) {
    if (p > 0) return true;
  }
  return false;
}

void DistributedGradients::set_learning_rate(double lr) { shared_->engine->set_learning_rate(lr); }
const Plan& DistributedGradients::plan() const { return shared_->engine->plan(); }
const StepStats& DistributedGradients::last_step() const { return shared_->engine->last_step(); }
uint64_t DistributedGradients::steps() const { return shared_->engine->step(); }
Transport& DistributedGradients::transport() const { return *shared_->transport; }
std::vector<std::byte> DistributedGradients::save_state() const {
  return shared_->engine->save_state();
}
void DistributedGradients::load_state(std::span<const std::byte> state) {
  shared_->engine->load_state(state);
}
void DistributedGradients::set_timeline(const std::string& path) {
  shared_->engine->set_timeline(path);
}

}  // namespace gradcomp::torch
