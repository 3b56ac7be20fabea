// OneBitAdam (libtorch): two engines on one transport, the variance policy picks one per step,
// then the fused kernels of gradcomp/optimizer.h update. The same algorithm as
// python/gradcomp/onebit_adam.py.
#include "gradcomp/torch/onebit_adam.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <span>
#include <utility>

#include "gradcomp/error.h"
#include "gradcomp/plan.h"

namespace gradcomp::torch {
namespace {

namespace o = ::torch::optim;

constexpr int64_t kStateVersion = 2;
constexpr double kDefaultWarmupFraction = 0.15;  // DeepSpeed's BERT runs froze after 15-25%

std::span<float> float_span(const at::Tensor& t) {
  return {t.data_ptr<float>(), static_cast<size_t>(t.numel())};
}

void check_range(const char* what, int64_t value, int64_t low, int64_t high) {
  if (value < low || value > high) {
    throw SpecError(fmt::format("OneBitAdam: {} is {}; allowed: an integer in [{}, {}]", what,
                                value, low, high));
  }
}

// The warm-up under "freeze" (nullopt under "doubling"), after checking the policy's options.
std::optional<int64_t> checked_policy(const OneBitAdamOptions& o) {
  if (o.variance() != "freeze" && o.variance() != "doubling") {
    throw SpecError(
        fmt::format("OneBitAdam: variance is '{}'; allowed: 'freeze', 'doubling'", o.variance()));
  }
  if (o.variance_interval() < 1) {
    throw SpecError(fmt::format("OneBitAdam: variance_interval is {}; allowed: an int >= 1",
                                o.variance_interval()));
  }
  if (o.variance() == "doubling") {
    if (o.warmup_steps()) {
      throw SpecError(
          "OneBitAdam: warmup_steps applies to variance=\"freeze\"; the \"doubling\" policy's "
          "exact steps are set by variance_interval");
    }
    return std::nullopt;
  }
  if (o.warmup_steps()) {
    if (*o.warmup_steps() < 1) {
      throw SpecError(fmt::format(
          "OneBitAdam: warmup_steps is {}; allowed: an int >= 1 (Adam's variance must see "
          "gradients before it freezes)",
          *o.warmup_steps()));
    }
    return *o.warmup_steps();
  }
  if (!o.total_steps()) return kDefaultWarmupSteps;
  if (*o.total_steps() < 1) {
    throw SpecError(
        fmt::format("OneBitAdam: total_steps is {}; allowed: an int >= 1", *o.total_steps()));
  }
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(
                                  kDefaultWarmupFraction * static_cast<double>(*o.total_steps()))));
}

// The compressed steps' option; a start= of its own would make some of them exact.
Option compressed_option(const std::string& compression) {
  Option option = parse_option(compression);
  if (option.start_step != 0) {
    throw SpecError(
        fmt::format("OneBitAdam: compression '{}' has its own start=; which steps are exact is the "
                    "variance policy's (warmup_steps, variance_interval)",
                    compression));
  }
  return option;
}

// A pairwise sum in double in numpy's order (8 lanes up to 128 elements, halves above), the
// order of the Python front end's np.sum (not compared with numpy by a test); single-threaded,
// hence the same bits on every rank whatever the thread count.
double pairwise_sum(const double* a, size_t n) {
  if (n < 8) {
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += a[i];
    return sum;
  }
  if (n <= 128) {
    double r[8];
    for (size_t j = 0; j < 8; ++j) r[j] = a[j];
    size_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (size_t j = 0; j < 8; ++j) r[j] += a[i + j];
    }
    double sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) sum += a[i];
    return sum;
  }
  size_t half = n / 2;
  half -= half % 8;
  return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

// Coordinates whose gradient was always 0 in the warm-up have v = 0: frozen so, their first
// gradient would step by m / eps. They take the mean of the tensor's other variances.
void fill_unseen(const at::Tensor& v) {
  float* data = v.data_ptr<float>();
  const auto n = static_cast<size_t>(v.numel());
  std::vector<double> seen;
  seen.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (data[i] != 0.0f) seen.push_back(static_cast<double>(data[i]));
  }
  if (seen.empty() || seen.size() == n) return;
  const auto fill =
      static_cast<float>(pairwise_sum(seen.data(), seen.size()) / static_cast<double>(seen.size()));
  for (size_t i = 0; i < n; ++i) {
    if (data[i] == 0.0f) data[i] = fill;
  }
}

