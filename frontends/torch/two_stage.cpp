// What the two-stage optimizers (OneBitAdam, OneBitLamb) share: the parameter checks, the two
// engines on one transport, the step loop and its momentum input, and the checkpoint's engine
// state, step clock and settings. The same as python/gradcomp/two_stage.py.
#include "gradcomp/torch/two_stage.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <utility>

#include "gradcomp/error.h"
#include "gradcomp/plan.h"
#include "gradcomp/torch/blas_threads.h"
#include "optimizer_closure.h"

namespace gradcomp::torch {
namespace {

constexpr int64_t kStateVersion = 2;
constexpr double kDefaultWarmupFraction = 0.15;  // DeepSpeed's BERT runs froze after 15-25%

void check_range(std::string_view optimizer, const char* what, int64_t value, int64_t low,
                 int64_t high) {
  if (value < low || value > high) {
    throw SpecError(fmt::format("{}: {} is {}; allowed: an integer in [{}, {}]", optimizer, what,
                                value, low, high));
  }
}

// The compressed steps' option; a start= of its own would make some of them exact.
Option compressed_option(const std::string& compression, std::string_view optimizer,
                         std::string_view schedule) {
  Option option = parse_option(compression);
  if (option.start_step != 0) {
    throw SpecError(
        fmt::format("{}: compression '{}' has its own start=; which steps are exact is the {}",
                    optimizer, compression, schedule));
  }
  return option;
}

// The exchange's options, checked before the base class is built (and before any collective).
std::unique_ptr<::torch::optim::OptimizerOptions> checked_group_options(
    const TwoStageGroupOptions& defaults, std::string_view optimizer, std::string_view schedule) {
  const TwoStageExchange e = defaults.exchange();
  check_range(optimizer, "bucket_bytes", e.bucket_bytes, 1, int64_t{1} << 40);
  check_range(optimizer, "min_compress_elements", e.min_compress_elements, 0, int64_t{1} << 62);
  check_range(optimizer, "codec_threads", e.codec_threads, 1, 1024);
  compressed_option(e.compression, optimizer, schedule);
  return defaults.clone();
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

std::vector<std::byte> tensor_bytes(const at::Tensor& t, const std::string& optimizer) {
  const at::Tensor c = t.contiguous();
  TORCH_CHECK(c.scalar_type() == at::kByte, optimizer, ": the engine state is not bytes");
  const auto* data = static_cast<const std::byte*>(c.data_ptr());
  return {data, data + c.numel()};
}

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The trainable parameters, checked: float32 contiguous CPU, distinct names.
NamedTensors trainable(const ::torch::OrderedDict<std::string, at::Tensor>& named,
                       std::string_view optimizer) {
  NamedTensors out;
  std::set<std::string> names;
  for (const auto& item : named) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    if (p.scalar_type() != at::kFloat || !p.device().is_cpu() || p.is_sparse() ||
        !p.is_contiguous()) {
      throw Error(
          fmt::format("{}: parameter '{}' is a {}{} tensor on {}; float32 contiguous CPU "
                      "parameters only (convert the model with ->to(torch::kFloat))",
                      optimizer, item.key(), c10::toString(p.scalar_type()),
                      p.is_contiguous() ? "" : " non-contiguous", p.device().str()));
    }
    if (!names.insert(item.key()).second) {
      throw Error(fmt::format("{}: parameter name '{}' appears twice", optimizer, item.key()));
    }
    out.emplace_back(item.key(), p);
  }
  if (out.empty()) throw Error(fmt::format("{}: no parameters that require gradients", optimizer));
  return out;
}

std::vector<at::Tensor> values_of(const NamedTensors& named) {
  std::vector<at::Tensor> v;
  for (const auto& [name, p] : named) v.push_back(p);
  return v;
}

Plan plan_of(const NamedTensors& named, const Option& option, const TwoStageExchange& e) {
  std::vector<TensorInfo> tensors;
  for (const auto& [name, p] : named) {
    const auto sizes = p.sizes();
    tensors.push_back(
        {name, static_cast<size_t>(p.numel()), std::vector<size_t>(sizes.begin(), sizes.end())});
  }
  DefaultPlanSettings settings;
  settings.bucket_bytes = static_cast<size_t>(e.bucket_bytes);
  settings.min_compress_elements = static_cast<size_t>(e.min_compress_elements);
  settings.compressed = option;
  return make_default_plan(std::move(tensors), settings);
}

// A setting as a message shows it: strings quoted, numbers as they are.
std::string shown(const c10::IValue& v) {
  if (v.isString()) return fmt::format("'{}'", v.toStringRef());
  if (v.isInt()) return fmt::format("{}", v.toInt());
  if (v.isDouble()) return fmt::format("{}", v.toDouble());
  return v.tagKind();
}

bool same_kind(const c10::IValue& a, const c10::IValue& b) {
  return (a.isInt() && b.isInt()) || (a.isDouble() && b.isDouble()) ||
         (a.isString() && b.isString());
}

bool same_value(const c10::IValue& a, const c10::IValue& b) {
  if (a.isInt()) return a.toInt() == b.toInt();
  if (a.isDouble()) return a.toDouble() == b.toDouble();
  return a.toStringRef() == b.toStringRef();
}

// A checkpoint without an "optimizer" entry is a OneBitAdam's (its format predates the entry).
constexpr const char* kUnnamedSaver = "OneBitAdam";

}  // namespace

void TwoStageParamState::serialize(::torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  archive.write("variance_updates", c10::IValue(variance_updates()));
  write_extra(archive);
  archive.write("exp_avg", exp_avg());
  archive.write("exp_avg_sq", exp_avg_sq());
}

void TwoStageParamState::serialize(::torch::serialize::InputArchive& archive) {
  c10::IValue v;
  if (archive.try_read("step", v)) step(v.toInt());
  if (archive.try_read("variance_updates", v)) variance_updates(v.toInt());
  read_extra(archive);
  at::Tensor m;
  if (archive.try_read("exp_avg", m)) exp_avg(m);
  at::Tensor s;
  if (archive.try_read("exp_avg_sq", s)) exp_avg_sq(s);
}

TwoStageOptimizer::TwoStageOptimizer(
    const ::torch::OrderedDict<std::string, at::Tensor>& named_parameters,
    std::shared_ptr<Transport> transport, const TwoStageGroupOptions& defaults, std::string name,
    std::string_view schedule)
    : Optimizer({::torch::optim::OptimizerParamGroup(values_of(trainable(named_parameters, name)))},
                checked_group_options(defaults, name, schedule)),
      name_(std::move(name)),
      transport_(std::move(transport)) {
  if (!transport_) throw Error(fmt::format("{}: no transport", name_));
  const NamedTensors named = trainable(named_parameters, name_);
  for (const auto& item : named_parameters) {
    if (!item.value().requires_grad()) left_out_.emplace_back(item.key(), item.value());
  }
  for (const auto& [key, p] : named) {
    names_.push_back(key);
    params_.push_back(p);
    group_index_.push_back(0);
    exchanged_.push_back(at::empty_like(p, at::MemoryFormat::Contiguous));
  }
  learned_variance_.assign(params_.size(), 0);
  const TwoStageExchange e = defaults.exchange();
  EngineOptions engine;
  engine.seed = e.seed;
  engine.codec_threads = static_cast<int>(e.codec_threads);
  // Only one engine is busy at a time (step() waits for it) and every rank picks the same one.
  engine.timeline = e.timeline;
  if (engine.timeline.empty()) {
    const char* env = std::getenv("GRADCOMP_TIMELINE");
    if (env != nullptr) engine.timeline = env;
  }
  warn_if_blas_outnumbers_torch();
  engine_ = std::make_unique<Engine>(
      transport_, plan_of(named, compressed_option(e.compression, name_, schedule), e), engine);
  engine.timeline = exact_trace(engine.timeline);
  exact_engine_ = std::make_unique<Engine>(transport_, plan_of(named, Option{}, e), engine);
  if (e.broadcast) {
    at::NoGradGuard no_grad;
    for (const auto& p : params_) {
      std::span<std::byte> bytes{static_cast<std::byte*>(p.data_ptr()),
                                 static_cast<size_t>(p.numel()) * sizeof(float)};
      transport_->broadcast(bytes, 0)->wait(transport_->timeout());
    }
  }
  find_unused_ = e.find_unused;
  agree_on_find_unused();
}

// Every rank must take the same collectives a step: a rank agreeing on the unused parameters
// while another does not would pair the agreement with the next step's exchange.
void TwoStageOptimizer::agree_on_find_unused() const {
  std::array<float, 1> flag{find_unused_ ? 1.0f : 0.0f};
  transport_->allreduce(std::span<float>(flag))->wait(transport_->timeout());
  if (flag[0] != 0.0f && flag[0] != static_cast<float>(transport_->size())) {
    throw Error(fmt::format(
        "{}: the ranks use different find_unused_parameters ({} of {} ranks true, this rank's "
        "{}); pass the same on every rank",
        name_, static_cast<int>(flag[0]), transport_->size(), find_unused_));
  }
}

// After the exchange: the engines are idle, so the agreement cannot pair with their
// collectives.
std::vector<uint8_t> TwoStageOptimizer::unused_everywhere() const {
  std::vector<uint8_t> unused(params_.size(), 0);
  if (!find_unused_) return unused;
  std::vector<float> used(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) used[i] = params_[i].grad().defined() ? 1.0f : 0.0f;
  transport_->allreduce(std::span<float>(used))->wait(transport_->timeout());
  for (size_t i = 0; i < params_.size(); ++i) unused[i] = used[i] == 0.0f ? 1 : 0;
  return unused;
}

// On an exact step every rank handed over zeros: the mean is 0. On a compressed step every rank
// handed over b1 m, and the mean differs from it by what error feedback delivered (the codes'
// earlier errors), which the momentum keeps: m <- m + (mean - b1 m), so the momentum and the
// feedback memories still hold all that was handed over.
void TwoStageOptimizer::leave(size_t i, bool is_exact) {
  if (is_exact) return;
  at::Tensor& m = param_state(i).exp_avg();
  m.add_(exchanged_[i] - at::mul(m, hyper_of(i).beta1));
}

// An unlearned parameter's momentum holds nothing but what the compressed exchanges gave it
// beyond its input (the codes' error, where its zeros shared a code block with other tensors,
// kept by leave() while no rank used it; error feedback takes it back later), and so does what
// this step's exchange gave beyond b1 m. That goes to the momentum after the exact step, not
// into the step itself: its variance is 0 where the gradient is, and m / (sqrt(v) + eps) would
// be huge there (v fills in before a compressed step divides by it).
void TwoStageOptimizer::step_exactly_alone(size_t i, const at::Tensor& mean, int threads) {
  at::Tensor& m = param_state(i).exp_avg();
  const at::Tensor carried = exchanged_[i] + m * (1.0 - hyper_of(i).beta1);
  m.zero_();
  exchanged_[i].view({-1}).copy_(mean);
  update(i, true, threads);
  m.add_(carried);
}

TwoStageOptimizer::~TwoStageOptimizer() {
  // Their threads end before the transport may be released.
  engine_.reset();
  exact_engine_.reset();
}

const Plan& TwoStageOptimizer::plan() const { return engine_->plan(); }

std::span<float> TwoStageOptimizer::float_span(const at::Tensor& t) {
  return {t.data_ptr<float>(), static_cast<size_t>(t.numel())};
}

int64_t warmup_steps_of(const std::optional<int64_t>& warmup_steps,
                        const std::optional<int64_t>& total_steps, std::string_view optimizer,
                        std::string_view why) {
  if (warmup_steps) {
    if (*warmup_steps < 1) {
      throw SpecError(fmt::format("{}: warmup_steps is {}; allowed: an int >= 1 ({})", optimizer,
                                  *warmup_steps, why));
    }
    return *warmup_steps;
  }
  if (!total_steps) return kDefaultWarmupSteps;
  if (*total_steps < 1) {
    throw SpecError(
        fmt::format("{}: total_steps is {}; allowed: an int >= 1", optimizer, *total_steps));
  }
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(kDefaultWarmupFraction *
                                                             static_cast<double>(*total_steps))));
}

void TwoStageOptimizer::fill_unseen(const at::Tensor& v) {
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

TwoStageParamState& TwoStageOptimizer::param_state(size_t i) {
  const at::Tensor& p = params_[i];
  auto& slot = state_[c10::guts::to_string(p.unsafeGetTensorImpl())];
  if (!slot) {
    std::unique_ptr<TwoStageParamState> fresh = new_state();
    fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Contiguous));
    fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
    slot = std::move(fresh);
  }
  return static_cast<TwoStageParamState&>(*slot);
}

AdamHyper TwoStageOptimizer::hyper_of(size_t i) const {
  return static_cast<const TwoStageGroupOptions&>(param_groups_[group_index_[i]].options()).hyper();
}

LayerSlot TwoStageOptimizer::layer(size_t i) {
  TwoStageParamState& state = param_state(i);
  return {float_span(params_[i]), float_span(exchanged_[i]), float_span(state.exp_avg()),
          float_span(state.exp_avg_sq())};
}

bool TwoStageOptimizer::learned(size_t i) {
  if (!learned_variance_[i]) {
    learned_variance_[i] = param_state(i).exp_avg_sq().any().item<bool>() ? 1 : 0;
  }
  return learned_variance_[i] != 0;
}

std::vector<size_t> TwoStageOptimizer::unlearned(const std::vector<uint8_t>& unused) {
  std::vector<size_t> found;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!unused[i] && !learned(i)) found.push_back(i);
  }
  return found;
}

