// DistributedGradients: connects a model's parameters to an Engine. A hook on each parameter's
// gradient accumulator hands the gradient to the engine as soon as backward has written it, so
// buckets are compressed and exchanged while backward still runs; a callback at the end of the
// backward pass waits for the exchange, so when backward() returns every gradient holds the
// compressed mean over ranks, bit-identical on every rank, as with DDP (clipping or unscaling
// right after backward() sees the mean). Both front ends (the Python DistributedOptimizer and
// the libtorch one) are thin layers on it.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gradcomp/engine.h"
#include "gradcomp/plan.h"
#include "gradcomp/scheduler.h"
#include "gradcomp/transport.h"

namespace gradcomp::torch {

using NamedParameters = std::vector<std::pair<std::string, at::Tensor>>;
struct DistributedGradientsShared;  // the state behind a DistributedGradients

// Finishes one backward pass of one DistributedGradients: called once when that pass ends
// (autograd's final callback). The pass it belongs to counts as aborted (its backward raised)
// when this object is destroyed without being called.
class EndOfBackward {
 public:
  struct Pass;
  EndOfBackward(std::weak_ptr<DistributedGradientsShared> shared,
                std::shared_ptr<Pass> pass);
  // Counts the pass; on the step's last pass hands over what backward did not produce and
  // waits for the exchange. Throws the engine's error (CommError, TimeoutError, Error).
  void operator()() const;

 private:
  std::weak_ptr<DistributedGradientsShared> shared_;
  std::shared_ptr<Pass> pass_;
};

struct GradientOptions {
  // Used when no plan is given: the default plan (25 MB buckets, tensors under
  // min_compress_elements uncompressed) with this option for the large tensors.
  Option compression{};
  size_t bucket_bytes = 25u << 20;
  size_t min_compress_elements = 16384;
  // A plan to execute instead; its tensors must be the trainable parameters, by name and size,
  // in any order the plan chooses.
  std::optional<Plan> plan;
  // compression="auto": an AutoScheduler (scheduler.h) chooses the plan from what it measures
  // in this job, starting uncompressed (default buckets of bucket_bytes, tensors under
  // min_compress_elements never compressed; both override the settings' own). No plan may be
  // given with it.
  std::optional<AutoSettings> auto_settings;
  // Gradient accumulation: gradients are exchanged during every k-th backward pass only.
  int backward_passes_per_step = 1;
  // As DDP's option of that name: after each exchange the ranks agree (one small allreduce)
  // on which parameters got a gradient on some rank; one that got none on any rank, and
  // whose mean is zero (error feedback may still flush a residual into it), is left with
  // no gradient (.grad undefined, None in Python) on every rank, so optimizers that skip such
  // parameters (Adam, weight decay) leave it alone. Off: it gets the zero mean.
  bool find_unused_parameters = false;
  // Parameters whose gradients are sparse (nn.Embedding(sparse=True), nn.EmbeddingBag(sparse=
  // True)), by name: they stay out of the plan and are exchanged as rows after the plan's
  // buckets (sparse_rows.h), uncompressed; .grad then holds the coalesced sparse mean, the
  // union of the ranks' rows (an empty sparse tensor when no rank touched a row, or no gradient
  // with find_unused_parameters). Every rank must name the same ones (CommError otherwise).
  std::vector<std::string> sparse_parameters;
  // Queues `end` to run when the backward pass now running ends. Called from a gradient hook
  // (without locks held) on the first gradient of each pass. Empty: autograd's engine queues
  // it (Engine::queue_callback); the Python front end queues a Python callable instead, so
  // that an exchange error reaches backward()'s caller with its own exception type.
  std::function<void(EndOfBackward end)> queue_end_of_backward;
  EngineOptions engine{};
};

// Whether a live DistributedGradients of this process exchanges over `transport`. A second one
// constructed over it gets a communicator split from it (Transport::split), so that each
// engine's collectives keep one order on every rank; a torch.distributed process group cannot
// be split from C++ (the Python front end makes a new group instead).
bool transport_in_use(const Transport& transport);

// Parses "codec[|feedback[|route]]", e.g. "topk:ratio=0.01|ef" or "fp16", into an Option;
// throws Error listing the codecs, feedbacks and routes when a name is unknown ("auto" is
// GradientOptions::auto_settings, and an Error saying so).
Option parse_compression(const std::string& text);

class DistributedGradients {
 public:
  // A collective: every rank constructs it together, with the same parameter names and sizes
  // (a difference is a CommError naming the first one, from the engine's check). Parameters
  // that do not require gradients are skipped; the others must be dense float32, float16 or
  // bfloat16 CPU tensors (Error naming the parameter otherwise; half-precision gradients are
  // exchanged, and their feedback kept, in float32). Tensors enter the default plan in reverse
  // order of `parameters`, the order backward usually produces their gradients.
  DistributedGradients(NamedParameters parameters, std::shared_ptr<Transport> transport,
                       GradientOptions options = {});
  ~DistributedGradients();  // removes nothing from the graph: hooks of a dead object do nothing
  DistributedGradients(const DistributedGradients&) = delete;
  DistributedGradients& operator=(const DistributedGradients&) = delete;

