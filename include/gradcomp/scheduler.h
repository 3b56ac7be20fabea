// AutoScheduler: compression="auto". It decides how the gradients travel from what it measures
// in the running job, with nothing supplied (no profile, no bandwidth, no worker count), and
// keeps the plan that is fastest in fact:
//
//   warm-up    the first steps run uncompressed (the convergence guard: no lossy codec before
//              it ends); during its last steps it records when each gradient becomes ready and
//              how long the steps take (the online profile);
//   calibrate  probe allreduces on the live transport give the link's latency and bandwidth;
//              each candidate codec is timed in this process, under the job's own contention;
//   propose    the planner (model::make_plan) ranks plans on that profile and cost model: its
//              best plan, the best plan of each candidate alone, the best uncompressed one;
//   trial      each proposal runs for a few steps (Engine::set_plan, so nothing of the
//              gradients is lost, and as a trial: feedback memory a plan without feedback
//              would receive at once waits for the decision); a step's time is the ranks'
//              mean of it; the lossy plans go first, uncompressed after them (it can then stop
//              early too, and a job's first steps may still run slow), and a trial clearly
//              slower than the fastest measured after its first steps stops there;
//   refine     the trials correct the model (a cost per message, compute slowed while
//              exchanging, time outside the model); the corrected model proposes again, and
//              plans it predicts faster than the fastest measured get a trial too;
//   decide     the fastest measured plan is kept, unless a lossless plan (the measured
//              uncompressed plan of the same run first) is within the trials' noise or 3% of
//              it (do no harm); a larger gain that only the noise hides is measured again;
//   watch      when the step time drifts by more than `drift` for several checks in a row (a link
//              got slower, another job arrived), when a kept compressed plan runs slower than
//              the lossless plan it beat by more than the margin it won by (do no harm,
//              watched), or a compressed plan's probe of the link finds it much faster, it
//              calibrates and decides again; when the
//              error feedback's residual keeps growing against the mean (compression costs
//              the model more and more), it backs off to a gentler plan (more bits per
//              element) and leaves that codec out of later searches.
//
// Every rank feeds it its own clock and takes the same decisions: whatever a decision depends
// on is agreed over the transport first (the maximum over ranks, or for a step's time their
// mean). Collectives are issued only
// from on_step_end(), which every rank calls once per exchanged step, between steps.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gradcomp/engine.h"
#include "gradcomp/model/cluster.h"
#include "gradcomp/model/cost_model.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/plan.h"
#include "gradcomp/transport.h"

namespace gradcomp {

struct AutoSettings {
  // Options the plans may use, "codec[|feedback[|route]]" each ("none" is always added). The
  // front ends fill in the options recommended for the optimizer's family (recommended.h). A
  // start=N field is dropped: the scheduler's own warm-up precedes every lossy codec, and a
  // trial must measure the option as it runs after its warm-up.
  std::vector<std::string> candidates;
  uint64_t warmup_steps = 30;   // uncompressed steps before any lossy codec; >= profile_steps
  uint64_t profile_steps = 10;  // the last steps of the warm-up, timed for the profile
  uint64_t trial_steps = 6;     // steps each proposal runs; its first one is not measured
  // A trial stops after this many measured steps when even its fastest step so far is slower
  // than the fastest plan measured by more than `stop_margin` and the noise (0: every trial
  // runs its trial_steps): a plan that loses clearly need not lose for long. A lossless plan
  // (uncompressed) stops only when it takes more than twice as long.
  uint64_t stop_after = 2;
  double stop_margin = 0.25;
  // Compressed plans tried besides the uncompressed one; the planner's best and the best
  // default plan always among them (docs/auto.md, "Proposals").
  size_t max_proposals = 4;
  // After those trials, the model corrected by them proposes again: up to this many plans not
  // yet tried whose corrected prediction beats the fastest measured get a trial too (0: none),
  // so the first search already profits from what its own trials taught the model.
  size_t refine_proposals = 2;
  // Then the plans measured within the trials' noise of the fastest, the fastest included and
  // at most this many (closest first), run a trial more each, in the reverse order of their
  // first ones, and the decision takes all their steps (0 or 1: none). Between plans the
  // clock cannot yet tell apart, one trial each keeps whichever had the luckiest steps; the
  // reversed order makes the machine's own drift through the search favour none of them.
  size_t runoff = 3;
  double drift = 0.2;           // a relative change of the step time that counts as drift
  uint64_t check_every = 25;    // steps between drift checks, after a decision
  uint64_t drift_checks = 3;    // consecutive checks that must see drift before deciding again
                                // (fewer for a larger drift: drift_checks x drift / |drift|, >= 1)
  // The link watch, while a compressed plan is kept: its step may not show a link that got
  // faster (it sends little), where uncompressed or a gentler codec may now win. Every
  // `link_check_every` steps (0: never; more where the probe would cost over 2% of the steps
  // between) one allreduce of a size the last calibration probed (the largest that took at
  // most 100 ms then) is timed again; when it runs `link_change` times faster than then at 2
  // checks in a row, the scheduler calibrates and decides again. A slower link needs no
  // probe: it slows the kept plan's step, which the drift watch sees.
  uint64_t link_check_every = 100;
  double link_change = 2;
  // The convergence guard's watch, at every check: per compressed bucket, the norm of the
  // residual error feedback holds over the norm of the mean (the largest over ranks). A bucket
  // whose ratio rose at `residual_checks` checks in a row, to more than `residual_growth`
  // times its value at the first check after the decision (after its memory filled: a
  // sparsifier's takes 1/ratio steps), makes the scheduler back off, if the residual's own
  // norm grew as much (a ratio raised only by a shrinking mean is no codec failing).
  double residual_growth = 4;
  uint64_t residual_checks = 3;
  // Calibration to use instead of measuring it, each on its own: a link known or recorded
  // before (the `inter` link of a `gradcomp plan --cluster` file), codec costs from `gradcomp
  // bench codecs`. Unset (the default): measured live, at every search.
  std::optional<model::Link> link;
  std::optional<model::CodecCosts> codec_costs;
  // Ranks per node (0: from the launcher, LOCAL_WORLD_SIZE or mpirun, as the engine reads
  // it; front ends pass the engine's own). When the world is several nodes of several ranks,
  // calibration fits the link inside a node and the link between nodes apart (`link` above
  // then stands for the one between nodes, `intra_link` for the one inside) and the plans may
  // take the routes over nodes (hierarchical, sharded). Needs a transport that can split
  // (gradcomp's own); on one that cannot, one flat link is calibrated and said so.
  int local_size = 0;
  std::optional<model::Link> intra_link;
  size_t bucket_bytes = 25u << 20;         // the uncompressed plan's buckets
  size_t min_compress_elements = 16384;    // smaller tensors stay uncompressed
  bool verbose = true;          // rank 0 prints each decision (stderr)

