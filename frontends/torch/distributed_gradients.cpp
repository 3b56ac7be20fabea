// DistributedGradients: parameters -> plan -> engine, and a post hook on each parameter's
// gradient accumulator that hands the accumulated gradient to the engine.
#include "gradcomp/torch/distributed_gradients.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>

#include "gradcomp/error.h"
#include "gradcomp/torch/blas_threads.h"
#include "gradcomp/torch/sparse_rows.h"

namespace gradcomp::torch {

struct EndOfBackward::Pass {
  bool ended = false;  // its end-of-backward callback ran
};

// What live DistributedGradients of this process hold, one holder each: the transports their
// engines issue collectives on (two engines on one transport would issue from two threads in an
// order that differs between ranks), and the parameters whose gradients they exchange (two
// exchanges of one gradient would each write their mean into it).
template <typename T>
class Claims {
 public:
  static bool claim(const T* t) {
    std::lock_guard lock(mutex());
    return claimed().insert(t).second;
  }
  static bool claimed(const T* t) {
    std::lock_guard lock(mutex());
    return claimed().contains(t);
  }
  static void release(const T* t) {
    std::lock_guard lock(mutex());
    claimed().erase(t);
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::set<const T*>& claimed() {
    static std::set<const T*> s;
    return s;
  }
};
using TransportClaims = Claims<Transport>;
using ParameterClaims = Claims<c10::TensorImpl>;

// The transport this exchange issues its collectives on: `given`, unless another live exchange
// of this process uses it; then a communicator of its own split from it (a collective: every
// rank constructs its optimizers in the same order, so all ranks split alike).
std::shared_ptr<Transport> claim_transport(const std::shared_ptr<Transport>& given) {
  if (TransportClaims::claim(given.get())) return given;
  std::shared_ptr<Transport> own;
  try {
    own = given->split(0, given->rank());
  } catch (const Error& e) {
    throw Error(fmt::format(
        "another DistributedOptimizer of this process exchanges over this transport, and a "
        "communicator of its own could not be split from it ({}); give each optimizer its own "
        "transport (a torch.distributed group of its own: torch.distributed.new_group())",
        e.what()));
  }
  TransportClaims::claim(own.get());
  return own;
}

struct DistributedGradientsShared {
  ~DistributedGradientsShared() {
    engine.reset();  // its threads end before the transport is free for another engine
    if (transport) TransportClaims::release(transport.get());
    for (const auto* p : claimed_parameters) ParameterClaims::release(p);
  }

  // Claims the gradients of `params` for this exchange, or throws naming the first that a live
  // exchange of this process holds (claiming none of them).
  void claim_parameters(const std::vector<std::string>& param_names,
                        const std::vector<at::Tensor>& params) {
    for (size_t i = 0; i < params.size(); ++i) {
      const c10::TensorImpl* impl = params[i].unsafeGetTensorImpl();
      if (std::find(claimed_parameters.begin(), claimed_parameters.end(), impl) !=
          claimed_parameters.end()) {
        throw Error(
            fmt::format("parameter '{}' is given twice (the same tensor under another "
                        "name); give each parameter once",
                        param_names[i]));
      }
      if (ParameterClaims::claim(impl)) {
        claimed_parameters.push_back(impl);
        continue;
      }
      for (const auto* p : claimed_parameters) ParameterClaims::release(p);
      claimed_parameters.clear();
      throw Error(fmt::format(
          "parameter '{}' is exchanged by another live DistributedOptimizer (or "
          "DistributedGradients) of this process: a gradient is exchanged by one at a time; "
          "destroy that one before building another over the same parameters",
          param_names[i]));
    }
  }

  std::vector<const c10::TensorImpl*> claimed_parameters;  // released when this exchange ends