// The exact steps' Chrome trace: beside the compressed steps' ("trace.json" ->
// "trace-exact.json"), not over it; "" when there is none (as Python's os.path.splitext).
std::string exact_trace(const std::string& timeline) {
  if (timeline.empty()) return "";
  const size_t slash = timeline.rfind('/');
  size_t base = slash == std::string::npos ? 0 : slash + 1;
  while (base < timeline.size() && timeline[base] == '.') ++base;  // a leading dot is no suffix
  const size_t dot = timeline.rfind('.');
  if (dot == std::string::npos || dot < base) return timeline + "-exact";
  return timeline.substr(0, dot) + "-exact" + timeline.substr(dot);
}

at::Tensor bytes_tensor(const std::vector<std::byte>& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::vector<std::byte> tensor_bytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  TORCH_CHECK(c.scalar_type() == at::kByte, "OneBitAdam: the engine state is not bytes");
  const auto* data = static_cast<const std::byte*>(c.data_ptr());
  return {data, data + c.numel()};
}

}  // namespace

AdamHyper OneBitAdamOptions::hyper() const {
  return {.lr = lr(),
          .beta1 = std::get<0>(betas()),
          .beta2 = std::get<1>(betas()),
          .eps = eps(),
          .weight_decay = weight_decay(),
          .bias_correction = bias_correction()};
}

// Only the per-group hyper-parameters travel with a group (torch's macros name `torch::`,
// which means gradcomp::torch here: the entries are written out).
void OneBitAdamOptions::serialize(::torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("betas", c10::IValue(betas()));
  archive.write("eps", c10::IValue(eps()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("bias_correction", c10::IValue(bias_correction()));
}

void OneBitAdamOptions::serialize(::torch::serialize::InputArchive& archive) {
  c10::IValue v;
  if (archive.try_read("lr", v)) lr(v.toDouble());
  if (archive.try_read("betas", v)) betas(v.to<betas_t>());
  if (archive.try_read("eps", v)) eps(v.toDouble());
  if (archive.try_read("weight_decay", v)) weight_decay(v.toDouble());
  if (archive.try_read("bias_correction", v)) bias_correction(v.toBool());
}

void OneBitAdamParamState::serialize(::torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  archive.write("variance_updates", c10::IValue(variance_updates()));
  archive.write("filled", c10::IValue(filled()));
  archive.write("exp_avg", exp_avg());
  archive.write("exp_avg_sq", exp_avg_sq());
}

void OneBitAdamParamState::serialize(::torch::serialize::InputArchive& archive) {
  c10::IValue v;
  if (archive.try_read("step", v)) step(v.toInt());
  if (archive.try_read("variance_updates", v)) variance_updates(v.toInt());
  if (archive.try_read("filled", v)) filled(v.toBool());
  at::Tensor m;
  if (archive.try_read("exp_avg", m)) exp_avg(m);
  at::Tensor s;
  if (archive.try_read("exp_avg_sq", s)) exp_avg_sq(s);
}

bool is_exact_step(int64_t step, int64_t interval) {
  int64_t begin = 0;
  int64_t every = 1;
  while (step >= begin + interval * every) {
    begin += interval * every;
    every *= 2;
  }
  return (step - begin) % every == 0;
}

namespace {

// The trainable parameters, checked: float32 contiguous CPU, distinct names.
std::vector<std::pair<std::string, at::Tensor>> trainable(
    const ::torch::OrderedDict<std::string, at::Tensor>& named) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<std::string> names;
  for (const auto& item : named) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    if (p.scalar_type() != at::kFloat || !p.device().is_cpu() || p.is_sparse() ||
        !p.is_contiguous()) {
      throw Error(
          fmt::format("OneBitAdam: parameter '{}' is a {}{} tensor on {}; float32 contiguous CPU "
                      "parameters only (convert the model with ->to(torch::kFloat))",
                      item.key(), c10::toString(p.scalar_type()),
                      p.is_contiguous() ? "" : " non-contiguous", p.device().str()));
    }
    if (!names.insert(item.key()).second) {
      throw Error(fmt::format("OneBitAdam: parameter name '{}' appears twice", item.key()));
    }
    out.emplace_back(item.key(), p);
  }
  if (out.empty()) throw Error("OneBitAdam: no parameters that require gradients");
  return out;
}

std::vector<at::Tensor> values_of(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> v;
  for (const auto& [name, p] : named) v.push_back(p);
  return v;
}

Plan plan_of(const std::vector<std::pair<std::string, at::Tensor>>& named, const Option& option,
             const OneBitAdamOptions& o) {
  std::vector<TensorInfo> tensors;
  for (const auto& [name, p] : named) {
    const auto sizes = p.sizes();
    tensors.push_back(
        {name, static_cast<size_t>(p.numel()), std::vector<size_t>(sizes.begin(), sizes.end())});
  }
  DefaultPlanSettings settings;
  settings.bucket_bytes = static_cast<size_t>(o.bucket_bytes());
  settings.min_compress_elements = static_cast<size_t>(o.min_compress_elements());
  settings.compressed = option;
  return make_default_plan(std::move(tensors), settings);
}

// Checks everything before the base class is built (and before any collective).
const OneBitAdamOptions& checked(const OneBitAdamOptions& o) {
  check_adam_hyper(o.hyper(), "OneBitAdam");
  checked_policy(o);
  check_range("bucket_bytes", o.bucket_bytes(), 1, int64_t{1} << 40);
  check_range("min_compress_elements", o.min_compress_elements(), 0, int64_t{1} << 62);
  check_range("codec_threads", o.codec_threads(), 1, 1024);
  compressed_option(o.compression());
  return o;
}

}  // namespace

OneBitAdam::OneBitAdam(const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                       std::shared_ptr<Transport> transport, OneBitAdamOptions options)
    : Optimizer({o::OptimizerParamGroup(values_of(trainable(named_parameters)))},
                std::make_unique<OneBitAdamOptions>(checked(options))),
      transport_(std::move(transport)),
      variance_(options.variance()),
      interval_(options.variance_interval()),
      warmup_(checked_policy(options)) {
  if (!transport_) throw Error("OneBitAdam: no transport");
  for (auto& [name, p] : trainable(named_parameters)) {
    names_.push_back(name);
    params_.push_back(p);
    group_index_.push_back(0);
    exchanged_.push_back(at::empty_like(p, at::MemoryFormat::Contiguous));
  }
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (size_t i = 0; i < params_.size(); ++i) named.emplace_back(names_[i], params_[i]);
  EngineOptions engine;
  engine.seed = options.seed();
  engine.codec_threads = static_cast<int>(options.codec_threads());
  // Only one engine is busy at a time (step() waits for it) and every rank picks the same one.
  engine.timeline = options.timeline();
  if (engine.timeline.empty()) {
    const char* env = std::getenv("GRADCOMP_TIMELINE");
    if (env != nullptr) engine.timeline = env;
  }
  engine_ = std::make_unique<Engine>(
      transport_, plan_of(named, compressed_option(options.compression()), options), engine);
  engine.timeline = exact_trace(engine.timeline);
  exact_engine_ = std::make_unique<Engine>(transport_, plan_of(named, Option{}, options), engine);
  if (options.broadcast()) {
    at::NoGradGuard no_grad;
    for (const auto& p : params_) {
      std::span<std::byte> bytes{static_cast<std::byte*>(p.data_ptr()),
                                 static_cast<size_t>(p.numel()) * sizeof(float)};
      transport_->broadcast(bytes, 0)->wait(transport_->timeout());
    }
  }
}

OneBitAdam::~OneBitAdam() {
  // Their threads end before the transport may be released.
  engine_.reset();
  exact_engine_.reset();
}

bool OneBitAdam::exact() const {
  if (warmup_) return steps_ < *warmup_;
  return is_exact_step(steps_, interval_);
}

bool OneBitAdam::frozen() const { return warmup_ && steps_ >= *warmup_; }

const Plan& OneBitAdam::plan() const { return engine_->plan(); }

OneBitAdamParamState& OneBitAdam::state_of(size_t i) {
  const at::Tensor& p = params_[i];
  auto& slot = state_[c10::guts::to_string(p.unsafeGetTensorImpl())];
  if (!slot) {
    auto fresh = std::make_unique<OneBitAdamParamState>();
    fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Contiguous));
    fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
    slot = std::move(fresh);
  }
  return static_cast<OneBitAdamParamState&>(*slot);
}

at::Tensor OneBitAdam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // Everything that can be refused is refused before this rank hands anything over.
  for (const auto& group : param_groups_) {
    check_adam_hyper(static_cast<const OneBitAdamOptions&>(group.options()).hyper(),
                     "OneBitAdam");  // a scheduler or the caller may change them
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    if (grad.defined() && (grad.is_sparse() || !grad.device().is_cpu())) {
      throw Error(
          fmt::format("OneBitAdam: parameter '{}' has a {} gradient; dense CPU "
                      "gradients only",
                      names_[i], grad.is_sparse() ? "sparse" : grad.device().str()));
    }
  }
  const bool is_exact = exact();
  Engine& engine = is_exact ? *exact_engine_ : *engine_;
  for (size_t i = 0; i < params_.size(); ++i) {
    local_input(i, is_exact);
    engine.ready(names_[i], float_span(exchanged_[i]));
  }
  engine.synchronize();
  ++steps_;
  last_ = engine.last_step();
  // The engine checks every mean (the same bits on every rank): every rank decides alike.
  if (!last_.finite) {
    TORCH_WARN(
        "gradcomp: OneBitAdam: this step's average is not finite (an overflow on some "
        "rank): the step is skipped on every rank");
    return loss;
  }
  const int threads = at::get_num_threads();
  for (size_t i = 0; i < params_.size(); ++i) update(i, is_exact, threads);
  return loss;
}

// What this rank hands over for parameter i: its gradient (zeros when it has none) on an exact
// step, its momentum b1 m + (1 - b1) g on a compressed one.
void OneBitAdam::local_input(size_t i, bool is_exact) {
  at::Tensor& out = exchanged_[i];
  const at::Tensor& grad = params_[i].grad();
  OneBitAdamParamState& state = state_of(i);
  if (is_exact) {
    if (grad.defined()) {
      out.copy_(grad);
    } else {
      out.zero_();
    }
    return;
  }
  const auto& group =
      static_cast<const OneBitAdamOptions&>(param_groups_[group_index_[i]].options());
  const double beta1 = std::get<0>(group.betas());
  if (grad.defined()) {
    at::lerp_out(out, grad, state.exp_avg(), beta1);  // b1 m + (1 - b1) g
  } else {
    at::mul_out(out, state.exp_avg(), beta1);
  }
}

void OneBitAdam::update(size_t i, bool is_exact, int threads) {
  OneBitAdamParamState& state = state_of(i);
  state.step(state.step() + 1);
  const auto& group =
      static_cast<const OneBitAdamOptions&>(param_groups_[group_index_[i]].options());
  const AdamHyper hyper = group.hyper();
  const at::Tensor& p = params_[i];
  if (is_exact) {  // m and v take the mean gradient
    state.variance_updates(state.variance_updates() + 1);
    const LayerSlot slot{float_span(p), float_span(exchanged_[i]), float_span(state.exp_avg()),
                         float_span(state.exp_avg_sq())};
    if (state.variance_updates() == state.step()) {  // every step so far was exact
      adamw_step(slot, state.step(), hyper, threads);
    } else {
      zero_one_adam_step(slot, state.step(), state.variance_updates(), true, hyper, threads);
    }
    return;
  }
  if (state.variance_updates() < 1) {
    throw Error(
        "OneBitAdam: a compressed step came before any exact step updated the variance "
        "(every exact step so far was skipped: non-finite averages)");
  }
  if (frozen() && !state.filled()) {
    fill_unseen(state.exp_avg_sq());  // it will not learn them any more
    state.filled(true);
  }
  state.exp_avg().copy_(exchanged_[i]);  // the averaged momentum, the same on every rank
  const LayerSlot slot{
      float_span(p), {}, float_span(state.exp_avg()), float_span(state.exp_avg_sq())};
  frozen_adam_step(slot, state.step(), state.variance_updates(), hyper, threads);
}

void OneBitAdam::save(::torch::serialize::OutputArchive& archive) const {
  o::serialize<OneBitAdamParamState, OneBitAdamOptions>(archive, *this);
  ::torch::serialize::OutputArchive ours;
  ours.write("version", c10::IValue(kStateVersion));
  ours.write("steps", c10::IValue(steps_));
  ours.write("variance", c10::IValue(variance_));
  ours.write("variance_interval", c10::IValue(interval_));
  ours.write("warmup_steps", c10::IValue(warmup_.value_or(0)));  // 0: none ("doubling")
  ours.write("engine", bytes_tensor(engine_->save_state()));
  archive.write("gradcomp", ours);
}

void OneBitAdam::load(::torch::serialize::InputArchive& archive) {
  ::torch::serialize::InputArchive ours;
  c10::IValue version;
  if (!archive.try_read("gradcomp", ours) || !ours.try_read("version", version) ||
      !version.isInt() || version.toInt() != kStateVersion) {
    throw Error(fmt::format(
        "OneBitAdam::load: the state has no gradcomp part of version {} (was it saved by "
        "OneBitAdam::save of this version?)",
        kStateVersion));
  }
  c10::IValue steps;
  c10::IValue variance;
  c10::IValue interval;
  c10::IValue warmup;
  at::Tensor engine_state;
  if (!ours.try_read("steps", steps) || !ours.try_read("variance", variance) ||
      !ours.try_read("variance_interval", interval) || !ours.try_read("warmup_steps", warmup) ||
      !ours.try_read("engine", engine_state) || !steps.isInt() || !variance.isString() ||
      !interval.isInt() || !warmup.isInt()) {
    throw Error("OneBitAdam::load: the state's gradcomp part is incomplete");
  }
  if (variance.toStringRef() != variance_) {
    throw Error(
        fmt::format("OneBitAdam::load: the state was saved with variance='{}', this "
                    "optimizer has '{}'",
                    variance.toStringRef(), variance_));
  }
  if (interval.toInt() != interval_) {
    throw Error(
        fmt::format("OneBitAdam::load: the state was saved with variance_interval={}, "
                    "this optimizer has {}",
                    interval.toInt(), interval_));
  }
  if (warmup.toInt() != warmup_.value_or(0)) {
    throw Error(
        fmt::format("OneBitAdam::load: the state was saved with warmup_steps={}, this "
                    "optimizer has {}",
                    warmup.toInt(), warmup_.value_or(0)));
  }
  // All or nothing: what to put back when a later part does not fit.
  const std::vector<std::byte> engine_before = engine_->save_state();
  decltype(state_) state_before;
  for (const auto& [key, s] : state_) state_before[key] = s->clone();
  engine_->load_state(tensor_bytes(engine_state));
  try {
    state_.clear();
    o::serialize<OneBitAdamParamState, OneBitAdamOptions>(archive, *this);
    // A state from another model fails here, not inside a later step.
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto it = state_.find(c10::guts::to_string(params_[i].unsafeGetTensorImpl()));
      if (it == state_.end()) continue;
      auto& s = static_cast<OneBitAdamParamState&>(*it->second);
      const at::Tensor& p = params_[i];
      if (!s.exp_avg().defined() || !s.exp_avg_sq().defined() || s.exp_avg().sizes() != p.sizes() ||
          s.exp_avg_sq().sizes() != p.sizes() || s.exp_avg().scalar_type() != at::kFloat ||
          s.exp_avg_sq().scalar_type() != at::kFloat || s.step() < 0 || s.variance_updates() < 0 ||
          s.variance_updates() > s.step()) {
        throw Error(fmt::format(
            "OneBitAdam::load: the state does not fit parameter '{}' of shape {} (moments of "
            "shape {}, step {}); was it saved from another model?",
            names_[i], c10::str(p.sizes()),
            s.exp_avg().defined() ? c10::str(s.exp_avg().sizes()) : std::string("none"), s.step()));
      }
      s.exp_avg(s.exp_avg().contiguous());
      s.exp_avg_sq(s.exp_avg_sq().contiguous());
    }
  } catch (...) {
    state_ = std::move(state_before);
    engine_->load_state(engine_before);
    throw;
  }
  steps_ = steps.toInt();
}

}  // namespace gradcomp::torch