  // `start` (default settings) with the fields a JSON object names set, then validated:
  // what Python's auto= dict and the C++ example's --auto flag hold, e.g. {"warmup_steps": 20,
  // "candidates": ["powersgd:rank=4|ef", "fp16"]}; null sets nothing. known_keys() are the
  // fields' own names; the others (buckets, nodes, link, codec costs) are the front end's or a
  // calibration's. Throws SpecError naming an unknown key (with the known ones listed) or a
  // value of the wrong type.
  static AutoSettings from_json(const nlohmann::json& given);
  static AutoSettings from_json(const nlohmann::json& given, AutoSettings start);
  static std::vector<std::string> known_keys();
  // Throws SpecError naming the setting that is out of range.
  void validate() const;
  // The candidates as the planner takes them: "codec|feedback|route", without start=N and
  // without "none".
  std::vector<std::string> steady_candidates() const;
};

// One plan the scheduler tried.
struct AutoCandidate {
  std::string name;          // "planner's best", "powersgd:rank=4|ef alone", "uncompressed"
  std::string summary;       // "12 buckets: 9 powersgd:rank=4/ef/allreduce, 3 none"
  double predicted_ms = 0;   // the calibrated model's iteration time
  double measured_ms = 0;    // median over its trials' measured steps (each the ranks' mean)
  uint64_t first_step = 0;   // the engine step its (last) trial began
  Plan plan;                 // the plan itself
  int round = 1;             // 1: proposed by the model as calibrated; 2: as corrected by round 1
  double noise_ms = 0;       // measured_ms's uncertainty, from the spread of the trial's steps
  uint64_t measured_steps = 0;  // steps behind measured_ms
  bool stopped_early = false;   // its trial stopped after stop_after steps: clearly slower
  // Median over the same steps of the busiest rank's CPU time (every thread of its process).
  double cpu_ms = 0;
};

// One decision.
struct AutoDecision {
  uint64_t step = 0;             // the step from which the kept plan runs
  std::string reason;            // "first decision", "step time drifted +35% ..."
  std::vector<AutoCandidate> candidates;
  size_t kept = 0;               // index into candidates
  std::string why;               // "fastest measured", "nothing beat uncompressed: ..."
  double search_steps = 0;       // steps spent in trials
  double search_seconds = 0;     // wall time of calibration and trials (the slowest rank's)
  // What the search cost: search_seconds beyond as many steps of the uncompressed plan (its
  // measured step), calibration included; negative when the trials ran faster than that.
  double search_cost_seconds = 0;
  // Steps of the kept plan that win that cost back, by what each saves against the uncompressed
  // step: 0 when the search cost nothing, -1 when the kept plan saves nothing (uncompressed).
  double payback_steps = -1;
  model::Link link;              // the calibrated link (between nodes, when there are nodes)
  int per_node = 1;              // ranks per node the plans were made for
  model::Link intra_link;        // the link inside a node (per_node > 1)
  // The machine of the job with the most ranks per core: its ranks (those sharing its kernel)
  // and the cores they may run on. With a candidate's cpu_ms, how busy its cores were.
  int machine_ranks = 1;
  int machine_cores = 1;
  double decision_ms = 0;        // the planner's time for the proposals
  double fit_ms = 0;             // fitting the correction to all of the trials
  // Mean |predicted - measured| / measured over the trials: as predicted, and as the model
  // corrected by these trials predicts them (what the next search starts from).
  double model_error_before = 0;
  double model_error_after = 0;
  // The same for the round-2 plans, predicted by the model that round 1 corrected before they
  // ran (out of sample); -1 when no plan was refined.
  double model_error_refined = -1;
  // The candidates measured again before the decision (AutoSettings::runoff, and a lossless
  // plan whose loss to the fastest the noise may hide), in the order they ran again; the
  // fastest appears twice when a lossless plan came within its noise only after the runoff.
  std::vector<size_t> remeasured;
};

// The scheduler's clock of one step on this rank (seconds of a steady clock).
struct StepTimes {
  double step_start = 0;       // the previous on_step_end (iteration boundary)
  double first_ready = 0;      // the first gradient of the step's (last) backward pass
  double last_ready = 0;       // its last gradient
  double exchange_end = 0;     // the exchange ended (the mean is in place)
  double step_end = 0;         // now: the optimizer has stepped
  std::vector<double> ready;   // per tensor of the plan: when its gradient arrived (0: never)
};

class AutoScheduler {
 public:
  // `tensors`: the plan's tensors in the engine's order (backward order). `start`: the
  // uncompressed plan the engine runs now. A collective check follows in the first decision.
  AutoScheduler(std::shared_ptr<Transport> transport, std::vector<TensorInfo> tensors,
                AutoSettings settings);
  ~AutoScheduler();
  AutoScheduler(const AutoScheduler&) = delete;
  AutoScheduler& operator=(const AutoScheduler&) = delete;

  // The plan to start with: every tensor uncompressed, default buckets.
  Plan initial_plan() const;

  // Where the watch reads the feedback's health: `prepare` before the step before a check
  // (Engine::measure_mean_norms), `read` at the check (Engine::feedback_health of the plan in
  // force); both called from on_step_end. Without them only the clock is watched.
  struct HealthSource {
    std::function<void()> prepare;
    std::function<std::vector<Engine::BucketHealth>()> read;
  };
  void set_health_source(HealthSource source);
  // Where each search and decision is marked (Engine::timeline_event): its name ("auto:
  // search", "auto: decided", "auto: backed off"), start, end and the decision as JSON.
  using TimePoint = std::chrono::steady_clock::time_point;
  using EventSink = std::function<void(const std::string& name, TimePoint start, TimePoint end,
                                       const nlohmann::json& args)>;
  void set_event_sink(EventSink sink);

  // Called by every rank after each exchanged step, between steps (the engine idle). May issue
  // collectives on the transport (calibration, agreement). Returns the plan to run from the
  // next step on, when it changes.
  std::optional<Plan> on_step_end(const StepTimes& times);

  // What it decided so far, for auto_report(): phase, decisions, the profile and calibration.
  nlohmann::json report() const;
  // For checkpoints: the decision and calibration, so that a resumed run does not search
  // again. restore() returns the plan to run (the one kept) and resumes watching; a state
  // saved during a search resumes in the trial's plan, still a trial (in_trial()), and searches
  // again after one step.
  nlohmann::json save() const;
  std::optional<Plan> restore(const nlohmann::json& saved);

  // The plan run now and the phase ("warm-up", "trial", "decided").
  const Plan& current_plan() const;
  std::string phase() const;
  // Whether the plan run now is a trial: pass it with the plan to Engine::set_plan, which
  // then holds back the feedback memory a trial without feedback would receive at once.
  bool in_trial() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradcomp
