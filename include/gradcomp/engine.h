// Engine: executes a Plan every step. Gradients arrive as they become ready (a backward hook
// calls ready()); a bucket is launched once all its tensors arrived and every earlier bucket was
// launched; encode, communication and decode of different buckets overlap on background
// threads; the mean over ranks is written back in place into the caller's gradients, and
// synchronize() waits for the step. Every rank ends every step with bit-identical gradients.
//
//   Engine engine(transport, plan, options);
//   for each step:
//     for each gradient, as backward produces it:  engine.ready(index, grad);
//     engine.synchronize();          // grads now hold the compressed mean over ranks
//     optimizer.step();
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gradcomp/plan.h"
#include "gradcomp/transport.h"

namespace gradcomp {

struct EngineOptions {
  uint64_t seed = 0;           // keys every codec's randomness; the same on all ranks
  // How long the engine waits for one collective. The transport itself fails a stuck collective
  // at its own timeout (GRADCOMP_TIMEOUT); this is the backstop. 0: twice that, plus 10 s.
  Milliseconds timeout{0};
  std::string timeline{};      // Chrome-trace path; empty: GRADCOMP_TIMELINE (may be empty)
  int local_size = 0;          // ranks per node for the hierarchical route; 0: from launcher
  int codec_threads = 1;       // threads one codec call may use
  // Buckets exchanged at once: bucket b travels on stream b % streams (Transport::stream), each
  // with its own exchange thread, so a small bucket does not wait behind a large one (as under
  // c10d's Gloo, which runs two collectives at once). Buckets of routes over nodes take stream
  // 0. One stream on a single rank and on a transport that cannot split. 0: GRADCOMP_STREAMS,
  // else 2.
  int streams = 0;
};

// What the last completed step did on this rank.
struct StepStats {
  uint64_t step = 0;
  size_t bytes_sent = 0;         // handed to the transport for other ranks, all buckets and
                                 // phases (a frame a rank addresses to itself is not counted)
  size_t uncompressed_bytes = 0;  // 4 bytes per element of every bucket
  double step_seconds = 0;       // first ready() to the end of synchronize()
  double exchange_seconds = 0;   // time in the exchange stage: collectives and the work between
                                 // them (the two-way server step, PowerSGD's rounds), summed
                                 // over the buckets (streams overlap)
  bool finite = true;            // every bucket's mean was finite; if not, every feedback and
                                 // codec state took the step back (a loss scaler skips it)
};

class Engine {
 public:
  // A collective: every rank constructs its engine together. Validates the plan, compares the
  // ranks' registered tensors, plans, seeds (and node sizes) and throws CommError naming the
  // first difference, splits the ranks into nodes for hierarchical plans, builds a route per
  // bucket and starts the threads.
  Engine(std::shared_ptr<Transport> transport, Plan plan, EngineOptions options = {});
  ~Engine();  // stops the threads; a step in flight is abandoned
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Hands over gradient `tensor` (index into plan().tensors) of this step; its span must hold
  // that tensor's element count and stay valid until synchronize() returns, which overwrites it
  // with the mean over ranks. Throws Error on an unknown index, a wrong size, or a tensor
  // handed over twice in one step.
  void ready(size_t tensor, std::span<float> grad);
  void ready(const std::string& name, std::span<float> grad);

  // Waits until every bucket of the step is written back and starts the next step. Tensors
  // not handed over are an Error naming them. Rethrows the first error of any bucket (with
  // its bucket and phase); after an error the engine is broken and every call throws.
  // It returns, or throws, only once the engine has stopped writing into the gradients
  // handed over (a collective stuck past the timeout aside): the caller may free them then.
  // A bucket whose mean holds NaN or Inf (an overflow: a loss scaler skips the step) ends the
  // step with its codec and feedback state as before it, on every rank; the step counter
  // still advances.
  void synchronize();

  // The learning rate of the coming step, for feedbacks that correct by the lr ratio.
  void set_learning_rate(double lr);
  // The loss scale the coming step's gradients carry (a GradScaler's scale; default 1). Every
  // feedback multiplies its memory by the ratio of this scale to the one it was accumulated
  // under, so the memory stays in the units of the current gradient. Throws Error unless the
  // scale is finite and above 0. Not saved in checkpoints: set it again after load_state.
  void set_loss_scale(double scale);

  // Changes the plan between steps, keeping the threads, the step counter and the learning
  // rate. A collective: every rank calls it at the same step with the same plan (a difference
  // is a CommError naming it, as at construction). The plan must register the same tensors
  // (names and sizes, in the same order); buckets, codecs, feedbacks and routes may all
  // change. Nothing of the gradients is lost: what the old routes hold and have not delivered
  // (error-feedback residuals, DGC's accumulated velocity, the two-way servers' residuals) is
  // added to each tensor's next gradient, and kept until a step that took it is kept (a
  // non-finite step hands it over again). Momenta (DGC's, nesterov's, Signum's) and codec
  // state such as PowerSGD's warm start begin anew. Option::start_step counts the engine's
  // steps, which continue. The plan in force again changes nothing (its routes and their
  // state stay). Throws Error (the engine unchanged) while a step is in flight, after a
  // failure, on an invalid plan or other tensors.
  //
  // `trial`: the plan runs for a few steps to be timed, and a later set_plan decides
  // (compression="auto"'s trials). Then the memory carried out of the old routes waits, for a
  // tensor whose bucket in this plan keeps no feedback memory (feedback none: uncompressed,
  // fp16, ...), instead of arriving whole in its next gradient: error feedback under a sparse
  // codec holds up to 1/ratio steps of gradient, and handed over at once it jolts the model
  // (a loss spike lasting tens of steps, for a trial of a few). A tensor whose bucket has
  // feedback takes it into that memory as usual, which releases it gradually. What waits is
  // delivered after the next set_plan that is not a trial (the same plan again: only that).
  void set_plan(Plan plan, bool trial = false);

  // Per bucket, between steps: the L2 norm of what this rank's feedback holds and has not
  // delivered (Route::carry: the residual, DGC's velocity, a two-way server's share) and of the
  // mean of the last step measured (0 if none was). Their ratio growing step after step is
  // error feedback falling behind (compression="auto" backs off then). A pass over the
  // feedback memory.
  struct BucketHealth {
    double residual_norm = 0;
    double mean_norm = 0;
  };
  std::vector<BucketHealth> feedback_health() const;
  // The coming step also sums the squares of each bucket's mean (in the same pass as the
  // finite check), for feedback_health(). Between steps; for that one step only.
  void measure_mean_norms();

  const Plan& plan() const;
  const StepStats& last_step() const;
  uint64_t step() const;  // steps completed
  // Bytes held by the engine: fused buffers, frames, feedback and codec state. Between steps
  // only (Error while a step is in flight).
  size_t memory_bytes() const;

  // Every codec and feedback state, what a plan change carries and the step counter, for
  // checkpoints; loading it into an engine with the same plan and seed, on the same rank of the
  // same world size, resumes bit-exactly. load_state throws Error (and changes nothing) on a
  // state saved elsewhere.
  // StateFor::kUndo: for undoing a load_state in this process (a checkpoint's all-or-nothing
  // load): state kept beyond this rank, not fetched, stays where it is.
  enum class StateFor { kCheckpoint, kUndo };
  std::vector<std::byte> save_state(StateFor use = StateFor::kCheckpoint) const;
  void load_state(std::span<const std::byte> state);
  // Between steps, a collective every rank calls before save_state(): state kept beyond this
  // rank (route 'servers': the parameter servers' codec and feedback state, each server's with
  // one worker) comes here, so that save_state() holds it; without it, save_state() of such a
  // plan throws Error saying so. A loaded state goes back to the servers with the next step.
  void fetch_remote_state();
  // Every rank's save_state() after fetch_remote_state(), indexed by rank, on every rank: a
  // collective between steps, so that one rank may write a checkpoint every rank resumes from.
  std::vector<std::vector<std::byte>> save_all_states();

  // Starts (or with an empty path stops) writing the Chrome-trace timeline.
  void set_timeline(const std::string& path);
  // Writes an event of the caller's into the timeline (when one is written), on a lane of its
  // own below the buckets' (compression="auto" marks its searches and decisions there).
  void timeline_event(std::string_view name, std::chrono::steady_clock::time_point start,
                      std::chrono::steady_clock::time_point end, const nlohmann::json& args);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradcomp
