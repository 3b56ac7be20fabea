// The auto scheduler's state machine (scheduler.h): warm-up -> (calibrate, propose) -> a trial
// per proposal -> (correct the model, propose again) -> a trial per new proposal -> decided,
// watching for drift -> calibrate again.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "common/environment.h"
#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/model/correction.h"
#include "gradcomp/model/planner.h"
#include "gradcomp/model/simulator.h"
#include "gradcomp/scheduler.h"
#include "schedule/agreement.h"
#include "schedule/calibration.h"
#include "schedule/host_load.h"
#include "schedule/online_profile.h"

namespace gradcomp {

using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

// A compressed plan must beat the uncompressed one by more than this share of its step time to
// be kept (and by more than the noise of the trials): a gain too small to see does not
// justify lossy compression.
constexpr double kMinGain = 0.03;
// Two trials' medians differ in fact when they lie more than this many combined uncertainties
// apart (about 95% confidence for normal noise).
constexpr double kNoiseSpan = 2.0;
// A lossless trial (the plan a lossy one must beat) stops early only when it takes more than
// this much longer than the fastest plan measured: twice as long, a gap no burst of the
// machine's noise makes (they reach +30% here), so "do no harm" is not judged on a burst.
constexpr double kLosslessStopMargin = 1.0;
constexpr int kSaveVersion = 1;
// The drift's backoff doubles the drifting checks a search needs at most this many times.
constexpr uint64_t kMaxDriftBackoff = 5;
// The link watch's probe: the largest size the calibration probed within this time (else the
// smallest). Large enough that its time is the link's rate, not its latency or a token
// bucket's burst (an emulated link of bench/cluster passes 64 KB at once: a 64 KiB probe
// hardly sees its rate).
constexpr double kLinkProbeBudget = 0.1;
// Once: the machine's noise only slows a probe, so one that ran link_change times faster than
// the calibration's fastest is evidence enough (and two checks in a row must find it).
constexpr int kLinkProbeRepeats = 1;
// The watch's share of the run's time at most: its probes are spaced at least so far apart.
constexpr double kLinkWatchShare = 0.02;
// Link checks in a row that must find the link faster before deciding again (times the drift's
// backoff): the calibration's own probe may have run at a busy moment of the machine, and one
// probe at a quiet one.
constexpr uint64_t kLinkChecks = 2;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Steps a bucket's error-feedback memory takes to fill after a plan change: an element a
// sparsifier leaves behind waits about 1 / kept_fraction steps for its turn (random-k 0.1%:
// a thousand), so its residual grows that long by design; dense codecs fill within a step.
uint64_t fill_steps(const Bucket& bucket) {
  if (bucket.option.codec == "none" || bucket.option.feedback == "none") return 0;
  const double kept = make_codec(bucket.option.codec)->traits().kept_fraction;
  return static_cast<uint64_t>(std::ceil(1.0 / std::max(kept, 1e-9)));
}

// "12 buckets: 9 powersgd:rank=4/ef/allreduce, 3 none" ("none" alone: uncompressed on the
// transport's allreduce; uncompressed over nodes shows its route)
std::string summarize(const Plan& plan) {
  std::map<std::string, int> count;
  for (const auto& b : plan.buckets) {
    const bool plain = b.option.codec == "none" && b.option.feedback == "none" &&
                       b.option.route == "allreduce";
    const std::string key = plain ? std::string("none")
                                : fmt::format("{}/{}/{}", b.option.codec, b.option.feedback,
                                              b.option.route);
    ++count[key];
  }
  std::vector<std::string> parts;
  for (const auto& [key, n] : count) parts.push_back(fmt::format("{} {}", n, key));
  return fmt::format("{} bucket{}: {}", plan.buckets.size(), plan.buckets.size() == 1 ? "" : "s",
                     fmt::join(parts, ", "));
}

// The probe the link watch repeats: the largest the calibration timed within kLinkProbeBudget,
// else the smallest; none when the link was not probed (given, or one rank).
std::optional<schedule::LinkProbe> watched_probe(const std::vector<schedule::LinkProbe>& probes) {
  if (probes.empty()) return std::nullopt;
  std::optional<schedule::LinkProbe> best;
  for (const auto& p : probes) {
    if (p.seconds <= kLinkProbeBudget && (!best || p.bytes > best->bytes)) best = p;
  }
  if (best) return best;
  return *std::min_element(probes.begin(), probes.end(),
                           [](const auto& a, const auto& b) { return a.bytes < b.bytes; });
}

// How much slower than `fastest` a lossless candidate `c` may measure and still be kept
// (decide()'s tie_margin, and the bar of the watch after it): the clock cannot tell them apart
// within their combined noise, and a gain below kMinGain is not worth a lossy codec.
double margin_between(const AutoCandidate& c, const AutoCandidate& fastest) {
  const double noise = kNoiseSpan * std::hypot(c.noise_ms, fastest.noise_ms);
  return std::max(noise, kMinGain * c.measured_ms);
}

// "41.2 ± 0.8 ms"
std::string measured_text(const AutoCandidate& c) {
  return c.noise_ms > 0 ? fmt::format("{:.1f} ± {:.1f} ms", c.measured_ms, c.noise_ms)
                        : fmt::format("{:.1f} ms", c.measured_ms);
}

json candidate_json(const AutoCandidate& c) {
  return {{"name", c.name},
          {"summary", c.summary},
          {"predicted_ms", c.predicted_ms},
          {"measured_ms", c.measured_ms},
          {"noise_ms", c.noise_ms},
          {"first_step", c.first_step},
          {"round", c.round},
          {"measured_steps", c.measured_steps},
          {"stopped_early", c.stopped_early},
          {"cpu_ms", c.cpu_ms},
          {"plan", c.plan.to_json()}};
}

// Mean |predicted - measured| / measured over the candidates of `round`; -1 when it has none.
double round_error(const std::vector<AutoCandidate>& candidates, int round) {
  double sum = 0;
  int n = 0;
  for (const auto& c : candidates) {
    if (c.round != round || c.measured_ms <= 0) continue;
    sum += std::fabs(c.predicted_ms - c.measured_ms) / c.measured_ms;
    ++n;
  }
  return n > 0 ? sum / n : -1;
}

}  // namespace

struct AutoScheduler::Impl {
  enum class Phase { kWarmup, kTrial, kDecided };

  Impl(std::shared_ptr<Transport> t, std::vector<TensorInfo> tensors_in, AutoSettings s)
      : transport(std::move(t)), tensors(std::move(tensors_in)), settings(std::move(s)),
        profile(tensors) {
    settings.validate();
    DefaultPlanSettings plain;
    plain.bucket_bytes = settings.bucket_bytes;
    plain.min_compress_elements = settings.min_compress_elements;
    uncompressed = make_default_plan(tensors, plain);
    current = uncompressed;
  }

  std::optional<Plan> on_step_end(const StepTimes& times);
  std::optional<Plan> start_search(const std::string& reason);
  std::optional<Plan> next_trial();
  std::optional<Plan> refine();
  std::optional<Plan> decide();
  double tie_margin(size_t c, size_t fastest) const;  // margin_between, by index
  bool noise_hides_gain(size_t c, size_t fastest) const;
  size_t keep_plan_in_force(size_t best) const;  // decide(): the hysteresis of a watch's search
  std::vector<size_t> close_to(size_t fastest) const;  // decide(): the runoff's candidates
  std::optional<Plan> run_off(std::vector<size_t> runoff, bool hidden_gain);
  bool remeasured(size_t c) const {  // decide(): candidate c ran again in this search
    return std::find(search.remeasured.begin(), search.remeasured.end(), c) !=
           search.remeasured.end();
  }
  std::optional<Plan> end_trial(uint64_t steps_run);
  std::optional<Plan> next_candidate();
  void take_trial_times();  // the trial's agreed steps so far into its candidate's measurement
  bool clearly_slower();    // the trial, after stop_after steps (a collective)
  void count_search_cost();  // decide(): search_seconds, search_cost_seconds, payback_steps
  std::optional<Plan> watch(double step_s);
  std::optional<Plan> watch_link();
  void restore_link_reference(const json& saved);  // restore(): optional in older states
  std::optional<Plan> watch_residuals();
  void prepare_health_if_due();
  std::optional<Plan> back_off(size_t bucket, double growth);
  std::vector<std::string> allowed_candidates() const;
  bool uses_excluded(const Plan& plan) const;  // a bucket with a codec backed off from
  std::vector<AutoCandidate> propose(const model::Profile& p, const model::CostModel& cost,
                                     const model::Correction& correction);
  model::Correction fit_to_trials() const;
  void learn_from_trials();
  void say(const std::string& text) const;
  std::optional<Plan> switch_to(const Plan& plan);
  Plan resume_in(const Plan& plan, bool trial);  // restore(): the plan to run, always returned
  int node_size();    // ranks per node of the plans: 1 unless the world is nodes of several
  void calibrate();   // link(s) and codecs, into cluster, link, codec_costs
  int agreed_servers();  // the dedicated parameter servers every rank sees (0: none)