std::vector<uint8_t> TwoStageOptimizer::some_rank_has_gradient(
    const std::vector<size_t>& indices) const {
  std::vector<float> count(indices.size());
  for (size_t k = 0; k < indices.size(); ++k) {
    count[k] = params_[indices[k]].grad().defined() ? 1.0f : 0.0f;
  }
  transport_->allreduce(std::span<float>(count))->wait(transport_->timeout());
  std::vector<uint8_t> has(indices.size());
  for (size_t k = 0; k < indices.size(); ++k) has[k] = count[k] > 0 ? 1 : 0;
  return has;
}

at::Tensor TwoStageOptimizer::exact_means(const std::vector<size_t>& unlearned) const {
  if (unlearned.empty()) return at::empty({0}, at::kFloat);
  const std::vector<uint8_t> sent = some_rank_has_gradient(unlearned);
  std::vector<at::Tensor> means;
  std::vector<at::Tensor> grads;  // of those some rank has, zeros where this rank has none
  for (size_t k = 0; k < unlearned.size(); ++k) {
    const at::Tensor& p = params_[unlearned[k]];
    means.push_back(at::zeros({p.numel()}, at::kFloat));
    if (sent[k]) grads.push_back(p.grad().defined() ? p.grad().reshape({-1}) : means[k]);
  }
  if (grads.empty()) return at::cat(means);
  at::Tensor flat = at::cat(grads);
  transport_->allreduce(float_span(flat))->wait(transport_->timeout());
  flat.div_(static_cast<double>(transport_->size()));
  int64_t offset = 0;
  for (size_t k = 0; k < unlearned.size(); ++k) {
    if (!sent[k]) continue;
    means[k] = flat.narrow(0, offset, means[k].numel());
    offset += means[k].numel();
  }
  return at::cat(means);
}

at::Tensor TwoStageOptimizer::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  const at::Tensor loss = closure_loss(closure);
  // Everything that can be refused is refused before this rank hands anything over.
  for (const auto& group : param_groups_) {
    // a scheduler or the caller may change them
    check_adam_hyper(static_cast<const TwoStageGroupOptions&>(group.options()).hyper(), name_);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    if (grad.defined() && (grad.is_sparse() || !grad.device().is_cpu())) {
      throw Error(fmt::format("{}: parameter '{}' has a {} gradient; dense CPU gradients only",
                              name_, names_[i], grad.is_sparse() ? "sparse" : grad.device().str()));
    }
  }
  const bool is_exact = exact();
  Engine& engine = is_exact ? *exact_engine_ : *engine_;
  for (size_t i = 0; i < params_.size(); ++i) {
    local_input(i, is_exact);
    engine.ready(names_[i], float_span(exchanged_[i]));
  }
  engine.synchronize();
  const std::vector<uint8_t> unused = unused_everywhere();
  check_trainable(unused);  // after the exchange (every rank took part), before anything moves
  const std::vector<size_t> own_exact = is_exact ? std::vector<size_t>{} : unlearned(unused);
  const at::Tensor means = exact_means(own_exact);
  ++steps_;
  last_ = engine.last_step();
  // The engine checks every mean (the same bits on every rank), and the means of the
  // parameters stepping exactly on their own are the same on every rank: every rank decides
  // alike.
  if (!last_.finite || !means.isfinite().all().item<bool>()) {
    TORCH_WARN("gradcomp: ", name_,
               ": this step's average is not finite (an overflow on some rank): the step is "
               "skipped on every rank");
    return loss;
  }
  const int threads = at::get_num_threads();
  auto next_own = own_exact.begin();
  int64_t offset = 0;  // of the next one's mean in `means`
  for (size_t i = 0; i < params_.size(); ++i) {
    if (unused[i]) {
      leave(i, is_exact);
    } else if (next_own != own_exact.end() && *next_own == i) {
      const int64_t n = params_[i].numel();
      step_exactly_alone(i, means.narrow(0, offset, n), threads);
      offset += n;
      ++next_own;
    } else {
      update(i, is_exact, threads);
    }
  }
  return loss;
}

void TwoStageOptimizer::check_trainable(const std::vector<uint8_t>& unused) const {
  for (const auto& [name, p] : left_out_) {
    if (!p.grad().defined()) continue;
    throw Error(fmt::format(
        "{0}: parameter '{1}' has a gradient, but it required none when the {0} was built, so "
        "it is not exchanged and would never be updated. Build the {0} again after changing "
        "requires_grad",
        name_, name));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].requires_grad() || params_[i].grad().defined() || unused[i]) continue;
    throw Error(fmt::format(
        "{0}: parameter '{1}' requires no gradient now (frozen after the {0} was built) and has "
        "none, so the exchange gave it zeros, which the momentum and weight decay would still "
        "move it by. Build the {0} again after freezing (frozen parameters are left out), or "
        "pass find_unused_parameters(true)",
        name_, names_[i]));
  }
}

// What this rank hands over for parameter i: its gradient (zeros when it has none) on an exact
// step, its momentum b1 m + (1 - b1) g on a compressed one.
void TwoStageOptimizer::local_input(size_t i, bool is_exact) {
  at::Tensor& out = exchanged_[i];
  const at::Tensor& grad = params_[i].grad();
  TwoStageParamState& state = param_state(i);
  if (is_exact) {
    if (grad.defined()) {
      out.copy_(grad);
    } else {
      out.zero_();
    }
    return;
  }
  const double beta1 = hyper_of(i).beta1;
  // An unlearned variance: its gradient goes in an exact step of its own (exact_means).
  if (grad.defined() && learned(i)) {
    at::lerp_out(out, grad, state.exp_avg(), beta1);  // b1 m + (1 - b1) g
  } else {
    at::mul_out(out, state.exp_avg(), beta1);
  }
}

void TwoStageOptimizer::save(::torch::serialize::OutputArchive& archive) const {
  write_state(archive, {engine_->save_state()}, false);
}

void TwoStageOptimizer::save_all_ranks(::torch::serialize::OutputArchive& archive) {
  write_state(archive, engine_->save_all_states(), true);
}

void TwoStageOptimizer::write_state(::torch::serialize::OutputArchive& archive,
                                    const std::vector<std::vector<std::byte>>& engine_states,
                                    bool all) const {
  save_states(archive);
  ::torch::serialize::OutputArchive ours;
  ours.write("version", c10::IValue(kStateVersion));
  ours.write("steps", c10::IValue(steps_));
  for (const Setting& s : settings()) ours.write(s.key, s.value);
  if (!all) {
    ours.write("engine", bytes_tensor(engine_states.front()));
  } else {
    ours.write("engine_ranks", c10::IValue(static_cast<int64_t>(engine_states.size())));
    for (size_t r = 0; r < engine_states.size(); ++r) {
      ours.write(fmt::format("engine.{}", r), bytes_tensor(engine_states[r]));
    }
  }
  archive.write("gradcomp", ours);
}