  std::shared_ptr<Transport> transport;  // this exchange's own (see claim_transport)
  std::vector<std::string> names;        // plan order, then the sparse ones
  std::vector<at::Tensor> parameters;    // plan order, then the sparse ones
  size_t dense_count = 0;                // the plan's tensors: parameters[0, dense_count)
  size_t sparse_bytes_sent = 0;          // by the last exchange's sparse rows
  size_t sparse_dense_bytes = 0;         // what those parameters would cost dense
  std::vector<bool> handed;              // handed to the engine in this step's exchange
  bool any_handed = false;
  std::vector<at::Tensor> in_flight;     // what the engine reads and writes until it is done
  std::vector<std::pair<at::Tensor, at::Tensor>> narrowed;  // (half .grad, its float32 copy)
  std::vector<std::shared_ptr<::torch::autograd::Node>> accumulators;  // keep our hooks alive
  int passes_per_step = 1;
  int passes_done = 0;                   // backward passes ended since the last exchange
  std::weak_ptr<EndOfBackward::Pass> pass;  // the pass running now; its callback owns it
  bool pass_started = false;             // a pass began and its callback has not run (yet)
  bool exchanged_since_step = false;     // an exchange finished since step_done()
  bool aborted = false;                  // the last exchange completed a pass that raised
  bool finite_since_step = true;         // every exchange since step_done() had a finite mean
  bool find_unused = false;              // GradientOptions::find_unused_parameters
  std::vector<uint8_t> used;             // per parameter: a gradient came (or was there) here
  // Left out at construction (no gradient required then), with their names: one unfrozen
  // since would be stepped on this rank's gradient alone (check_left_out).
  std::vector<std::pair<std::string, at::Tensor>> left_out;
  std::string hook_error;                // why our own hook made the running pass raise
  // Completing an aborted pass from the next pass's first gradient failed (a peer is gone):
  // that pass hands nothing over, and its end raises this, with its type.
  std::exception_ptr completion_error;
  std::function<void(EndOfBackward)> queue_end_of_backward;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<AutoScheduler> scheduler;  // compression="auto"
  StepTimes times;                           // this step's clock, for the scheduler
  GradientOptions plan_options;              // bucket_bytes, min_compress_elements: set_plan's
  std::mutex mutex;  // hooks may run on autograd's worker threads

  void hand_over(size_t index);  // its .grad
  void hand_over(size_t index, const at::Tensor& grad);
  void before_accumulation(size_t index);
  void on_accumulated(size_t index, const std::shared_ptr<DistributedGradientsShared>& self);
  void end_pass(EndOfBackward::Pass& pass);
  // Locked helpers.
  bool pass_running() const;
  void complete_aborted_pass();
  void forget_unstepped_exchange();
  void hand_over_the_rest(bool fill_nan);
  void exchange(bool fill_nan);
  void wait_for_engine();
  void forget_unused();
  void exchange_sparse(bool fill_nan);
  // engine->set_plan for our parameters (`trial`: Engine::set_plan's)
  void switch_plan(const GradientOptions& options, bool trial = false);
  void end_step();  // step_done: the scheduler's clock and decisions
  void check_left_out() const;
  std::string frozen_since() const;
};

namespace {

// The auto scheduler's clock: seconds of the steady clock.
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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
    if (auto shared = shared_.lock()) shared->on_accumulated(index_, shared);
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

bool exchangeable_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_parameter(const std::string& name, const at::Tensor& p) {
  if (!exchangeable_type(p.scalar_type()) || p.is_sparse() || !p.device().is_cpu()) {
    throw Error(fmt::format(
        "parameter '{}' is {}; gradcomp exchanges dense float32, float16 and bfloat16 CPU "
        "gradients (convert the model with .float(), or leave the parameter out / set "
        "requires_grad=False)",
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
    const auto sizes = params[i].sizes();
    tensors.push_back({names[i], static_cast<size_t>(params[i].numel()),
                       std::vector<size_t>(sizes.begin(), sizes.end())});
  }
  if (!options.plan) {
    DefaultPlanSettings settings;
    settings.bucket_bytes = options.bucket_bytes;
    settings.min_compress_elements = options.min_compress_elements;
    settings.compressed = options.compression;
    return make_default_plan(std::move(tensors), settings);
  }
  // A given plan must cover exactly the trainable parameters. A plan without shapes (from a
  // profile) gets the parameters' own, so shape-aware codecs see each tensor.
  std::map<std::string, const TensorInfo*> ours;
  for (const auto& t : tensors) ours[t.name] = &t;
  Plan plan = *options.plan;
  for (auto& t : plan.tensors) {
    auto it = ours.find(t.name);
    if (it == ours.end()) {
      throw Error(fmt::format("plan tensor '{}' is not a trainable parameter of the model",
                              t.name));
    }
    const TensorInfo& param = *it->second;
    if (param.elements != t.elements) {
      throw Error(fmt::format("plan tensor '{}' has {} elements, the parameter has {}", t.name,
                              t.elements, param.elements));
    }
    if (!t.shape.empty() && t.shape != param.shape) {
      throw Error(fmt::format("plan tensor '{}' has shape [{}], the parameter [{}]", t.name,
                              fmt::join(t.shape, ", "), fmt::join(param.shape, ", ")));
    }
    t.shape = param.shape;
    ours.erase(it);
  }
  if (!ours.empty()) {
    throw Error(fmt::format("parameter '{}' is in no bucket of the plan", ours.begin()->first));
  }
  return plan;
}

// `plan` with its tensors listed in the order of `names` (the engine's), the buckets' indices
// following them: an engine's tensor indices do not change with its plan. Buckets index pieces
// (a sliced tensor's slices, in order), so a slice moves with its tensor.
Plan in_tensor_order(Plan plan, std::span<const std::string> names) {
  plan.validate();  // every index names a piece (the shapes filled in may refuse slices)
  std::map<std::string, size_t> index_of;
  for (size_t i = 0; i < plan.tensors.size(); ++i) index_of[plan.tensors[i].name] = i;
  const std::vector<TensorPiece> pieces = plan.pieces();
  std::vector<TensorInfo> tensors;
  std::vector<size_t> first_at(plan.tensors.size());  // old tensor -> its first new piece
  size_t next = 0;
  for (const std::string& name : names) {
    const size_t i = index_of.at(name);
    first_at[i] = next;
    next += plan.tensors[i].slices;
    tensors.push_back(plan.tensors[i]);
  }
  for (auto& bucket : plan.buckets) {
    for (auto& p : bucket.tensors) p = first_at[pieces[p].tensor] + pieces[p].slice;
  }
  plan.tensors = std::move(tensors);
  return plan;
}

}  // namespace

Option parse_compression(const std::string& text) {
  if (text == "auto") {  // Python's compression="auto" is a setting of its own in C++
    throw Error(
        "'auto' is not a codec: for the scheduler that chooses the plan set "
        "GradientOptions::auto_settings (an AutoSettings, gradcomp/scheduler.h; "
        "AutoSettings::from_json reads one from JSON) and leave compression unset");
  }
  return parse_option(text);
}

bool transport_in_use(const Transport& transport) { return TransportClaims::claimed(&transport); }

EndOfBackward::EndOfBackward(std::weak_ptr<DistributedGradientsShared> shared,
                             std::shared_ptr<Pass> pass)
    : shared_(std::move(shared)), pass_(std::move(pass)) {}

void EndOfBackward::operator()() const {
  if (auto shared = shared_.lock()) shared->end_pass(*pass_);
}

void DistributedGradientsShared::hand_over(size_t index) {
  at::Tensor grad = parameters[index].grad();
  if (grad.is_sparse()) {
    throw Error(fmt::format(
        "gradcomp: parameter '{}' has a sparse gradient, and was not declared sparse: name it in "
        "sparse_parameters (Python: pass the model itself as named_parameters, and "
        "nn.Embedding(sparse=True) parameters are found), and its rows are exchanged",
        names[index]));
  }
  const at::ScalarType type = parameters[index].scalar_type();
  if (grad.scalar_type() != type || !grad.is_contiguous() ||
      grad.numel() != parameters[index].numel()) {
    // A gradient autograd made non-contiguous (or a user-assigned one): a plain buffer of the
    // parameter's type the mean can be written into, in place of the old one.
    grad = grad.to(type).contiguous().reshape_as(parameters[index]);
    parameters[index].mutable_grad() = grad;
  }
  if (type == at::kFloat) {
    hand_over(index, grad);
    return;
  }
  // Half-precision gradients travel and keep their feedback in float32 (exact widening); the
  // float32 mean is rounded back into .grad once the exchange is done, alike on every rank.
  at::Tensor wide = grad.to(at::kFloat);
  narrowed.emplace_back(grad, wide);
  hand_over(index, wide);
}

void DistributedGradientsShared::hand_over(size_t index, const at::Tensor& grad) {
  engine->ready(index, std::span<float>(grad.data_ptr<float>(), grad.numel()));
  in_flight.push_back(grad);  // alive until the mean is written, even if .grad is reset
  handed[index] = true;
  any_handed = true;
}

void DistributedGradientsShared::before_accumulation(size_t index) {
  std::lock_guard lock(mutex);
  // The first gradient of a pass after one that raised (a loop clearing its gradients with
  // model.zero_grad(), which we do not see): the raised pass's exchange is completed first,
  // so that what it handed over is not taken for a second pass running at the same time. A
  // failure there would reach backward()'s caller from autograd's hook as a bare
  // RuntimeError; the end of this pass raises it with its type instead.
  if (pass_started && !pass_running()) {
    try {
      complete_aborted_pass();
    } catch (const CommError&) {
      completion_error = std::current_exception();
    }
  }
  if (completion_error) return;
  if (handed[index]) {
    // Only a second backward pass running at the same time (another thread) gets here: a
    // pass's own exchange ends with it.
    throw Error(fmt::format(
        "gradcomp: parameter '{}' got a gradient from another backward pass while its "
        "gradient was being exchanged (its .grad is left as it was); run backward passes "
        "that reach the same parameters one after another",
        names[index]));
  }
}

bool DistributedGradientsShared::pass_running() const {
  auto running = pass.lock();
  return running && !running->ended;
}

void DistributedGradientsShared::on_accumulated(
    size_t index, const std::shared_ptr<DistributedGradientsShared>& self) {
  std::optional<EndOfBackward> end;
  {
    std::lock_guard lock(mutex);
    if (!pass_running()) {
      // The first gradient of a backward pass: arrange to finish the pass when it ends (a
      // raised pass before it was completed by before_accumulation, which runs first).
      if (exchanged_since_step && passes_done == 0 && !any_handed) forget_unstepped_exchange();
      auto running = std::make_shared<EndOfBackward::Pass>();
      pass = running;
      pass_started = true;
      end.emplace(self, std::move(running));
    }
  }
  // Queued before anything of the pass is handed over: the Python front end sets the loss
  // scale of the step there. Without our lock held: it may take the GIL.
  if (end && queue_end_of_backward) {
    queue_end_of_backward(std::move(*end));
  } else if (end) {
    ::torch::autograd::Engine::get_default_engine().queue_callback(
        [end = std::move(*end)] { end(); });
  }
  std::lock_guard lock(mutex);
  if (scheduler && index < dense_count) {  // the scheduler's clock of backward
    const double now = now_seconds();
    if (times.first_ready == 0) times.first_ready = now;
    times.last_ready = now;
    times.ready[index] = now;
  }
  // Gradient accumulation: only the step's last pass hands its gradients over. Sparse ones are
  // read when the pass ends (exchange_sparse).
  if (passes_done + 1 < passes_per_step || index >= dense_count || completion_error) return;
  try {
    hand_over(index);
  } catch (const CommError&) {
    // An earlier bucket's exchange has failed (a peer died or timed out). Raised from autograd's
    // hook, it would reach backward()'s caller as a bare RuntimeError; the end of the pass
    // raises it with its type, saying which bucket failed.
  } catch (const std::exception& e) {
    hook_error = e.what();  // the pass raises it; step() says it again
    throw;
  }
}

void DistributedGradientsShared::end_pass(EndOfBackward::Pass& ended) {
  std::lock_guard lock(mutex);
  ended.ended = true;
  pass_started = false;
  if (completion_error) std::rethrow_exception(std::exchange(completion_error, nullptr));
  if (++passes_done < passes_per_step) return;
  exchange(/*fill_nan=*/false);
}

// The engine's step, its errors said to come from gradcomp (they may surface from backward(),
// far from any gradcomp call). On failure in_flight keeps what the broken engine may touch.
void DistributedGradientsShared::wait_for_engine() {
  const auto said = [](const std::exception& e) { return fmt::format("gradcomp: {}", e.what()); };
  try {
    engine->synchronize();
  } catch (const TimeoutError& e) {
    throw TimeoutError(said(e));
  } catch (const CommError& e) {
    throw CommError(said(e));
  } catch (const Error& e) {
    throw Error(said(e));
  }
}

namespace {

// find_unused_parameters adds a collective to every exchange, and every sparse parameter
// several: ranks that disagree on them would pair those collectives with others, so they are
// an error at construction.
uint64_t fingerprint(const std::vector<std::string>& names) {
  uint64_t h = 14695981039346656037ULL;  // FNV-1a over the names, each ended by a 0 byte
  for (const auto& name : names) {
    for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ULL;
    h *= 1099511628211ULL;
  }
  return h;
}

void agree_on_settings(Transport& transport, bool find_unused,
                       const std::vector<std::string>& sparse) {
  const std::array<uint64_t, 2> mine{find_unused ? 1U : 0U, fingerprint(sparse)};
  std::vector<std::array<uint64_t, 2>> all(static_cast<size_t>(transport.size()));
  transport.allgather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)))
      ->wait(transport.timeout());
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r][0] != mine[0]) {
      throw CommError(fmt::format(
          "gradcomp: the ranks use different find_unused_parameters: {} on rank {}, {} on rank "
          "{}; every rank must use the same",
          find_unused, transport.rank(), all[r][0] != 0, r));
    }
    if (all[r][1] != mine[1]) {
      throw CommError(fmt::format(
          "gradcomp: the ranks exchange different parameters as sparse rows (rank {}: [{}]; "
          "rank {} differs); every rank must declare the same sparse parameters",
          transport.rank(), fmt::join(sparse, ", "), r));
    }
  }
}

}  // namespace

// A backward pass raised before its end (its callback was dropped with it). If it handed over
// gradients, the other ranks wait for the rest of that exchange: complete it with NaN, so
// that every rank sees a non-finite mean for this step rather than silently different ones.
void DistributedGradientsShared::complete_aborted_pass() {
  pass_started = false;
  if (!any_handed) return;  // nothing left the rank: the pass just does not count
  exchange(/*fill_nan=*/true);
  aborted = true;
}

// A pass begins after an exchange that no step() or zero_grad() of ours followed: the loop
// went on to its next batch without stepping (it skipped a non-finite mean itself, or a pass
// raised and it cleared .grad with model.zero_grad()). Every rank's exchange of that step has
// ended, so every rank forgets it here alike: its NaN or its raised pass must not make step()
// skip or refuse the step of this pass on some ranks and not on others.
void DistributedGradientsShared::forget_unstepped_exchange() {
  exchanged_since_step = false;
  aborted = false;
  finite_since_step = true;
  hook_error.clear();
  // The scheduler's clock runs on: two passes before a step (DDP's semantics) are one step.
}

// The gradients no hook handed over (unused parameters; NaN for a pass that raised).
void DistributedGradientsShared::hand_over_the_rest(bool fill_nan) {
  for (size_t i = 0; i < dense_count; ++i) {
    if (handed[i]) continue;
    if (fill_nan) {
      hand_over(i, at::full(parameters[i].sizes(), std::numeric_limits<float>::quiet_NaN(),
                            at::TensorOptions().dtype(at::kFloat)));
      continue;
    }
    auto& grad = parameters[i].mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(parameters[i]);
    hand_over(i);
  }
}

// Hands over every gradient not handed yet (.grad, or zeros where backward made none) and
// waits for the exchange. After an aborted pass the rest is NaN, in buffers of its own: the
// .grad of a pass running now is left alone.
void DistributedGradientsShared::exchange(bool fill_nan) {
  for (size_t i = 0; i < parameters.size(); ++i) {
    used[i] = handed[i] || parameters[i].grad().defined();
  }
  const std::string frozen = frozen_since();  // before the zeros below make it a gradient
  try {
    hand_over_the_rest(fill_nan);
  } catch (const CommError&) {
    wait_for_engine();  // the engine has failed: its error, said to come from gradcomp
    throw;
  }
  std::fill(handed.begin(), handed.end(), false);
  any_handed = false;
  passes_done = 0;
  exchanged_since_step = true;
  wait_for_engine();
  times.exchange_end = now_seconds();
  finite_since_step = finite_since_step && engine->last_step().finite;
  exchange_sparse(fill_nan);
  for (auto& [half, wide] : narrowed) half.copy_(wide);  // round to nearest even
  narrowed.clear();
  in_flight.clear();
  if (find_unused && !fill_nan) forget_unused();
  if (!frozen.empty() && !fill_nan) {
    throw Error(fmt::format(
        "gradcomp: parameter '{}' requires no gradient now (frozen after the "
        "DistributedOptimizer was built) and has none, so the exchange gave it zeros, which "
        "momentum and weight decay would still move it by. Pass find_unused_parameters=True "
        "(a parameter no rank used then keeps .grad None, agreed by every rank), or build the "
        "DistributedOptimizer again after freezing (frozen parameters are left out)",
        frozen));
  }
}

// Without find_unused_parameters: the first parameter (in the model's order) frozen since
// construction that has no gradient in this exchange, or "". Its zeros would become a .grad
// where PyTorch leaves None; with find_unused_parameters the ranks agree on leaving None.
std::string DistributedGradientsShared::frozen_since() const {
  if (find_unused) return {};
  for (size_t i = dense_count; i-- > 0;) {
    if (!used[i] && !parameters[i].requires_grad()) return names[i];
  }
  return {};
}

// Parameters no rank produced a gradient for get none (find_unused_parameters). The ranks
// agree on that by a max over their `used` flags; a zero mean is checked too, since error
// feedback may flush a residual into an unused parameter, which must not be dropped. The mean
// is the same on every rank, so every rank decides alike.
void DistributedGradientsShared::forget_unused() {
  try {
    transport->allreduce(std::as_writable_bytes(std::span(used)), DType::kU8, ReduceOp::kMax)
        ->wait(transport->timeout());
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("gradcomp: agreeing on the unused parameters: {}", e.what()));
  } catch (const CommError& e) {
    throw CommError(fmt::format("gradcomp: agreeing on the unused parameters: {}", e.what()));
  }
  for (size_t i = 0; i < dense_count; ++i) {
    auto& grad = parameters[i].mutable_grad();
    if (!used[i] && grad.defined() && !grad.ne(0).any().item<bool>()) grad = at::Tensor();
  }
}

namespace {

// A sparse gradient of `param` whose first row is NaN: what an aborted pass contributes, so
// that every rank's mean is non-finite, as the plan's NaN buffers make it for dense tensors.
at::Tensor nan_row(const at::Tensor& param) {
  if (param.size(0) == 0) return {};
  std::vector<int64_t> row_shape = param.sizes().vec();
  row_shape[0] = 1;
  return at::sparse_coo_tensor(at::zeros({1, 1}, at::TensorOptions().dtype(at::kLong)),
                               at::full(row_shape, std::numeric_limits<float>::quiet_NaN()),
                               param.sizes());
}

}  // namespace

// After the plan's buckets, in the same order on every rank. After an aborted pass this rank
// sends a NaN row and leaves .grad alone.
void DistributedGradientsShared::exchange_sparse(bool fill_nan) {
  sparse_bytes_sent = 0;
  sparse_dense_bytes = 0;
  for (size_t i = dense_count; i < parameters.size(); ++i) {
    const at::Tensor grad = fill_nan ? nan_row(parameters[i]) : parameters[i].grad();
    SparseMean mean = sparse_rows_mean(*transport, names[i], parameters[i], grad);
    sparse_bytes_sent += mean.bytes_sent;
    sparse_dense_bytes += mean.dense_bytes;
    finite_since_step = finite_since_step && mean.finite;
    if (fill_nan) continue;
    const bool no_rows = mean.grad._nnz() == 0;
    parameters[i].mutable_grad() = find_unused && no_rows ? at::Tensor() : mean.grad;
  }
}

DistributedGradients::DistributedGradients(NamedParameters parameters,
                                           std::shared_ptr<Transport> transport,
                                           GradientOptions options)
    : shared_(std::make_shared<Shared>()) {
  if (!transport) throw Error("DistributedGradients: the transport is null");
  warn_if_blas_outnumbers_torch();
  if (options.backward_passes_per_step < 1) {
    throw Error(fmt::format("backward_passes_per_step is {}; it must be at least 1",
                            options.backward_passes_per_step));
  }
  Shared& s = *shared_;
  s.passes_per_step = options.backward_passes_per_step;
  s.queue_end_of_backward = std::move(options.queue_end_of_backward);
  // Backward order: the last registered parameters get their gradients first.
  const std::set<std::string> sparse_names(options.sparse_parameters.begin(),
                                           options.sparse_parameters.end());
  std::vector<std::string> sparse;
  std::vector<at::Tensor> sparse_params;
  for (auto it = parameters.rbegin(); it != parameters.rend(); ++it) {
    if (!it->second.requires_grad()) {
      s.left_out.emplace_back(it->first, it->second);
      continue;
    }
    check_parameter(it->first, it->second);
    const bool is_sparse = sparse_names.contains(it->first);
    (is_sparse ? sparse : s.names).push_back(it->first);
    (is_sparse ? sparse_params : s.parameters).push_back(it->second);
  }
  for (const auto& name : sparse_names) {
    if (std::find(sparse.begin(), sparse.end(), name) == sparse.end()) {
      throw Error(fmt::format("sparse_parameters names '{}', which is not a trainable "
                              "parameter of the model",
                              name));
    }
  }
  if (s.names.empty() && sparse.empty()) {
    throw Error("DistributedGradients: no parameter requires a gradient");
  }
  s.claim_parameters(s.names, s.parameters);
  s.claim_parameters(sparse, sparse_params);
  s.transport = claim_transport(transport);
  if (options.auto_settings && (options.plan || options.compression.codec != "none")) {
    throw Error("compression=\"auto\" chooses the plan itself: give neither a plan nor a "
                "compression with it");
  }
  s.plan_options.bucket_bytes = options.bucket_bytes;
  s.plan_options.min_compress_elements = options.min_compress_elements;
  Plan plan = make_plan(s.names, s.parameters, options);
  if (options.auto_settings) {
    AutoSettings settings = *options.auto_settings;
    settings.bucket_bytes = options.bucket_bytes;
    settings.min_compress_elements = options.min_compress_elements;
    settings.local_size = options.engine.local_size;  // the nodes the engine will run
    s.scheduler = std::make_unique<AutoScheduler>(s.transport, plan.tensors, std::move(settings));
    // Read between steps, under the lock, while the engine is idle (end_step).
    s.scheduler->set_health_source({[shared = &s] { shared->engine->measure_mean_norms(); },
                                    [shared = &s] { return shared->engine->feedback_health(); }});
    s.scheduler->set_event_sink([shared = &s](const std::string& name,
                                              AutoScheduler::TimePoint start,
                                              AutoScheduler::TimePoint end,
                                              const nlohmann::json& args) {
      shared->engine->timeline_event(name, start, end, args);
    });
    plan = s.scheduler->initial_plan();
  }
  // The engine's tensor indices follow the plan; map our parameters onto them by name.
  std::map<std::string, size_t> index_of;
  for (size_t i = 0; i < s.names.size(); ++i) index_of[s.names[i]] = i;
  std::vector<at::Tensor> ordered;
  std::vector<std::string> names;
  for (const auto& t : plan.tensors) {
    ordered.push_back(s.parameters[index_of.at(t.name)]);
    names.push_back(t.name);
  }
  s.dense_count = ordered.size();
  // Sparse parameters after them, sorted by name: the same order on every rank.
  std::vector<size_t> by_name(sparse.size());
  std::iota(by_name.begin(), by_name.end(), size_t{0});
  std::sort(by_name.begin(), by_name.end(), [&](size_t a, size_t b) { return sparse[a] < sparse[b]; });
  for (size_t j : by_name) {
    ordered.push_back(sparse_params[j]);
    names.push_back(sparse[j]);
  }
  s.parameters = std::move(ordered);
  s.names = std::move(names);
  s.handed.assign(s.names.size(), false);
  s.used.assign(s.names.size(), 0);
  s.find_unused = options.find_unused_parameters;
  s.times.ready.assign(s.dense_count, 0.0);
  s.times.step_start = now_seconds();
  s.engine = std::make_unique<Engine>(s.transport, std::move(plan), options.engine);
  agree_on_settings(*s.transport, s.find_unused,
                    std::vector<std::string>(s.names.begin() + static_cast<std::ptrdiff_t>(s.dense_count),
                                             s.names.end()));
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
  if (s.pass_running()) {
    throw Error("DistributedGradients::synchronize() was called during a backward pass; the "
                "pass exchanges its gradients when it ends");
  }
  if (s.pass_started) s.complete_aborted_pass();  // exchanges when it handed anything over
  if (s.any_handed || s.passes_done > 0 || !s.exchanged_since_step) {
    s.exchange(/*fill_nan=*/false);
  }
  s.check_left_out();
}

void DistributedGradientsShared::check_left_out() const {
  for (auto it = left_out.rbegin(); it != left_out.rend(); ++it) {  // the model's order
    const auto& [name, parameter] = *it;
    if (parameter.requires_grad() && parameter.grad().defined()) {
      throw Error(fmt::format(
          "parameter '{}' has a gradient, but it required none when the DistributedOptimizer "
          "(DistributedGradients) was built, so it is not exchanged: a step would move it by "
          "this rank's gradient alone and the ranks would drift apart. Build the "
          "DistributedOptimizer again after changing requires_grad, around the same wrapped "
          "optimizer (its momenta stay; the compression state starts afresh)",
          name));
    }
  }
}

void DistributedGradients::step_done() {
  Shared& s = *shared_;
  std::lock_guard lock(s.mutex);
  if (s.pass_started && !s.pass_running()) s.complete_aborted_pass();
  s.end_step();
  s.exchanged_since_step = false;
  s.aborted = false;
  s.finite_since_step = true;
  s.hook_error.clear();
}

bool DistributedGradients::mean_is_finite() const {
  std::lock_guard lock(shared_->mutex);
  return shared_->finite_since_step;
}

bool DistributedGradients::pending() const {
  std::lock_guard lock(shared_->mutex);
  return shared_->any_handed || shared_->passes_done > 0 || shared_->pass_started;
}

std::string DistributedGradients::aborted_step() const {
  std::lock_guard lock(shared_->mutex);
  if (!shared_->aborted) return {};
  const std::string& cause = shared_->hook_error;
  return fmt::format(
      "gradcomp: the last backward pass raised on this rank{}; its exchange was completed with "
      "NaN so that every rank sees this step as non-finite, and the optimizer does not step on "
      "it (call zero_grad() and go on with the next batch)",
      cause.empty() ? "" : fmt::format(" ({})", cause));
}

void DistributedGradientsShared::switch_plan(const GradientOptions& options, bool trial) {
  const auto dense = static_cast<std::ptrdiff_t>(dense_count);
  const std::vector<std::string> dense_names(names.begin(), names.begin() + dense);
  const std::vector<at::Tensor> dense_parameters(parameters.begin(), parameters.begin() + dense);
  Plan plan = make_plan(dense_names, dense_parameters, options);
  engine->set_plan(in_tensor_order(std::move(plan), dense_names), trial);
}

// After an exchanged step (under the lock, the engine idle): the scheduler sees the step's
// clock and may change the plan (every rank alike: it decides from agreed numbers).
void DistributedGradientsShared::end_step() {
  if (!scheduler || !exchanged_since_step) return;
  times.step_end = now_seconds();
  if (auto plan = scheduler->on_step_end(times)) {
    GradientOptions options = plan_options;
    options.plan = std::move(*plan);
    switch_plan(options, scheduler->in_trial());
  }
  times = StepTimes{};
  times.ready.assign(dense_count, 0.0);
  times.step_start = now_seconds();  // the search's own time is not the next step's
}

void DistributedGradients::set_plan(const GradientOptions& options) {
  Shared& s = *shared_;
  std::lock_guard lock(s.mutex);
  if (s.scheduler) {
    throw Error("set_plan: compression=\"auto\" chooses the plan of this optimizer; build it "
                "with a compression or a plan to change plans by hand");
  }
  if (s.pass_running() || s.pass_started || s.any_handed || s.passes_done > 0) {
    throw Error("set_plan: gradients of this step are being handed over or accumulated and "
                "are not exchanged yet; change the plan between steps (after step())");
  }
  s.switch_plan(options);
}

nlohmann::json DistributedGradients::auto_report() const {
  std::lock_guard lock(shared_->mutex);
  return shared_->scheduler ? shared_->scheduler->report() : nlohmann::json(nullptr);
}

nlohmann::json DistributedGradients::save_auto() const {
  std::lock_guard lock(shared_->mutex);
  return shared_->scheduler ? shared_->scheduler->save() : nlohmann::json(nullptr);
}

void DistributedGradients::load_auto(const nlohmann::json& saved) {
  Shared& s = *shared_;
  std::lock_guard lock(s.mutex);
  if (!s.scheduler) {
    if (saved.is_null()) return;
    throw Error("load_auto: the state was saved with compression=\"auto\"; this optimizer was "
                "built with a compression or a plan");
  }
  if (auto plan = s.scheduler->restore(saved)) {
    GradientOptions options = s.plan_options;
    options.plan = std::move(*plan);
    s.switch_plan(options, s.scheduler->in_trial());
  }
}

void DistributedGradients::set_learning_rate(double lr) { shared_->engine->set_learning_rate(lr); }
void DistributedGradients::set_loss_scale(double scale) { shared_->engine->set_loss_scale(scale); }
const Plan& DistributedGradients::plan() const { return shared_->engine->plan(); }
StepStats DistributedGradients::last_step() const {
  std::lock_guard lock(shared_->mutex);
  StepStats stats = shared_->engine->last_step();
  stats.bytes_sent += shared_->sparse_bytes_sent;
  stats.uncompressed_bytes += shared_->sparse_dense_bytes;
  return stats;
}
uint64_t DistributedGradients::steps() const { return shared_->engine->step(); }
Transport& DistributedGradients::transport() const { return *shared_->transport; }
std::vector<std::byte> DistributedGradients::save_state(Engine::StateFor use) const {
  return shared_->engine->save_state(use);
}
std::vector<std::vector<std::byte>> DistributedGradients::save_all_states() const {
  return shared_->engine->save_all_states();
}

void DistributedGradients::load_state(std::span<const std::byte> state) {
  shared_->engine->load_state(state);
}
void DistributedGradients::set_timeline(const std::string& path) {
  shared_->engine->set_timeline(path);
}

}  // namespace gradcomp::torch