  std::shared_ptr<Transport> transport;
  std::vector<TensorInfo> tensors;
  AutoSettings settings;
  schedule::OnlineProfile profile;
  Plan uncompressed;  // the warm-up's plan
  Plan current;
  Phase phase = Phase::kWarmup;
  bool current_is_trial = false;  // `current` runs as a trial (AutoScheduler::in_trial)
  uint64_t steps = 0;  // on_step_end calls: exchanged steps

  // The search under way (phase kTrial) and the decisions made.
  std::optional<model::Profile> measured_profile;
  schedule::LinkFit link;
  model::Cluster cluster;                   // the last calibration's, for the report
  std::optional<model::CodecCosts> codec_costs;
  model::Correction correction;     // fitted to the last search's trials
  AutoDecision search;
  // The order of the trials (indices into search.candidates): the lossy plans of the first
  // round, then uncompressed (index 0), then the second round's plans (refine()).
  std::vector<size_t> order;
  size_t trial = 0;                // index into order
  bool refined = false;            // the second round was proposed
  std::vector<double> trial_times;  // this rank's measured steps of the trial
  std::vector<double> trial_cpu;    // this process's CPU time in each of them
  // Each candidate's agreed steps (the ranks' mean of each, take_trial_times), over all of its
  // trials, and the busiest rank's CPU time in them.
  std::vector<std::vector<double>> candidate_times;
  std::vector<std::vector<double>> candidate_cpu;
  // This process's CPU seconds at the last step's end (each step's CPU time is the difference).
  double cpu_at_step_end = schedule::process_cpu_seconds();
  std::optional<schedule::MachineShare> machine;  // found by the first search
  std::vector<size_t> again;  // candidates to measure once more before deciding (decide())
  bool ran_off = false;       // this search's runoff is done, or was not needed (decide())
  uint64_t trial_steps_run = 0;      // steps the search's trials ran (their first steps included)
  size_t trying() const { return again.empty() ? order[trial] : again.front(); }  // its plan
  Clock::time_point search_start;
  std::vector<AutoDecision> decisions;

  // Watching (phase kDecided).
  double reference_ms = 0;  // the kept plan's measured step
  std::vector<double> window;
  uint64_t drifting = 0;    // consecutive checks that saw drift
  // Do no harm, watched: a compressed plan kept must go on beating the lossless plan the
  // search measured (its step, and the margin it had to beat it by); 0 when the plan in force
  // is lossless or the search measured none. Consecutive checks that found it slower.
  double lossless_ms = 0;
  double harm_margin_ms = 0;
  uint64_t harming = 0;
  double last_check_ms = 0;  // the last check's step (the ranks' mean of their medians)
  void set_watch_bars(const AutoDecision& d);  // reference_ms and the lossless bar
  std::optional<Plan> watch_harm(double ms);
  // Searches the drift started that kept the plan they started from, in a row (at most
  // kMaxDriftBackoff): each doubles the drifting checks the next search needs.
  uint64_t drift_backoff = 0;
  bool drift_search = false;  // the search under way was started by the drift
  Plan searched_from;         // the plan in force when it started
  uint64_t drift_checks_needed() const { return settings.drift_checks << drift_backoff; }
  uint64_t drift_checks_for(double change) const;  // fewer for a larger drift
  // The link watch (settings.link_check_every): the probe it repeats, as the last calibration
  // timed it (none when the link was given), the last time it took, and the checks in a row
  // that found the link faster by link_change.
  std::optional<schedule::LinkProbe> link_reference;
  int link_per_node = 1;  // > 1: probed between the node leaders
  double link_last_s = 0;
  uint64_t link_faster = 0;
  uint64_t link_checks_needed() const { return kLinkChecks << drift_backoff; }
  uint64_t link_check_every() const;          // settings.link_check_every, or more to cost little
  void note_drift_outcome(const Plan& kept);  // decide(): drift_backoff and search.why
  AutoScheduler::HealthSource health;
  AutoScheduler::EventSink events;
  void mark(const std::string& name, Clock::time_point start, const AutoDecision& d) const;
  std::vector<double> first_ratio, last_ratio;  // per bucket of the plan in force
  std::vector<double> first_residual;           // the residual's norm where first_ratio is
  std::vector<uint64_t> judged_from;            // the step each bucket's memory has filled
  std::vector<uint64_t> rising;                 // consecutive checks each ratio rose
  uint64_t watch_from = 0;  // the step from which the plan in force is watched
  std::set<std::string> excluded_codecs;        // backed off from: left out of later searches
  bool search_on_resume = false;  // restored from a state saved during a trial
  std::shared_ptr<const NodeGroups> nodes;  // at the first search that finds several nodes
  bool flat_only = false;         // the transport cannot split: one flat link
};

// Bits per element a plan sends, averaged over its elements (32 uncompressed): more is gentler.
double plan_bits(const Plan& plan) {
  double bits = 0, elements = 0;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto n = static_cast<double>(plan.bucket_elements(b));
    const std::string& codec = plan.buckets[b].option.codec;
    bits += n * (codec == "none" ? 32.0 : make_codec(codec)->traits().bits_per_element);
    elements += n;
  }
  return elements > 0 ? bits / elements : 32.0;
}

std::vector<std::string> AutoScheduler::Impl::allowed_candidates() const {
  std::vector<std::string> out;
  for (const auto& c : settings.steady_candidates()) {
    if (!excluded_codecs.contains(make_codec(parse_option(c).codec)->name())) out.push_back(c);
  }
  return out;
}

bool AutoScheduler::Impl::uses_excluded(const Plan& plan) const {
  return std::any_of(plan.buckets.begin(), plan.buckets.end(), [&](const Bucket& b) {
    return b.option.codec != "none" && excluded_codecs.contains(make_codec(b.option.codec)->name());
  });
}

void AutoScheduler::Impl::say(const std::string& text) const {
  if (settings.verbose && transport->rank() == 0) {
    std::fprintf(stderr, "gradcomp auto: %s\n", text.c_str());
  }
}

// A plan that runs already is returned again when it becomes a trial or stops being one (a
// trial's plan kept by the decision, the first trial when it is the plan in force): the engine
// then holds back, or delivers, what a trial without feedback would receive (Engine::set_plan).
std::optional<Plan> AutoScheduler::Impl::switch_to(const Plan& plan) {
  const bool trial = phase == Phase::kTrial;
  if (plan == current && trial == current_is_trial) return std::nullopt;
  current = plan;
  current_is_trial = trial;
  return plan;
}

Plan AutoScheduler::Impl::resume_in(const Plan& plan, bool trial) {
  current = plan;
  current_is_trial = trial;
  return plan;
}

std::optional<Plan> AutoScheduler::Impl::on_step_end(const StepTimes& t) {
  ++steps;
  const double step_s = std::max(0.0, t.step_end - t.step_start);
  const double cpu_now = schedule::process_cpu_seconds();
  const double cpu_s = cpu_now - cpu_at_step_end;
  cpu_at_step_end = cpu_now;
  switch (phase) {
    case Phase::kWarmup:
      if (steps + settings.profile_steps > settings.warmup_steps) profile.add(t);
      if (steps < settings.warmup_steps) return std::nullopt;
      return start_search("first decision, after the uncompressed warm-up");
    case Phase::kTrial: {
      // The trial's first step (the plan change's own) is not measured.
      const uint64_t into = steps - search.candidates[trying()].first_step;  // 0: the first
      if (into >= 1) {
        trial_times.push_back(step_s);
        trial_cpu.push_back(cpu_s);
      }
      if (into + 1 >= settings.trial_steps) return end_trial(into + 1);
      if (into == settings.stop_after && again.empty() && clearly_slower()) {
        search.candidates[trying()].stopped_early = true;
        return end_trial(into + 1);
      }
      return std::nullopt;
    }
    case Phase::kDecided:
      if (search_on_resume) {
        search_on_resume = false;
        return start_search("resumed from a state saved during a search: searching again");
      }
      if (auto plan = watch_link()) return plan;
      return watch(step_s);
  }
  return std::nullopt;
}