  // Makes every gradient hold the mean over ranks. Backward passes exchange by themselves (at
  // their end), so this waits only when there is something left: a step cut short during
  // gradient accumulation (the passes so far are exchanged now), a backward pass that raised
  // (see below), or no exchange since the last step_done() (every rank must take part: .grad,
  // or zeros where there is none, is exchanged). Parameters backward did not reach get a
  // zero gradient first. Throws the engine's error (bucket, phase, cause) when the exchange
  // fails.
  //
  // A backward pass that raised after handing over some gradients leaves the other ranks
  // waiting for the rest: the next hook, synchronize() or step_done() completes that exchange
  // with NaN for what was not handed over, so every rank's mean is non-finite for that step
  // (feedback state rolls the step back; a loss scaler skips it; a plain optimizer must not
  // step on it) instead of ranks silently differing; aborted_step() tells this rank so.
  void synchronize();
  // The optimizer stepped (or skipped) on this step's gradients: the next synchronize()
  // without a backward pass before it exchanges again.
  void step_done();
  // Whether gradients were handed over or passes counted that are not exchanged yet.
  bool pending() const;
  // After the last exchange completed a backward pass that raised on this rank: the error to
  // raise instead of stepping (naming the cause when one of our hooks raised); else empty.
  // Cleared by step_done().
  std::string aborted_step() const;
  // Whether every exchange since the last step_done() gave a finite mean. The mean is
  // bit-identical on every rank, so is this answer: a front end skips the optimizer step on
  // every rank alike when it is false (an overflow, or a pass that raised on some rank).
  bool mean_is_finite() const;

  // Changes how the gradients travel from the next exchange on, keeping the engine's threads
  // (Engine::set_plan: what the old plan's feedback holds and has not delivered is carried into
  // the next exchange; nothing of the gradients is lost). A collective: every rank calls it
  // between the same two steps with the same plan (CommError naming the difference otherwise,
  // the old plan kept). The new plan comes from `options` as at construction: its plan (the
  // trainable parameters, by name, size and shape, in any order) or else the default plan of
  // its compression, bucket_bytes and min_compress_elements; its other fields are not read.
  // Throws Error during a backward pass or while gradients are handed over or accumulated
  // and not exchanged yet (call it after step()).
  void set_plan(const GradientOptions& options);

  void set_learning_rate(double lr);
  // The factor the coming step's gradients carry (a loss scaler's scale; 1 without one): the
  // feedback memory is kept in the units of each step's gradient (Engine::set_loss_scale).
  // Between steps, or from queue_end_of_backward (called before the pass hands anything over).
  void set_loss_scale(double scale);
  const Plan& plan() const;
  // The engine's figures for the last exchange, with the sparse rows' bytes added to
  // bytes_sent and their dense size to uncompressed_bytes.
  StepStats last_step() const;
  uint64_t steps() const;
  Transport& transport() const;

  // Compression state of this rank (feedback residuals, PowerSGD factors, momenta, counters).
  std::vector<std::byte> save_state(Engine::StateFor use = Engine::StateFor::kCheckpoint) const;
  // Every rank's save_state(), indexed by rank, on every rank: a collective between steps, so
  // that one rank may write a checkpoint that every rank resumes from. It holds what dedicated
  // parameter servers keep too (Engine::fetch_remote_state), which save_state() alone cannot.
  std::vector<std::vector<std::byte>> save_all_states() const;
  void load_state(std::span<const std::byte> state);
  void set_timeline(const std::string& path);

  // compression="auto": what the scheduler decided so far (AutoScheduler::report), or null.
  nlohmann::json auto_report() const;
  // Its decision and calibration for checkpoints (null without auto), and their restore: the
  // kept plan runs from the next step, and the search is not repeated (a collective when the
  // plan changes). Between steps.
  nlohmann::json save_auto() const;
  void load_auto(const nlohmann::json& saved);

  using Shared = DistributedGradientsShared;  // what the hooks reach (weakly) from autograd

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace gradcomp::torch
