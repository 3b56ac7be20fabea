// DistributedGradients: connects a model's parameters to an Engine. A hook on each parameter's
// gradient accumulator hands the gradient to the engine as soon as backward has written it, so
// buckets are compressed and exchanged while backward still runs; synchronize() waits and
// leaves every gradient holding the compressed mean over ranks, bit-identical on every rank.
// Both front ends (the Python DistributedOptimizer and the libtorch one) are thin layers on it.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gradcomp/engine.h"
#include "gradcomp/plan.h"
#include "gradcomp/transport.h"

namespace gradcomp::torch {

using NamedParameters = std::vector<std::pair<std::string, at::Tensor>>;

struct GradientOptions {
  // Used when no plan is given: the default plan (25 MB buckets, tensors under
  // min_compress_elements uncompressed) with this option for the large tensors.
  Option compression{};
  size_t bucket_bytes = 25u << 20;
  size_t min_compress_elements = 16384;
  // A plan to execute instead; its tensors must be the trainable parameters, by name and size,
  // in any order the plan chooses.
  std::optional<Plan> plan;
  // Gradient accumulation: gradients are exchanged on every k-th backward pass only.
  int backward_passes_per_step = 1;
  EngineOptions engine{};
};

// Parses "codec[|feedback[|route]]", e.g. "topk:ratio=0.01|ef" or "fp16", into an Option;
// throws Error listing the codecs, feedbacks and routes when a name is unknown.
Option parse_compression(const std::string& text);

class DistributedGradients {
 public:
  // A collective: every rank constructs it together, with the same parameter names and sizes
  // (a difference is a CommError naming the first one, from the engine's check). Parameters
  // that do not require gradients are skipped; the others must be dense float32 CPU tensors
  // (Error naming the parameter otherwise). Tensors enter the default plan in reverse order of
  // `parameters`, the order backward usually produces their gradients.
  DistributedGradients(NamedParameters parameters, std::shared_ptr<Transport> transport,
                       GradientOptions options = {});
  ~DistributedGradients();  // removes nothing from the graph: hooks of a dead object do nothing
  DistributedGradients(const DistributedGradients&) = delete;
  DistributedGradients& operator=(const DistributedGradients&) = delete;

  // Hands over the gradients backward did not produce this step (unused parameters: a zero
  // gradient is created where there is none), waits for the exchange and starts the next step.
  // Throws the engine's error (bucket, phase, cause) when the exchange fails.
  void synchronize();
  // Whether this step's gradients were handed over (a backward pass ran since the last step).
  bool pending() const;

  void set_learning_rate(double lr);
  const Plan& plan() const;
  const StepStats& last_step() const;
  uint64_t steps() const;
  Transport& transport() const;

  // Compression state of this rank (feedback residuals, PowerSGD factors, momenta, counters).
  std::vector<std::byte> save_state() const;
  void load_state(std::span<const std::byte> state);
  void set_timeline(const std::string& path);

  struct Shared;  // the state the gradient hooks reach (weakly) from autograd's threads

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace gradcomp::torch