std::optional<Plan> AutoScheduler::Impl::end_trial(uint64_t steps_run) {
  take_trial_times();
  trial_steps_run += steps_run;
  if (!again.empty()) {  // measuring a hidden gain again (decide())
    again.erase(again.begin());
    return again.empty() ? decide() : next_trial();
  }
  return next_candidate();
}

std::optional<Plan> AutoScheduler::Impl::next_candidate() {
  ++trial;
  if (trial < order.size()) return next_trial();
  return refined ? decide() : refine();
}

std::optional<Plan> AutoScheduler::Impl::start_search(const std::string& reason) {
  searched_from = current;
  search_start = Clock::now();
  search = AutoDecision{};
  search.reason = reason;
  if (transport->size() < 2) {  // nothing travels: nothing to gain
    search.candidates.push_back({"uncompressed", summarize(uncompressed), 0, 0, steps + 1,
                                 uncompressed});
    search.why = "one rank: nothing is exchanged, so nothing is compressed";
    search.step = steps + 1;
    decisions.push_back(search);
    phase = Phase::kDecided;
    say(search.why);
    return switch_to(uncompressed);
  }
  if (!measured_profile) measured_profile = profile.agreed(*transport);
  calibrate();
  if (!machine) machine = schedule::most_crowded_machine(*transport);
  search.machine_ranks = machine->ranks;
  search.machine_cores = machine->cores;
  const model::CodecCosts& codecs = *codec_costs;
  search.link = cluster.inter;
  search.per_node = cluster.per_node;
  search.intra_link = cluster.intra;
  // The previous search's trials corrected the model (identity before the first).
  const model::CostModel cost = correction.cost_model(cluster, codecs);
  const auto planning = Clock::now();
  search.candidates = propose(correction.applied(*measured_profile), cost, correction);
  search.decision_ms = 1e3 * seconds_since(planning);
  // Uncompressed runs last in the first round: it can stop early when a lossy plan is clearly
  // faster (at 100 Mbit/s its steps take 40 times theirs), and it is not measured in the
  // job's first steps, which may still run slow (docs/auto.md, "Trials").
  order.clear();
  for (size_t i = 1; i < search.candidates.size(); ++i) order.push_back(i);
  order.push_back(0);
  trial = 0;
  refined = false;
  trial_times.clear();
  trial_cpu.clear();
  candidate_times.clear();
  candidate_cpu.clear();
  again.clear();
  ran_off = false;
  trial_steps_run = 0;
  phase = Phase::kTrial;
  const std::string nodes_text =
      cluster.per_node == 1
          ? std::string()
          : fmt::format(" between {} nodes, {:.0f} us, {} inside a node of {}",
                        cluster.workers / cluster.per_node, 1e6 * cluster.intra.latency_s,
                        model::format_rate(cluster.intra.bytes_per_s), cluster.per_node);
  say(fmt::format("{} (step {}): link {:.0f} us, {}{}; trying {} plan{} for {} steps each", reason,
                  steps, 1e6 * link.link.latency_s, model::format_rate(link.link.bytes_per_s),
                  nodes_text, search.candidates.size(), search.candidates.size() == 1 ? "" : "s",
                  settings.trial_steps));
  return next_trial();
}

int AutoScheduler::Impl::node_size() {
  if (flat_only) return 1;
  const int local = settings.local_size > 0 ? settings.local_size
                                            : launch_info_from_environment().local_size;
  const int world = transport->size();
  if (local >= 2 && world % local != 0) {
    flat_only = true;  // said once
    say(fmt::format("{} ranks do not make nodes of {} (the local size): calibrating one flat "
                    "link, no routes over nodes",
                    world, local));
  }
  if (local < 2 || world % local != 0 || world / local < 2) return 1;
  if (!nodes) {
    try {
      nodes = transport->nodes(local);
    } catch (const Error& e) {  // every rank's transport fails alike (split is not supported)
      flat_only = true;
      say(fmt::format("{} nodes of {} ranks, but no node routes: {}; calibrating one flat link",
                      world / local, local, e.what()));
      return 1;
    }
  }
  return local;
}

// The links (given, or measured here: inside and between nodes apart when there are nodes)
// and the codecs' costs, all agreed over the ranks.
void AutoScheduler::Impl::calibrate() {
  cluster = model::Cluster{};
  cluster.workers = transport->size();
  cluster.per_node = node_size();
  if (cluster.per_node == 1) {
    link = settings.link ? schedule::LinkFit{*settings.link, {}}
                         : schedule::calibrate_link(*transport);
    cluster.inter = cluster.intra = link.link;
  } else {
    schedule::NodeLinkFit fit;
    if (!settings.link || !settings.intra_link) fit = schedule::calibrate_node_links(*transport, *nodes);
    link = settings.link ? schedule::LinkFit{*settings.link, {}} : fit.inter;
    cluster.inter = link.link;
    cluster.intra = settings.intra_link ? *settings.intra_link : fit.intra.link;
  }
  codec_costs = settings.codec_costs ? *settings.codec_costs
                                     : schedule::calibrate_codecs(*transport, allowed_candidates());
  cluster.servers = agreed_servers();
  link_reference = watched_probe(link.probes);
  link_per_node = cluster.per_node;
  link_faster = 0;
}

// The job's dedicated parameter servers (GRADCOMP_SERVERS with GRADCOMP_SERVER_STORE, as
// `gradcomp launch --servers` sets them), so that the planner may offer route servers; 0 when
// there are none. Every rank must see the same count.
int AutoScheduler::Impl::agreed_servers() {
  const auto count = env_int("GRADCOMP_SERVERS", 1, 4096, "parameter servers of the job");
  const double mine = count && env_text("GRADCOMP_SERVER_STORE") ? static_cast<double>(*count) : 0;
  const auto most = schedule::max_over_ranks(*transport, {mine, -mine});
  if (most[0] != -most[1]) {
    throw Error(
        fmt::format("auto: the ranks see from {} to {} parameter servers "
                    "(GRADCOMP_SERVERS and GRADCOMP_SERVER_STORE must be the same on "
                    "every worker)",
                    -most[1], most[0]));
  }
  return static_cast<int>(mine);
}

std::vector<AutoCandidate> AutoScheduler::Impl::propose(const model::Profile& p,
                                                        const model::CostModel& cost,
                                                        const model::Correction& correction) {
  model::PlannerSettings planner;
  // The default plan's rule, per tensor: the planner's plans compress no small tensor either.
  planner.small_tensor_elements = settings.min_compress_elements;
  // One lossy step per tensor: the candidates' accuracy was measured so (docs/recommended.md),
  // and a route that compresses again on the way back (twoway, servers, or lossy inside the
  // node) adds its error a second time: dither over twoway ended 4.1% above uncompressed on the
  // language model at 4 ranks where dither held (docs/auto.md). A candidate that names such a
  // route ("onebit:block=256|ef|twoway", CLAN's recipe) keeps it.
  planner.one_lossy_step = true;
  // The planner searches with one slow-down; each plan it proposes is then predicted with its
  // codecs' own (model::Correction::lambda_of).
  planner.simulator = {.lambda = correction.lambda};
  const auto predict = [&](const Plan& plan) {
    return model::simulate(p, plan, cost, correction.simulator(plan)).iteration_s;
  };
  std::vector<AutoCandidate> compressed;
  std::set<uint64_t> seen{uncompressed.hash()}, default_plans;
  const auto push = [&](const std::string& name, const Plan& plan) {
    compressed.push_back({name, summarize(plan), 1e3 * predict(plan), 0, 0, plan});
  };
  const auto add = [&](const std::string& name, const Plan& plan) {
    if (!plan.compressed() || !seen.insert(plan.hash()).second) return false;
    push(name, plan);
    return true;
  };
  const auto options = allowed_candidates();
  planner.codecs = options;
  const model::PlanResult best = model::make_plan(p, cost, planner);
  const bool planner_best = add("the planner's best", best.plan);
  for (const auto& c : options) {
    planner.codecs = {c};
    add(fmt::format("{} alone", c), model::make_plan(p, cost, planner).plan);
    DefaultPlanSettings plain;
    plain.bucket_bytes = settings.bucket_bytes;
    plain.min_compress_elements = settings.min_compress_elements;
    plain.compressed = parse_option(c);
    const Plan plan = make_default_plan(tensors, plain);
    if (add(fmt::format("{}, default plan", c), plan)) default_plans.insert(plan.hash());
  }
  const auto by_prediction = [](const auto& a, const auto& b) {
    return a.predicted_ms < b.predicted_ms;
  };
  std::stable_sort(compressed.begin(), compressed.end(), by_prediction);
  // Among the first max_proposals, always the planner's best: the plan `gradcomp plan` makes
  // from the saved calibration, so that the decision replays offline (the planner's search is
  // a heuristic, and may predict another candidate's plan faster; the trials decide). And at
  // least one default plan (few large buckets, what a user would write), the one the model
  // ranks best: the model can be wrong about it (the trials are there to find out), and trials
  // of plans of few and of many buckets let the fit tell a cost per message from a fixed
  // overhead. The rest by prediction.
  if (compressed.size() > settings.max_proposals) {
    const auto is_default = [&](const auto& c) { return default_plans.contains(c.plan.hash()); };
    const auto best_default = std::find_if(compressed.begin(), compressed.end(), is_default);
    std::set<uint64_t> must;
    if (planner_best) must.insert(best.plan.hash());
    if (best_default != compressed.end() && settings.max_proposals >= 2) {
      must.insert(best_default->plan.hash());
    }
    std::stable_partition(compressed.begin(), compressed.end(),
                          [&](const auto& c) { return must.contains(c.plan.hash()); });
    compressed.resize(settings.max_proposals);
    std::stable_sort(compressed.begin(), compressed.end(), by_prediction);
  }
  // A search the watch started tries the plan in force too, whatever the model thinks of it,
  // one trial more than max_proposals: decide() keeps it unless another plan measures clearly
  // faster (keep_plan_in_force). Pushed past `seen`: the cut above may have dropped it.
  if (drift_search && searched_from.compressed() && !uses_excluded(searched_from) &&
      std::none_of(compressed.begin(), compressed.end(),
                   [&](const auto& c) { return c.plan == searched_from; })) {
    push("the plan in force", searched_from);
  }
  std::vector<AutoCandidate> all{{"uncompressed", summarize(uncompressed),
                                  1e3 * predict(uncompressed), 0, 0,
                                  uncompressed}};
  // Over nodes, the best uncompressed plan may take the routes over nodes: lossless, so it
  // needs no accuracy evidence, and a lossy plan must beat it as it must beat uncompressed.
  const Plan& lossless = best.uncompressed_plan;
  if (cluster.per_node > 1 && lossless.hash() != uncompressed.hash() &&
      std::any_of(lossless.buckets.begin(), lossless.buckets.end(),
                  [](const Bucket& b) { return route_needs_nodes(b.option.route); })) {
    all.push_back({"the planner's best uncompressed plan", summarize(lossless),
                   1e3 * predict(lossless), 0, 0, lossless});
  }
  all.insert(all.end(), compressed.begin(), compressed.end());
  return all;
}

// The trial's steps, agreed over the ranks, join the candidate's earlier ones, if it ran
// before: its measurement is the median of them all. A step's time is the mean of the ranks'
// times of it: the ranks of a synchronous job take as long over any run of steps, and each
// rank's clock of one step adds its own jitter, so the slowest rank's time of each step counts
// every rank's jitter and overstates the step the job takes (by 4-9% at 4 ranks on 2 shared
// cores, 8-15% at 8, against the ranks' mean step over the run; the ranks' mean of each step
// came within 1.6%). Its CPU time per step is the busiest rank's (one collective for both).
void AutoScheduler::Impl::take_trial_times() {
  const size_t c = trying();
  candidate_times.resize(search.candidates.size());
  candidate_cpu.resize(search.candidates.size());
  std::vector<double> mine = trial_times;
  mine.insert(mine.end(), trial_cpu.begin(), trial_cpu.end());
  const auto world = static_cast<size_t>(transport->size());
  const auto gathered = schedule::gather_over_ranks(*transport, mine);
  const auto means = schedule::rows_mean(gathered, world);
  const auto most = schedule::rows_max(gathered, world);
  const auto n = static_cast<std::ptrdiff_t>(trial_times.size());
  candidate_times[c].insert(candidate_times[c].end(), means.begin(), means.begin() + n);
  candidate_cpu[c].insert(candidate_cpu[c].end(), most.begin() + n, most.end());
  AutoCandidate& candidate = search.candidates[c];
  candidate.measured_ms = 1e3 * schedule::median(candidate_times[c]);
  candidate.noise_ms = 1e3 * schedule::median_uncertainty(candidate_times[c]);
  candidate.measured_steps = candidate_times[c].size();
  candidate.cpu_ms = 1e3 * schedule::median(candidate_cpu[c]);
  trial_times.clear();
  trial_cpu.clear();
}

// Whether the trial under way is already clearly slower than the fastest plan measured: its
// fastest step so far (as agreed: the ranks' mean) beyond that plan's median by stop_margin (a
// lossless plan: kLosslessStopMargin) and the noise. Its steps so far become its measurement
// either way. Every rank reaches this at the same step and judges the same agreed numbers.
bool AutoScheduler::Impl::clearly_slower() {
  const size_t c = trying();
  if (settings.stop_after == 0) return false;
  take_trial_times();
  const AutoCandidate* fastest = nullptr;
  for (size_t i = 0; i < search.candidates.size(); ++i) {
    const AutoCandidate& other = search.candidates[i];
    if (i == c || other.measured_steps == 0) continue;
    if (!fastest || other.measured_ms < fastest->measured_ms) fastest = &other;
  }
  if (!fastest) return false;
  const auto& times = candidate_times[c];
  const double best_ms = 1e3 * *std::min_element(times.begin(), times.end());
  const double margin = search.candidates[c].plan.compressed()
                            ? settings.stop_margin
                            : std::max(settings.stop_margin, kLosslessStopMargin);
  return best_ms > fastest->measured_ms * (1 + margin) + kNoiseSpan * fastest->noise_ms;
}

std::optional<Plan> AutoScheduler::Impl::next_trial() {
  AutoCandidate& c = search.candidates[trying()];
  c.first_step = steps + 1;
  // The trial's first step is not measured, whether the plan changes or not (the step after a
  // calibration is no fairer a sample than the first step of a new plan).
  return switch_to(c.plan);
}

// The first round's trials correct the model; the corrected model proposes again, and each new
// plan it predicts faster than the fastest measured one gets a trial of its own. The model
// errs most where it matters most (many small messages, codecs on cores the workers share), so
// its first ranking may leave out the plan that wins; its corrected ranking is worth a few
// steps more. Every rank proposes from the same agreed numbers, so they add the same plans.
std::optional<Plan> AutoScheduler::Impl::refine() {
  refined = true;
  if (settings.refine_proposals == 0) return decide();
  const model::Correction fitted = fit_to_trials();
  const model::CostModel cost = fitted.cost_model(cluster, *codec_costs);
  double fastest = search.candidates.front().measured_ms;
  std::set<uint64_t> tried;
  for (const auto& c : search.candidates) {
    fastest = std::min(fastest, c.measured_ms);
    tried.insert(c.plan.hash());
  }
  size_t added = 0;
  for (auto& c : propose(fitted.applied(*measured_profile), cost, fitted)) {
    if (added == settings.refine_proposals) break;
    if (tried.contains(c.plan.hash()) || c.predicted_ms >= fastest) continue;
    c.name += ", corrected model";
    c.round = 2;
    order.push_back(search.candidates.size());
    search.candidates.push_back(std::move(c));
    ++added;
  }
  if (added == 0) return decide();
  say(fmt::format(
      "the trials corrected the model (error {:.0f}% -> {:.0f}%); trying {} more "
      "plan{} it predicts faster than {:.1f} ms",
      100 * fitted.error_before, 100 * fitted.error_after, added, added == 1 ? "" : "s", fastest));
  return next_trial();
}

double AutoScheduler::Impl::tie_margin(size_t c, size_t fastest) const {
  return margin_between(search.candidates[c], search.candidates[fastest]);
}

// Whether lossless candidate `c`, kept within tie_margin of the lossy `fastest`, hides a gain
// larger than kMinGain behind the trials' noise alone: then both are worth a second trial.
bool AutoScheduler::Impl::noise_hides_gain(size_t c, size_t fastest) const {
  const auto& cs = search.candidates;
  return cs[fastest].plan.compressed() &&
         cs[c].measured_ms - cs[fastest].measured_ms > kMinGain * cs[c].measured_ms;
}

// What the search cost against running uncompressed all along, and how many steps of the kept
// plan win it back. Wall time: calibration, planning and the trials as the job ran them (the
// slowest rank's, agreed, so every rank reports the same).
void AutoScheduler::Impl::count_search_cost() {
  const auto& cs = search.candidates;
  search.search_seconds = schedule::max_over_ranks(*transport, {seconds_since(search_start)})[0];
  const double plain_s = cs.front().measured_ms / 1e3;
  const double kept_s = cs[search.kept].measured_ms / 1e3;
  search.search_cost_seconds = search.search_seconds - search.search_steps * plain_s;
  search.payback_steps = search.kept == 0 || kept_s >= plain_s
                             ? -1
                             : std::max(0.0, search.search_cost_seconds) / (plain_s - kept_s);
}

// The plans whose trials the clock cannot tell from the fastest's (their medians less than
// kNoiseSpan combined uncertainties apart), the fastest first, closest next, at most
// settings.runoff of them; none when that is fewer than two. A trial stopped early was clearly
// slower.
std::vector<size_t> AutoScheduler::Impl::close_to(size_t fastest) const {
  const auto& cs = search.candidates;
  std::vector<size_t> close{fastest};
  for (size_t i = 0; i < cs.size(); ++i) {
    if (i == fastest || cs[i].measured_steps == 0 || cs[i].stopped_early) continue;
    const double noise = kNoiseSpan * std::hypot(cs[i].noise_ms, cs[fastest].noise_ms);
    if (cs[i].measured_ms - cs[fastest].measured_ms < noise) close.push_back(i);
  }
  std::stable_sort(close.begin() + 1, close.end(), [&](size_t a, size_t b) {
    return cs[a].measured_ms < cs[b].measured_ms;
  });
  if (settings.runoff < 2) close.resize(1);
  if (close.size() > settings.runoff) close.resize(settings.runoff);
  return close.size() >= 2 ? close : std::vector<size_t>{};
}

// Measures the runoff's plans once more, the last tried first: with the first trials, an
// A B C C B A order, in which a machine slowing down or speeding up through the search (a
// trend) adds the same to each plan's steps. decide() again then, on all of their steps.
std::optional<Plan> AutoScheduler::Impl::run_off(std::vector<size_t> runoff, bool hidden_gain) {
  auto& cs = search.candidates;
  std::stable_sort(runoff.begin(), runoff.end(),
                   [&](size_t a, size_t b) { return cs[a].first_step > cs[b].first_step; });
  std::vector<std::string> measured;
  for (size_t c : runoff) {
    measured.push_back(fmt::format("{} {}", cs[c].name, measured_text(cs[c])));
  }
  say(fmt::format("{}: {}; measuring them again, the last tried first",
                  fmt::join(measured, ", "),
                  hidden_gain ? fmt::format("a gain above {:.0f}% that the trials' noise hides",
                                            100 * kMinGain)
                              : std::string("within the trials' noise of each other")));
  search.remeasured.insert(search.remeasured.end(), runoff.begin(), runoff.end());
  again = std::move(runoff);
  return next_trial();
}

// Keeps the fastest measured plan, unless a lossless one (uncompressed first, in list order)
// measured within tie_margin of it: a lossy plan must beat the lossless plans by more than the
// trials' noise and kMinGain. Among lossy plans the clock alone decides: the model's ranking,
// which it was once given as a tie-break, is what the trials are there to overrule (under
// AdamW at 100 Mbit/s it kept a plan 2.4% slower than the fastest). Plans within the noise of
// the fastest, and a lossless plan whose loss to it the noise may hide (a gain above
// kMinGain), are measured once more first (run_off), and decided on all their steps.
std::optional<Plan> AutoScheduler::Impl::decide() {
  auto& cs = search.candidates;
  size_t fastest = 0;
  for (size_t i = 1; i < cs.size(); ++i) {
    if (cs[i].measured_ms < cs[fastest].measured_ms) fastest = i;
  }
  size_t best = fastest;
  for (size_t i = 0; i < fastest; ++i) {
    if (!cs[i].plan.compressed() &&
        cs[i].measured_ms <= cs[fastest].measured_ms + tie_margin(i, fastest)) {
      best = i;
      break;
    }
  }
  if (!ran_off) {
    ran_off = true;
    std::vector<size_t> runoff = close_to(fastest);
    const bool hidden_gain = best != fastest && noise_hides_gain(best, fastest);
    for (size_t c : {fastest, best}) {  // both, whatever the runoff's size
      if (hidden_gain && std::find(runoff.begin(), runoff.end(), c) == runoff.end()) {
        runoff.push_back(c);
      }
    }
    if (runoff.size() >= 2) return run_off(std::move(runoff), hidden_gain);
  } else if (best != fastest && noise_hides_gain(best, fastest) && !remeasured(best)) {
    // The runoff's steps widened the fastest's noise until a lossless plan it had beaten
    // clearly came within it; that plan has not run again: now both do (each lossless plan
    // at most once more, so this ends).
    return run_off({fastest, best}, true);
  }
  const size_t chosen = best;
  best = keep_plan_in_force(best);
  const AutoCandidate& plain = cs.front();
  const auto ms = measured_text;
  if (best != chosen) {
    search.why = fmt::format(
        "kept the plan in force: {} against {} uncompressed ({:.2f}x); the fastest, {} ({}), "
        "did not beat it by more than {:.1f} ms ({:.0f}% or the trials' noise, the larger)",
        ms(cs[best]), ms(plain), plain.measured_ms / cs[best].measured_ms, cs[chosen].name,
        ms(cs[chosen]), tie_margin(best, chosen), 100 * kMinGain);
  } else if (best == 0 && fastest != 0) {
    search.why = fmt::format(
        "nothing beat uncompressed ({}) by more than {:.1f} ms ({:.0f}% or the trials' noise, "
        "the larger): the fastest, {}, measured {}; running uncompressed",
        ms(plain), tie_margin(0, fastest), 100 * kMinGain, cs[fastest].name, ms(cs[fastest]));
  } else if (best == 0) {
    search.why = fmt::format("nothing beat uncompressed ({}); running uncompressed", ms(plain));
  } else if (!cs[best].plan.compressed()) {  // lossless, over nodes
    search.why = fmt::format("{} uncompressed over nodes against {} for the default uncompressed "
                             "plan ({:.2f}x)",
                             ms(cs[best]), ms(plain), plain.measured_ms / cs[best].measured_ms);
    if (best != fastest) {
      search.why += fmt::format("; the fastest, {} ({}), did not beat it by more than {:.1f} ms "
                                "({:.0f}% or the trials' noise, the larger)",
                                cs[fastest].name, ms(cs[fastest]), tie_margin(best, fastest),
                                100 * kMinGain);
    }
  } else {
    search.why = fmt::format("fastest measured: {} against {} uncompressed ({:.2f}x)",
                             ms(cs[best]), ms(plain), plain.measured_ms / cs[best].measured_ms);
  }
  if (!search.remeasured.empty()) {
    std::vector<std::string> names;
    for (size_t c : search.remeasured) {
      if (std::find(names.begin(), names.end(), cs[c].name) == names.end()) {
        names.push_back(cs[c].name);
      }
    }
    search.why += fmt::format("; measured twice, as the trials' noise could not tell them apart: "
                              "{}",
                              fmt::join(names, ", "));
  }
  const std::string busy = schedule::cpu_bound_note(machine.value_or(schedule::MachineShare{}),
                                                    cs[best].cpu_ms, cs[best].measured_ms);
  if (!busy.empty()) search.why += "; " + busy;
  note_drift_outcome(cs[best].plan);
  search.kept = best;
  search.step = steps + 1;
  search.search_steps = static_cast<double>(trial_steps_run);
  count_search_cost();
  set_watch_bars(search);
  window.clear();
  drifting = 0;
  first_ratio.clear();
  watch_from = search.step;
  phase = Phase::kDecided;
  std::vector<std::string> lines;
  for (const auto& c : cs) {
    lines.push_back(
        fmt::format("  {:<52} predicted {:8.1f} ms, measured {:8.1f} ± {:.1f} ms, CPU {:6.1f} "
                    "ms{}  [{}]",
                    c.name, c.predicted_ms, c.measured_ms, c.noise_ms, c.cpu_ms,
                    c.stopped_early ? " (stopped early)" : "", c.summary));
  }
  mark("auto: decided", search_start, search);
  const std::string payback =
      search.payback_steps < 0
          ? std::string()
          : fmt::format(", won back after {:.0f} steps of the kept plan", search.payback_steps);
  say(fmt::format("decided at step {}: kept '{}' ({}); search took {:.1f} s, {:+.1f} s against as "
                  "many uncompressed steps{}\n{}",
                  steps, cs[best].name, search.why, search.search_seconds,
                  search.search_cost_seconds, payback, fmt::join(lines, "\n")));
  learn_from_trials();
  decisions.push_back(search);
  prepare_health_if_due();
  return switch_to(cs[best].plan);
}

std::optional<Plan> AutoScheduler::Impl::watch(double step_s) {
  window.push_back(step_s);
  if (window.size() < settings.check_every) {
    prepare_health_if_due();
    return std::nullopt;
  }
  if (auto plan = watch_residuals()) return plan;
  // The ranks' mean, as the trials measure the reference (take_trial_times).
  const double ms = 1e3 * schedule::mean_over_ranks(*transport, {schedule::median(window)})[0];
  window.clear();
  last_check_ms = ms;
  const double change = reference_ms > 0 ? ms / reference_ms - 1 : 0;
  drifting = std::fabs(change) > settings.drift ? drifting + 1 : 0;
  if (drifting == 0 || drifting < drift_checks_for(change)) {
    if (auto plan = watch_harm(ms)) return plan;
    prepare_health_if_due();
    return std::nullopt;
  }
  drift_search = true;
  return start_search(
      fmt::format("step time drifted {:+.0f}% ({:.1f} ms against {:.1f} ms) "
                  "for {} check{}",
                  100 * change, ms, reference_ms, drifting, drifting == 1 ? "" : "s"));
}

// A compressed plan is kept only for beating the lossless one by more than the trials' noise
// and kMinGain; the drift watch alone would let it lose that gain for good, unseen, whenever
// the gain was smaller than the drift threshold (a plan that runs 15% slower than its trial
// where it had won by 10%). Checks that find its step slower than the lossless plan's, by
// more than the margin it had to win by, as many in a row as a drift needs, start a search:
// the lossless plan is measured again beside it, under the same conditions, and the decision's
// hysteresis and the drift's backoff apply (a machine that slowed every plan alike changes
// nothing, and the next such search waits longer).
std::optional<Plan> AutoScheduler::Impl::watch_harm(double ms) {
  harming = lossless_ms > 0 && ms > lossless_ms + harm_margin_ms ? harming + 1 : 0;
  if (harming == 0 || harming < drift_checks_needed()) return std::nullopt;
  drift_search = true;
  return start_search(fmt::format(
      "the kept plan ran slower than uncompressed: {:.1f} ms a step against {:.1f} ms "
      "measured for the lossless plan, more than the {:.1f} ms it had to win by, for {} "
      "check{}",
      ms, lossless_ms, harm_margin_ms, harming, harming == 1 ? "" : "s"));
}

// The watch's references from decision `d`: the kept plan's measured step (the drift's), and
// when it is compressed, the fastest lossless plan measured and the margin the kept plan had
// to beat it by (margin_between, as decide() asked it).
void AutoScheduler::Impl::set_watch_bars(const AutoDecision& d) {
  const AutoCandidate& kept = d.candidates[d.kept];
  reference_ms = kept.measured_ms;
  lossless_ms = 0;
  harm_margin_ms = 0;
  harming = 0;
  last_check_ms = 0;
  if (!kept.plan.compressed()) return;
  const AutoCandidate* lossless = nullptr;
  for (const AutoCandidate& c : d.candidates) {
    if (c.plan.compressed() || c.measured_steps == 0 || c.measured_ms <= 0) continue;
    if (!lossless || c.measured_ms < lossless->measured_ms) lossless = &c;
  }
  if (!lossless) return;
  lossless_ms = lossless->measured_ms;
  harm_margin_ms = margin_between(*lossless, kept);
}

// Drifting checks in a row a search needs when the last one saw `change` (past the drift):
// drift_checks_needed() just past the threshold, fewer in proportion as the drift grows, at
// least one. A step four times as long (a host's link ten times slower, measured) is no swing
// of a shared machine's noise, and each check more it waited for cost check_every steps at
// that pace; the backoff still doubles what every drift needs.
uint64_t AutoScheduler::Impl::drift_checks_for(double change) const {
  const double checks =
      std::ceil(static_cast<double>(drift_checks_needed()) * settings.drift / std::fabs(change));
  return std::clamp<uint64_t>(static_cast<uint64_t>(checks), 1, drift_checks_needed());
}

// The link watch: a kept compressed plan's step may not show a link that got faster (little
// travels), though uncompressed or a gentler codec may now be faster. Every link_check_every
// steps of the plan, the calibration's probe is timed again (the slowest rank's, so every rank
// judges the same time); link_checks_needed() times in a row link_change times faster than at
// the calibration start a new search. Searches it starts back off as the drift's do.
std::optional<Plan> AutoScheduler::Impl::watch_link() {
  if (settings.link_check_every == 0 || !link_reference || !current.compressed() ||
      transport->size() < 2) {
    return std::nullopt;
  }
  const uint64_t every = link_check_every();
  if (steps < watch_from || (steps - watch_from + 1) % every != 0) return std::nullopt;
  if (link_per_node > 1 && node_size() != link_per_node) {  // resumed in another world
    link_reference.reset();
    return std::nullopt;
  }
  const NodeGroups* groups = link_per_node > 1 ? nodes.get() : nullptr;
  link_last_s =
      schedule::time_link_probe(*transport, groups, link_reference->bytes, kLinkProbeRepeats);
  const double faster = link_reference->seconds / std::max(link_last_s, 1e-9);
  link_faster = faster >= settings.link_change ? link_faster + 1 : 0;
  if (link_faster < link_checks_needed()) return std::nullopt;
  drift_search = true;
  return start_search(
      fmt::format("the link got faster: a probe of {} KiB took {:.2f} ms against "
                  "{:.2f} ms at the last calibration ({:.1f}x) at {} checks in a "
                  "row",
                  link_reference->bytes / 1024, 1e3 * link_last_s, 1e3 * link_reference->seconds,
                  faster, link_faster));
}

// Steps between the link watch's probes: as set, or more where the probe would take more than
// kLinkWatchShare of the time of the kept plan's steps between them (a slow link, short steps).
uint64_t AutoScheduler::Impl::link_check_every() const {
  const double probe_s = kLinkProbeRepeats * (link_reference ? link_reference->seconds : 0);
  const double step_s = std::max(reference_ms / 1e3, 1e-6);
  const double needed = std::ceil(probe_s / (kLinkWatchShare * step_s));
  return std::max<uint64_t>(settings.link_check_every,
                            static_cast<uint64_t>(std::min(needed, 1e12)));
}