// This rank's engine state: "engine" (save()), or its part of every rank's (save_all_ranks(),
// which must come from a world of this size). An undefined tensor when there is neither.
at::Tensor TwoStageOptimizer::engine_state_of(::torch::serialize::InputArchive& ours) const {
  at::Tensor state;
  if (ours.try_read("engine", state)) return state;
  c10::IValue ranks;
  if (!ours.try_read("engine_ranks", ranks) || !ranks.isInt()) return {};
  if (ranks.toInt() != transport_->size()) {
    throw Error(
        fmt::format("{}::load: the state holds the error feedback of {} ranks; this job "
                    "has {}: resume with the same world size",
                    name_, ranks.toInt(), transport_->size()));
  }
  ours.try_read(fmt::format("engine.{}", transport_->rank()), state);
  return state;
}

void TwoStageOptimizer::load(::torch::serialize::InputArchive& archive) {
  ::torch::serialize::InputArchive ours;
  c10::IValue version;
  if (!archive.try_read("gradcomp", ours) || !ours.try_read("version", version) ||
      !version.isInt() || version.toInt() != kStateVersion) {
    throw Error(fmt::format(
        "{0}::load: the state has no gradcomp part of version {1} (was it saved by {0}::save of "
        "this version?)",
        name_, kStateVersion));
  }
  c10::IValue saver;
  const std::string saved_by = ours.try_read("optimizer", saver) && saver.isString()
                                   ? saver.toStringRef()
                                   : std::string(kUnnamedSaver);
  if (saved_by != name_) {
    throw Error(
        fmt::format("{0}::load: the state was saved by {1}, not by a {0}", name_, saved_by));
  }
  const std::vector<Setting> expected = settings();
  std::vector<c10::IValue> saved(expected.size());
  c10::IValue steps;
  at::Tensor engine_state;
  bool complete = ours.try_read("steps", steps) && steps.isInt() &&
                  (engine_state = engine_state_of(ours)).defined();
  for (size_t k = 0; complete && k < expected.size(); ++k) {
    complete = ours.try_read(expected[k].key, saved[k]) && same_kind(saved[k], expected[k].value);
  }
  if (!complete) {
    throw Error(fmt::format("{}::load: the state's gradcomp part is incomplete", name_));
  }
  for (size_t k = 0; k < expected.size(); ++k) {
    if (!same_value(saved[k], expected[k].value)) {
      throw Error(fmt::format("{}::load: the state was saved with {}={}, this optimizer has {}",
                              name_, expected[k].key, shown(saved[k]), shown(expected[k].value)));
    }
  }
  // All or nothing: what to put back when a later part does not fit.
  const std::vector<std::byte> engine_before = engine_->save_state(Engine::StateFor::kUndo);
  decltype(state_) state_before;
  for (const auto& [key, s] : state_) state_before[key] = s->clone();
  engine_->load_state(tensor_bytes(engine_state, name_));
  try {
    state_.clear();
    load_states(archive);
    // A state from another model fails here, not inside a later step.
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto it = state_.find(c10::guts::to_string(params_[i].unsafeGetTensorImpl()));
      if (it == state_.end()) continue;
      auto& s = static_cast<TwoStageParamState&>(*it->second);
      const at::Tensor& p = params_[i];
      if (!s.exp_avg().defined() || !s.exp_avg_sq().defined() || s.exp_avg().sizes() != p.sizes() ||
          s.exp_avg_sq().sizes() != p.sizes() || s.exp_avg().scalar_type() != at::kFloat ||
          s.exp_avg_sq().scalar_type() != at::kFloat || s.step() < 0 || s.variance_updates() < 0 ||
          s.variance_updates() > s.step() || !adopt_loaded(s, p)) {
        throw Error(fmt::format(
            "{}::load: the state does not fit parameter '{}' of shape {} (moments of shape {}, "
            "step {}); was it saved from another model?",
            name_, names_[i], c10::str(p.sizes()),
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
  learned_variance_.assign(params_.size(), 0);
}

}  // namespace gradcomp::torch