void AutoScheduler::Impl::restore_link_reference(const json& saved) {
  link_reference.reset();
  link_faster = 0;
  const auto it = saved.find("link_reference");
  if (it == saved.end() || it->is_null()) return;
  const auto bytes = it->at("bytes").get<double>();
  const auto seconds = it->at("seconds").get<double>();
  const auto per_node = it->at("per_node").get<int>();
  if (!(bytes >= 4 && bytes <= (1u << 30) && seconds > 0 && seconds < 1e4 && per_node >= 1)) {
    throw Error(
        fmt::format("link_reference is {}: a probe of 4 bytes to 1 GiB, its seconds "
                    "above 0, per_node at least 1",
                    it->dump()));
  }
  link_reference = schedule::LinkProbe{bytes, seconds};
  link_per_node = per_node;
}

// Hysteresis between compressed plans: a search the watch started keeps the plan in force
// when the fastest compressed plan `best` measured does not beat it by more than tie_margin.
// Plans within the trials' noise of each other take turns at being the fastest; switching
// between them gains nothing measurable, restarts the residual watch's fill, and counted as a
// change it reset the drift's backoff, so that a shared machine's swings kept the search
// going (with a small check_every).
size_t AutoScheduler::Impl::keep_plan_in_force(size_t best) const {
  const auto& cs = search.candidates;
  if (!drift_search || !cs[best].plan.compressed()) return best;
  for (size_t i = 0; i < cs.size(); ++i) {
    if (i != best && cs[i].plan == searched_from && cs[i].measured_steps > 0 &&
        !cs[i].stopped_early && cs[i].measured_ms <= cs[best].measured_ms + tie_margin(i, best)) {
      return i;
    }
  }
  return best;
}

// A search the drift or the link watch started that ends with the plan it started from found
// nothing to change:
// on a shared machine the step time swings by more than the threshold and back, and each
// search costs its trials' steps (and the feedback a trial holds back). So the next search
// then needs twice as many drifting checks in a row; a decision that changes the plan, or a
// search started otherwise, makes the watch as quick as it was set again.
void AutoScheduler::Impl::note_drift_outcome(const Plan& kept) {
  const bool same = kept == searched_from;
  if (drift_search && same) {
    drift_backoff = std::min(drift_backoff + 1, kMaxDriftBackoff);
    search.why += fmt::format("; it is the plan this search started from, so the next search "
                              "waits for {} drifting checks in a row",
                              drift_checks_needed());
  } else if (!same) {
    drift_backoff = 0;
  }
  drift_search = false;
}

// The step before a check measures the means' norms (for watch_residuals).
void AutoScheduler::Impl::prepare_health_if_due() {
  if (health.prepare && window.size() + 1 == settings.check_every) health.prepare();
}

// The search's span (from its start to the decision) in the timeline, with what was decided.
void AutoScheduler::Impl::mark(const std::string& name, Clock::time_point start,
                               const AutoDecision& d) const {
  if (!events) return;
  json candidates = json::array();
  for (const auto& c : d.candidates) {
    candidates.push_back({{"name", c.name}, {"predicted_ms", c.predicted_ms},
                          {"measured_ms", c.measured_ms}});
  }
  events(name, start, Clock::now(),
         {{"reason", d.reason}, {"kept", d.candidates.empty() ? "" : d.candidates[d.kept].name},
          {"why", d.why}, {"candidates", candidates}});
}

// The correction the search's trials so far fit, from the uncorrected model (so corrections
// do not compound).
model::Correction AutoScheduler::Impl::fit_to_trials() const {
  std::vector<std::pair<Plan, double>> trials;
  for (const auto& c : search.candidates) trials.emplace_back(c.plan, c.measured_ms / 1e3);
  return model::fit_correction(*measured_profile, cluster, *codec_costs, trials);
}

// The measurements flow back into the model: the next search predicts with the correction
// all of this search's trials fit.
void AutoScheduler::Impl::learn_from_trials() {
  const auto fitting = Clock::now();
  correction = fit_to_trials();
  search.fit_ms = 1e3 * seconds_since(fitting);
  search.model_error_before = correction.error_before;
  search.model_error_after = correction.error_after;
  search.model_error_refined = round_error(search.candidates, 2);
}

// The convergence guard: error feedback that keeps more and more of the gradient unsent
// (the residual's norm against the mean's, rising check after check) is a codec too lossy for
// this model now; a faster step is worth nothing if the model ends worse. A bucket is judged
// once its memory has had time to fill (fill_steps): until then its ratio only moves its
// baseline, since a sparsifier's residual grows for 1 / ratio steps after every plan change
// (random-k 0.1% grew 4.5x between steps 74 and 799 and was backed off from, wrongly).
std::optional<Plan> AutoScheduler::Impl::watch_residuals() {
  if (!health.read || !current.compressed()) return std::nullopt;
  const auto buckets = health.read();
  const size_t n = buckets.size();
  std::vector<double> agreed;  // the ratios, then the residuals' norms: one agreement
  for (const auto& b : buckets) agreed.push_back(b.residual_norm / std::max(b.mean_norm, 1e-30));
  for (const auto& b : buckets) agreed.push_back(b.residual_norm);
  agreed = schedule::max_over_ranks(*transport, agreed);
  const std::vector<double> ratios(agreed.begin(), agreed.begin() + static_cast<std::ptrdiff_t>(n));
  const std::vector<double> residuals(agreed.begin() + static_cast<std::ptrdiff_t>(n),
                                      agreed.end());
  if (first_ratio.size() != n) {
    first_ratio = last_ratio = ratios;
    first_residual = residuals;
    rising.assign(n, 0);
    judged_from.clear();
    for (const auto& bucket : current.buckets)
      judged_from.push_back(watch_from + fill_steps(bucket));
    return std::nullopt;
  }
  for (size_t b = 0; b < n; ++b) {
    if (steps < judged_from[b]) {
      first_ratio[b] = ratios[b];
      first_residual[b] = residuals[b];
      continue;
    }
    rising[b] = ratios[b] > last_ratio[b] ? rising[b] + 1 : 0;
    const double growth = ratios[b] / std::max(first_ratio[b], 1e-30);
    // The residual itself must have grown too: a ratio that rises only because the mean
    // shrinks (the gradients of a converging model, AdamW's late steps) is no codec failing.
    const double own_growth = residuals[b] / std::max(first_residual[b], 1e-30);
    const bool compressed = current.buckets[b].option.codec != "none";
    if (compressed && rising[b] >= settings.residual_checks && growth > settings.residual_growth &&
        own_growth > settings.residual_growth) {
      return back_off(b, growth);
    }
  }
  last_ratio = ratios;
  return std::nullopt;
}

// Keeps the fastest measured plan of the last search that sends more bits per element than
// the one in force (uncompressed when none does), and leaves the failing codec out of later
// searches.
std::optional<Plan> AutoScheduler::Impl::back_off(size_t bucket, double growth) {
  const std::string codec = current.buckets[bucket].option.codec;
  excluded_codecs.insert(make_codec(codec)->name());
  const double bits = plan_bits(current);
  AutoDecision d = search;
  if (d.candidates.empty()) {  // resumed from a checkpoint: no trials to choose from
    d.candidates.push_back({"uncompressed", summarize(uncompressed), 0, 0, steps + 1, uncompressed});
  }
  d.reason = fmt::format(
      "error feedback's residual in bucket {} ({}) grew {:.1f}x against the "
      "mean over {} check{}",
      bucket, codec, growth, rising[bucket], rising[bucket] == 1 ? "" : "s");
  d.kept = 0;
  for (size_t i = 1; i < d.candidates.size(); ++i) {
    const AutoCandidate& c = d.candidates[i];
    if (plan_bits(c.plan) > bits && !uses_excluded(c.plan) &&
        c.measured_ms < d.candidates[d.kept].measured_ms) {
      d.kept = i;
    }
  }
  d.why = fmt::format("backed off to a gentler plan: '{}' ({:.1f} bits per element against "
                      "{:.1f}); {} is left out of later searches",
                      d.candidates[d.kept].name, plan_bits(d.candidates[d.kept].plan), bits, codec);
  d.step = steps + 1;
  d.search_steps = 0;
  d.search_seconds = 0;
  set_watch_bars(d);
  window.clear();
  drifting = 0;
  link_faster = 0;
  first_ratio.clear();
  watch_from = d.step;
  mark("auto: backed off", Clock::now(), d);
  say(fmt::format("{} at step {}: {}", d.reason, steps, d.why));
  decisions.push_back(d);
  prepare_health_if_due();
  return switch_to(d.candidates[d.kept].plan);
}

AutoScheduler::AutoScheduler(std::shared_ptr<Transport> transport, std::vector<TensorInfo> tensors,
                             AutoSettings settings)
    : impl_(std::make_unique<Impl>(std::move(transport), std::move(tensors), std::move(settings))) {}

AutoScheduler::~AutoScheduler() = default;

Plan AutoScheduler::initial_plan() const { return impl_->uncompressed; }

void AutoScheduler::set_health_source(HealthSource source) { impl_->health = std::move(source); }

void AutoScheduler::set_event_sink(EventSink sink) { impl_->events = std::move(sink); }

std::optional<Plan> AutoScheduler::on_step_end(const StepTimes& times) {
  return impl_->on_step_end(times);
}

const Plan& AutoScheduler::current_plan() const { return impl_->current; }

bool AutoScheduler::in_trial() const { return impl_->current_is_trial; }

std::string AutoScheduler::phase() const {
  switch (impl_->phase) {
    case Impl::Phase::kWarmup: return "warm-up";
    case Impl::Phase::kTrial: return "trial";
    case Impl::Phase::kDecided: return "decided";
  }
  return "?";
}

json AutoScheduler::report() const {
  const Impl& s = *impl_;
  json decisions = json::array();
  for (const auto& d : s.decisions) {
    json candidates = json::array();
    for (const auto& c : d.candidates) candidates.push_back(candidate_json(c));
    decisions.push_back({{"step", d.step}, {"reason", d.reason}, {"candidates", candidates},
                         {"kept", d.kept}, {"kept_name", d.candidates[d.kept].name},
                         {"why", d.why}, {"search_steps", d.search_steps},
                         {"search_seconds", d.search_seconds},
                         {"search_cost_seconds", d.search_cost_seconds},
                         {"payback_steps", d.payback_steps},
                         {"remeasured", d.remeasured},
                         {"planner_ms", d.decision_ms}, {"fit_ms", d.fit_ms},
                         {"model_error", {{"uncorrected", d.model_error_before},
                                          {"corrected", d.model_error_after},
                                          {"refined", d.model_error_refined}}},
                         {"link", {{"bytes_per_s", d.link.bytes_per_s},
                                   {"latency_s", d.link.latency_s}}},
                         {"per_node", d.per_node},
                         {"machine", {{"ranks", d.machine_ranks}, {"cores", d.machine_cores}}},
                         {"intra_link", {{"bytes_per_s", d.intra_link.bytes_per_s},
                                         {"latency_s", d.intra_link.latency_s}}}});
  }
  json probes = json::array();
  for (const auto& p : s.link.probes) probes.push_back({{"bytes", p.bytes}, {"seconds", p.seconds}});
  return {{"phase", phase()},
          {"steps", s.steps},
          {"candidates", s.settings.candidates},
          {"plan", summarize(s.current)},
          {"reference_ms", s.reference_ms},
          {"last_check_ms", s.last_check_ms},
          {"drift_checks", s.drift_checks_needed()},
          // Do no harm, watched (watch_harm): 0 where the plan in force is lossless.
          {"lossless_ms", s.lossless_ms},
          {"harm_margin_ms", s.harm_margin_ms},
          {"slower_checks", s.harming},
          {"link_watch", s.link_reference ? json{{"probe_bytes", s.link_reference->bytes},
                                                 {"calibrated_ms", 1e3 * s.link_reference->seconds},
                                                 {"last_ms", 1e3 * s.link_last_s},
                                                 {"faster_checks", s.link_faster},
                                                 {"every_steps", s.link_check_every()},
                                                 {"checks_needed", s.link_checks_needed()}}
                                          : json(nullptr)},
          {"decisions", decisions},
          {"model_correction", s.correction.to_json()},
          {"link_probes", probes},
          // What `gradcomp plan --profile --cluster --costs` takes, to replay the decision.
          {"profile", s.measured_profile ? s.measured_profile->to_json() : json(nullptr)},
          {"cluster", s.codec_costs ? s.cluster.to_json() : json(nullptr)},
          {"codec_costs", s.codec_costs ? s.codec_costs->to_json() : json(nullptr)},
          {"planner_codecs", s.settings.steady_candidates()},
          {"one_lossy_step", true},  // gradcomp plan --one-lossy-step
          {"min_compress_elements", s.settings.min_compress_elements}};
}

json AutoScheduler::save() const {
  const Impl& s = *impl_;
  return {{"version", kSaveVersion},
          {"phase", phase()},
          {"steps", s.steps},
          {"plan", s.current.to_json()},
          {"reference_ms", s.reference_ms},
          {"lossless_ms", s.lossless_ms},
          {"harm_margin_ms", s.harm_margin_ms},
          {"drift_backoff", s.drift_backoff},
          {"watch_from", s.watch_from},
          // The link watch's probe as calibrated: a run resumed on a faster link decides again.
          {"link_reference", s.link_reference ? json{{"bytes", s.link_reference->bytes},
                                                     {"seconds", s.link_reference->seconds},
                                                     {"per_node", s.link_per_node}}
                                              : json(nullptr)},
          {"profile", s.measured_profile ? s.measured_profile->to_json() : json(nullptr)},
          // What the trials taught the model: the next search after a resume predicts with it.
          {"correction", s.correction.to_json()}};
}

std::optional<Plan> AutoScheduler::restore(const json& saved) {
  Impl& s = *impl_;
  try {
    if (saved.at("version").get<int>() != kSaveVersion) {
      throw Error(fmt::format("version {} (this gradcomp reads {})",
                              saved.at("version").dump(), kSaveVersion));
    }
    const std::string phase = saved.at("phase").get<std::string>();
    const uint64_t steps = saved.at("steps").get<uint64_t>();
    Plan plan = Plan::from_json(saved.at("plan"));
    std::optional<model::Profile> profile;
    if (!saved.at("profile").is_null()) profile = model::Profile::from_json(saved.at("profile"));
    // Optional: states saved before the correction was kept load with the identity.
    const model::Correction correction = saved.contains("correction")
                                             ? model::Correction::from_json(saved.at("correction"))
                                             : model::Correction{};
    // A state saved during the warm-up starts it again; during a trial, that plan runs on, a
    // trial still, and a new search starts after the next step; after the decision, the kept
    // plan runs and is watched. The plan is returned even when it is the one in force, so that
    // the engine learns whether it is a trial.
    s.steps = steps;
    s.correction = correction;
    s.drift_backoff = std::min(saved.value("drift_backoff", uint64_t{0}), kMaxDriftBackoff);
    if (phase == "decided") {
      s.phase = Impl::Phase::kDecided;
      s.reference_ms = saved.at("reference_ms").get<double>();
      // Optional: states saved before the harm watch resume without it.
      s.lossless_ms = saved.value("lossless_ms", 0.0);
      s.harm_margin_ms = saved.value("harm_margin_ms", 0.0);
      s.harming = 0;
      s.last_check_ms = 0;
      s.measured_profile = std::move(profile);
      s.window.clear();
      s.drifting = 0;
      s.watch_from = std::min(saved.value("watch_from", steps), steps);
      s.restore_link_reference(saved);
      return s.resume_in(plan, false);
    }
    if (phase == "trial" && profile) {
      // The trial's plan runs on (the compression state saved with it belongs to it), and
      // the search starts again after the next step, from the saved profile. It stays a trial:
      // memory the engine held back waits for the decision, as it would have without the
      // checkpoint, instead of arriving all at once in the next step.
      s.phase = Impl::Phase::kDecided;
      s.measured_profile = std::move(profile);
      s.search_on_resume = true;
      return s.resume_in(plan, true);
    }
    s.phase = Impl::Phase::kWarmup;
    s.steps = std::min(steps, s.settings.warmup_steps > s.settings.profile_steps
                                  ? s.settings.warmup_steps - s.settings.profile_steps
                                  : 0);
    s.profile.clear();
    return s.resume_in(s.uncompressed, false);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("auto state: {}", e.what()));
  } catch (const Error& e) {
    throw Error(fmt::format("auto state: {}", e.what()));
  }
}

}  // namespace gradcomp
