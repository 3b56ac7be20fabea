// The planner: dynamic programming over split points in backward order, jointly with a
// per-bucket option, on the simulator's lanes; see planner.h.
//
// A prefix of buckets leaves four numbers behind that decide the rest of the step: how much
// encoding on the compute thread has delayed backward (D), and when the encoding, exchange and
// decoding lanes become free. Every later time is a non-decreasing function of each of them, so
// a prefix state that is no better on all four than another can be dropped: the search keeps,
// per split point, the states no other state dominates (exact), capped for large models.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/model/planner.h"
#include "route/routes.h"

namespace gradcomp::model {
namespace {

using Clock = std::chrono::steady_clock;

// Bucket costs of every option as a function of the element count, read off one geometric
// grid of exact CostModel::bucket_times() values and interpolated linearly between grid points
// (the costs are affine in n for most codecs; PowerSGD's grows like sqrt(n), which the grid
// follows closely). Per grid interval it also keeps the options worth trying: an option that
// another one beats on encode, exchange and decode time at both ends of the interval (with
// the same encoding thread, and at least as often allowed) loses everywhere in between, since
// both are linear there.
class CostTable {
 public:
  using Costs = std::array<double, 3>;  // encode, exchange, decode

  CostTable(const CostModel& cost, const std::vector<Option>& options, double min_n,
            double max_n)
      : options_(options) {
    min_n = std::max(1.0, std::floor(min_n));
    max_n = std::max(min_n, max_n);
    for (double n = min_n;; n = std::ceil(n * kStep)) {
      n_.push_back(n);
      for (const Option& o : options) {
        const BucketTimes t = cost.bucket_times(o, n);
        costs_.push_back({t.encode_s, t.exchange_s, t.decode_s});
      }
      if (n >= max_n) break;
    }
    if (n_.size() == 1) {  // one size only: an interval of zero width
      n_.push_back(n_[0] + 1);
      costs_.insert(costs_.end(), costs_.begin(), costs_.end());
    }
    for (size_t k = 0; k + 1 < n_.size(); ++k) keep_.push_back(undominated(k));
  }

  // The grid interval holding n.
  size_t interval(double n) const {
    const auto it = std::upper_bound(n_.begin(), n_.end(), n);
    const size_t hi = static_cast<size_t>(it - n_.begin());
    return std::clamp<size_t>(hi, 1, n_.size() - 1) - 1;
  }
  const std::vector<size_t>& candidates(size_t k) const { return keep_[k]; }

  Costs at(size_t option, size_t k, double n) const {
    const Costs& lo = cost(k, option);
    const Costs& hi = cost(k + 1, option);
    const double t = std::clamp((n - n_[k]) / (n_[k + 1] - n_[k]), 0.0, 1.0);
    return {lo[0] + t * (hi[0] - lo[0]), lo[1] + t * (hi[1] - lo[1]),
            lo[2] + t * (hi[2] - lo[2])};
  }

 private:
  static constexpr double kStep = 1.0905077326652577;  // 2^(1/8): 8 points per octave

  const Costs& cost(size_t k, size_t option) const { return costs_[k * options_.size() + option]; }

  static bool compressed(const Option& o) { return o.codec != "none" || o.feedback != "none"; }

  // d may stand in for o: same encoding thread, and allowed wherever o is (uncompressed
  // options are always allowed; compressed ones all under the same conditions).
  bool may_replace(size_t d, size_t o) const {
    return options_[d].encode_on == options_[o].encode_on &&
           (!compressed(options_[d]) || compressed(options_[o]));
  }
  bool beats(size_t d, size_t o, size_t k) const {
    const Costs &a = cost(k, d), &b = cost(k, o);
    return a[0] <= b[0] && a[1] <= b[1] && a[2] <= b[2];
  }

  std::vector<size_t> undominated(size_t k) const {
    std::vector<size_t> keep;
    for (size_t o = 0; o < options_.size(); ++o) {
      bool dominated = false;
      for (size_t d = 0; d < options_.size() && !dominated; ++d) {
        if (d == o || !may_replace(d, o) || !beats(d, o, k) || !beats(d, o, k + 1)) continue;
        // Equal costs: keep the first of the two.
        const bool strictly = !beats(o, d, k) || !beats(o, d, k + 1);
        dominated = strictly || d < o;
      }
      if (!dominated) keep.push_back(o);
    }
    return keep;
  }

  const std::vector<Option>& options_;
  std::vector<double> n_;
  std::vector<Costs> costs_;               // grid point-major
  std::vector<std::vector<size_t>> keep_;  // per interval
};

// Where the lanes stand after a prefix of buckets.
struct State {
  double delay = 0;     // compute delayed by encoding on the compute thread
  double encode = 0;    // when the engine's encoder is free
  double exchange = 0;  // when the exchange lane is free
  double decode = 0;    // when the decoder is free
  // How we got here: the bucket [start, end) with option `option` after state `parent` of
  // front[start].
  size_t start = 0;
  size_t option = 0;
  size_t parent = 0;

  bool dominates(const State& o) const {
    return delay <= o.delay && encode <= o.encode && exchange <= o.exchange &&
           decode <= o.decode;
  }
};

// The search over one profile, cost model and option set.
class Search {
 public:
  Search(const Profile& profile, const CostModel& cost, const PlannerSettings& settings,
         std::vector<Option> options)
      : profile_(profile), settings_(settings), options_(std::move(options)) {
    const size_t n = profile.tensors.size();
    prefix_.assign(n + 1, 0.0);
    for (size_t i = 0; i < n; ++i) {
      prefix_[i + 1] = prefix_[i] + static_cast<double>(profile.tensors[i].elements);
    }
    double smallest = prefix_[n];
    for (const auto& t : profile.tensors) {
      smallest = std::min(smallest, static_cast<double>(std::max<size_t>(t.elements, 1)));
    }
    const double largest = std::min(prefix_[n], std::max(max_elements(), smallest));
    table_ = std::make_unique<CostTable>(cost, options_, smallest, largest);
    compressible_.assign(n, true);
    cuts_.resize(n + 1);
    std::iota(cuts_.begin(), cuts_.end(), 0);
  }

  // Buckets may only end where a group of tensors ends: the tensors are grouped, in backward
  // order, into about `groups` runs of similar size and ready time (large models).
  void group_tensors(size_t groups) {
    const size_t n = profile_.tensors.size();
    const double elements = prefix_[n] / static_cast<double>(groups);
    const double span = profile_.backward_s / static_cast<double>(groups);
    cuts_ = {0};
    for (size_t i = 1; i < n; ++i) {
      const size_t first = cuts_.back();
      if (prefix_[i] - prefix_[first] >= elements ||
          profile_.tensors[i].ready_s - profile_.tensors[first].ready_s >= span) {
        cuts_.push_back(i);
      }
    }
    cuts_.push_back(n);
  }

  // Tensors [0, end) may only travel uncompressed (Espresso's bubble rule).
  void keep_uncompressed_before(size_t end) {
    std::fill(compressible_.begin(), compressible_.begin() + static_cast<long>(end), false);
  }
  void set_front_cap(size_t cap) { cap_ = cap; }

  // Runs the dynamic program; returns the plan's buckets.
  std::vector<Bucket> run() {
    const size_t n = profile_.tensors.size();
    front_.assign(n + 1, {});
    front_[0].push_back(State{});
    for (size_t c = 1; c < cuts_.size(); ++c) extend_to(c);
    return buckets_of(best_final());
  }

  size_t considered() const { return considered_; }

 private:
  double max_elements() const {
    return static_cast<double>(settings_.max_bucket_bytes) / sizeof(float);
  }

  bool compressed(const Option& o) const { return o.codec != "none" || o.feedback != "none"; }

  // Whether option o may carry the bucket [start, end).
  bool allowed(size_t option, size_t start, size_t end) const {
    const Option& o = options_[option];
    if (!compressed(o)) return true;
    if (prefix_[end] - prefix_[start] < static_cast<double>(settings_.min_compress_elements)) {
      return false;
    }
    return compressible_[start];  // the rule marks a prefix, so its first tensor decides
  }

  // All buckets that end at cut `c`, after every state of every earlier cut.
  void extend_to(size_t c) {
    const size_t end = cuts_[c];
    const double ready = settings_.simulator.lambda * profile_.tensors[end - 1].ready_s;
    for (size_t b = c; b-- > 0;) {
      const size_t start = cuts_[b];
      const double elements = prefix_[end] - prefix_[start];
      if (elements > max_elements() && b + 1 < c) break;  // buckets only grow from here
      const size_t k = table_->interval(elements);
      for (size_t o : table_->candidates(k)) {
        if (!allowed(o, start, end)) continue;
        const auto cost = table_->at(o, k, elements);
        const bool on_caller = options_[o].encode_on == EncodeOn::kCaller;
        for (size_t p = 0; p < front_[start].size(); ++p) {
          ++considered_;
          State s = advance(front_[start][p], ready, cost, on_caller);
          s.start = start;
          s.option = o;
          s.parent = p;
          insert(front_[end], s);
        }
      }
    }
  }

  static State advance(const State& from, double ready, const std::array<double, 3>& cost,
                       bool on_caller) {
    State s = from;
    const double bucket_ready = ready + from.delay;
    double encoded;
    if (on_caller) {
      encoded = bucket_ready + cost[0];
      s.delay += cost[0];
    } else {
      encoded = std::max(bucket_ready, from.encode) + cost[0];
      s.encode = encoded;
    }
    s.exchange = std::max(encoded, from.exchange) + cost[1];
    s.decode = std::max(s.exchange, from.decode) + cost[2];
    return s;
  }

  void insert(std::vector<State>& front, const State& s) const {
    for (const State& kept : front) {
      if (kept.dominates(s)) return;
    }
    std::erase_if(front, [&](const State& kept) { return s.dominates(kept); });
    front.push_back(s);
    if (front.size() > cap_) {
      // Over the cap (large models): drop the state that finishes its exchange last.
      auto worst = std::max_element(front.begin(), front.end(), [](const State& a, const State& b) {
        return a.decode + a.delay < b.decode + b.delay;
      });
      front.erase(worst);
    }
  }

  size_t best_final() const {
    const auto& last = front_.back();
    const double backward = settings_.simulator.lambda * profile_.backward_s;
    size_t best = 0;
    double best_t = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < last.size(); ++i) {
      const double t = std::max(backward + last[i].delay, last[i].decode);
      if (t < best_t) best_t = t, best = i;
    }
    return best;
  }

  std::vector<Bucket> buckets_of(size_t state) const {
    std::vector<Bucket> buckets;
    size_t end = profile_.tensors.size();
    while (end > 0) {
      const State& s = front_[end][state];
      Bucket b;
      b.tensors.resize(end - s.start);
      std::iota(b.tensors.begin(), b.tensors.end(), s.start);
      b.option = options_[s.option];
      buckets.push_back(std::move(b));
      state = s.parent;
      end = s.start;
    }
    std::reverse(buckets.begin(), buckets.end());
    return buckets;
  }

  const Profile& profile_;
  const PlannerSettings& settings_;
  std::vector<Option> options_;
  std::unique_ptr<CostTable> table_;
  std::vector<size_t> cuts_;  // where buckets may end (tensor indices), 0 first
  std::vector<double> prefix_;
  std::vector<bool> compressible_;
  std::vector<std::vector<State>> front_;
  size_t cap_ = 64;
  size_t considered_ = 0;
};

// PlannerSettings::start_step into the buckets that compress: the warm-up only delays their
// compression (the cost model prices the steady state), and an uncompressed bucket has nothing
// to warm up.
void apply_start_step(Plan& plan, uint64_t start_step) {
  if (start_step == 0) return;
  for (Bucket& b : plan.buckets) {
    if (make_codec(b.option.codec)->id() != CodecId::kNone) b.option.start_step = start_step;
  }
}

Plan plan_of(const Profile& profile, std::vector<Bucket> buckets) {
  Plan plan;
  plan.tensors = profile.tensor_infos();
  plan.buckets = std::move(buckets);
  return plan;
}

// Models with more tensors than this use Espresso's pruning, split points between groups of
// tensors only, and a smaller front: the exact search is quadratic in the tensors.
constexpr size_t kExactTensors = 64;
constexpr size_t kLargeGroups = 64;
constexpr size_t kLargeFrontCap = 2;

// Espresso's bubble rule on the best uncompressed plan: the tensors of buckets whose exchange
// starts before the last time the exchange lane waits for compute gain nothing from
// compression (the lane idles afterwards anyway). Returns how many leading tensors that is.
size_t tensors_before_last_bubble(const Plan& plan, const SimResult& result) {
  double previous_end = 0;
  size_t bubble_bucket = 0;
  for (const Span& s : result.spans) {
    if (s.lane != "exchange" || s.bucket < 0) continue;
    if (s.start_s > previous_end + 1e-12) bubble_bucket = static_cast<size_t>(s.bucket);
    previous_end = std::max(previous_end, s.end_s);
  }
  size_t tensors = 0;
  for (size_t b = 0; b < bubble_bucket && b < plan.buckets.size(); ++b) {
    tensors += plan.buckets[b].tensors.size();
  }
  return tensors;
}

std::vector<Option> uncompressed_options(const std::vector<Option>& all) {
  std::vector<Option> none;
  for (const Option& o : all) {
    if (o.codec == "none" && o.feedback == "none") none.push_back(o);
  }
  return none;
}

}  // namespace

std::vector<Option> candidate_options(const PlannerSettings& settings, const Cluster& cluster) {
  std::vector<std::string> specs = {"none"};
  for (const auto& s : settings.codecs) {
    if (std::find(specs.begin(), specs.end(), s) == specs.end()) specs.push_back(s);
  }
  const bool multi_node = cluster.nodes() > 1 && cluster.per_node > 1;
  std::vector<Option> out;
  auto add = [&](Option o) {
    if (std::find(out.begin(), out.end(), o) == out.end()) out.push_back(std::move(o));
  };
  for (const auto& text : specs) {
    const Option parsed = parse_option(text);
    const bool route_given = option_names_route(text);
    const auto traits = make_codec(parsed.codec)->traits();
    const bool lossless = parsed.codec == "none";
    std::vector<std::string> routes;
    if (route_given) {
      routes.push_back(parsed.route);
    } else {
      // Every route the codec fits (the route table says), but no gathering or sharding of
      // uncompressed frames, and two lossy steps only when allowed.
      if (route::route_fits(RouteKind::kAllreduce, traits)) routes.push_back("allreduce");
      if (route::route_fits(RouteKind::kAllgather, traits) && !lossless) {
        routes.push_back("allgather");
      }
      if (route::route_fits(RouteKind::kTwoway, traits) && !lossless &&
          !settings.one_lossy_step && cluster.workers > 1) {
        routes.push_back("twoway");
      }
      // The dedicated servers' route when the job has servers: twoway's computation, the
      // servers' work off the workers.
      if (route::route_fits(RouteKind::kServers, traits) && !lossless && !settings.one_lossy_step &&
          cluster.servers > 0) {
        routes.push_back("servers");
      }
      // Each flat route also inside a route over nodes. Not sharded for a codec that
      // compresses each tensor on its own (PowerSGD's matrices): a shard cuts through
      // tensors, so it would compress other matrices than the ones it was measured on.
      if (multi_node) {
        for (const auto& r : std::vector<std::string>(routes)) {
          if (r == "servers" || (r == "twoway" && settings.one_lossy_step)) continue;
          routes.push_back("hierarchical:inner=" + r);
          if (!traits.uses_layout) routes.push_back("sharded:inner=" + r);
        }
      }
    }
    for (const auto& route : routes) {
      Option o = parsed;
      o.route = route;
      o.encode_on = EncodeOn::kEngine;
      add(o);
      if (settings.try_caller_encoding && !lossless) {
        o.encode_on = EncodeOn::kCaller;
        add(o);
      }
    }
  }
  return out;
}

namespace {

// The plan of the profile's tensors as they are (each a piece of its own). `fast`: the large
// models' speed-ups whatever the size (the searches over slicings, which would otherwise cost
// many times the search over whole tensors).
PlanResult plan_pieces(const Profile& profile, const CostModel& cost,
                       const PlannerSettings& settings, bool fast = false) {
  const auto options = candidate_options(settings, cost.cluster());
  const bool large = fast || profile.tensors.size() > kExactTensors;

  PlanResult result;
  // The best uncompressed plan: a candidate of its own, and the base of the bubble rule.
  Search plain(profile, cost, settings, uncompressed_options(options));
  if (large) {
    plain.set_front_cap(kLargeFrontCap);
    plain.group_tensors(kLargeGroups);
  }
  result.uncompressed_plan = plan_of(profile, plain.run());
  const SimResult plain_sim =
      simulate(profile, result.uncompressed_plan, cost, settings.simulator, large);
  result.uncompressed_s = plain_sim.iteration_s;

  Search joint(profile, cost, settings, options);
  if (large) {
    joint.set_front_cap(kLargeFrontCap);
    joint.group_tensors(kLargeGroups);
    joint.keep_uncompressed_before(
        tensors_before_last_bubble(result.uncompressed_plan, plain_sim));
  }
  result.plan = plan_of(profile, joint.run());
  result.predicted = simulate(profile, result.plan, cost, settings.simulator);
  result.options_considered = plain.considered() + joint.considered();
  if (result.predicted.iteration_s > result.uncompressed_s) {
    result.plan = result.uncompressed_plan;
    result.predicted = simulate(profile, result.plan, cost, settings.simulator);
  }
  apply_start_step(result.plan, settings.start_step);
  return result;
}

// The tensors with slices: every tensor of at least `from` elements cut into pieces of at most
// `limit` elements.
std::vector<TensorInfo> sliced_tensors(const Profile& profile, size_t from, size_t limit) {
  std::vector<TensorInfo> tensors = profile.tensor_infos();
  for (TensorInfo& t : tensors) {
    if (t.elements < from || t.elements <= limit) continue;
    t.slices = std::min({(t.elements + limit - 1) / limit, kMaxSlices, t.elements});
  }
  return tensors;
}

// The planner without the small-tensor rule: every tensor may travel compressed (in buckets of
// at least min_compress_elements).
PlanResult plan_every_tensor(const Profile& profile, const CostModel& cost,
                             const PlannerSettings& settings) {
  PlanResult result = plan_pieces(profile, cost, settings);
  size_t largest = 0;
  for (const auto& t : profile.tensors) largest = std::max(largest, t.elements);
  const size_t from = settings.slice_from_elements;
  if (from > 0 && largest >= from) {
    for (const size_t parts : {2, 4, 8, 16}) {
      Plan sliced;
      sliced.tensors = sliced_tensors(profile, from, (largest + parts - 1) / parts);
      PlanResult r = plan_pieces(profile.by_piece(sliced.pieces()), cost, settings, true);
      r.plan.tensors = sliced.tensors;  // the plans of pieces, as plans of sliced tensors
      r.uncompressed_plan.tensors = sliced.tensors;
      result.options_considered += r.options_considered;
      if (r.uncompressed_s < (1 - kSliceGain) * result.uncompressed_s) {
        result.uncompressed_s = r.uncompressed_s;
        result.uncompressed_plan = std::move(r.uncompressed_plan);
      }
      const bool better = r.predicted.iteration_s < (1 - kSliceGain) * result.predicted.iteration_s;
      if (better) {
        result.plan = std::move(r.plan);
        result.predicted = r.predicted;
      }
      // Finer slices cost more messages for less overlap each: once a finer slicing gains
      // nothing, neither will the next (and the search is the slowest part of the decision).
      if (!better && result.plan.sliced()) break;
    }
  }
  // The kept plan never predicts worse than the kept uncompressed one (which a slicing kept
  // for its uncompressed plan alone may have made up to kSliceGain faster).
  if (result.predicted.iteration_s > result.uncompressed_s) {
    result.plan = result.uncompressed_plan;
    result.predicted = simulate(profile, result.plan, cost, settings.simulator);
  }
  return result;
}

// `part`'s plan, made for the tensors `large` of `profile`, as a plan of all of profile's
// tensors: its buckets (and slices) mapped back, and the tensors `small` in one uncompressed
// bucket, launched in order of their last piece as the default plan's buckets are.
Plan with_small_bucket(const Profile& profile, const Plan& part, const std::vector<size_t>& large,
                       const std::vector<size_t>& small) {
  Plan plan;
  plan.tensors = profile.tensor_infos();
  for (size_t i = 0; i < large.size(); ++i) plan.tensors[large[i]].slices = part.tensors[i].slices;
  std::vector<size_t> first_piece(plan.tensors.size() + 1, 0);
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    first_piece[t + 1] = first_piece[t] + plan.tensors[t].slices;
  }
  const auto pieces = part.pieces();
  for (const Bucket& b : part.buckets) {
    Bucket mapped{{}, b.option};
    for (size_t p : b.tensors) {
      mapped.tensors.push_back(first_piece[large[pieces[p].tensor]] + pieces[p].slice);
    }
    plan.buckets.push_back(std::move(mapped));
  }
  Bucket rest;
  for (size_t t : small) rest.tensors.push_back(first_piece[t]);
  plan.buckets.push_back(std::move(rest));
  std::stable_sort(plan.buckets.begin(), plan.buckets.end(), [](const Bucket& a, const Bucket& b) {
    return a.tensors.back() < b.tensors.back();
  });
  plan.validate();
  return plan;
}

// PlannerSettings::small_tensor_elements: the large tensors planned as a profile of their own,
// the small ones added in an uncompressed bucket, the result priced on the whole profile and
// kept only if it beats the best uncompressed plan of all tensors.
PlanResult plan_small_apart(const Profile& profile, const CostModel& cost,
                            const PlannerSettings& settings) {
  PlannerSettings every = settings;
  every.small_tensor_elements = 0;
  PlannerSettings plain = every;
  plain.codecs = {"none"};
  std::vector<size_t> large, small;
  for (size_t t = 0; t < profile.tensors.size(); ++t) {
    (profile.tensors[t].elements >= settings.small_tensor_elements ? large : small).push_back(t);
  }
  if (small.empty()) return plan_every_tensor(profile, cost, every);
  if (large.empty()) return plan_every_tensor(profile, cost, plain);

  Profile part = profile;
  part.tensors.clear();
  for (size_t t : large) part.tensors.push_back(profile.tensors[t]);
  const PlanResult planned = plan_every_tensor(part, cost, every);
  PlanResult result = plan_every_tensor(profile, cost, plain);  // all tensors, uncompressed
  result.options_considered += planned.options_considered;
  Plan plan = with_small_bucket(profile, planned.plan, large, small);
  SimResult predicted = simulate(profile, plan, cost, settings.simulator);
  if (predicted.iteration_s < result.uncompressed_s) {
    result.plan = std::move(plan);
    result.predicted = std::move(predicted);
  }
  return result;
}

}  // namespace

PlanResult make_plan(const Profile& profile, const CostModel& cost,
                     const PlannerSettings& settings) {
  const auto began = Clock::now();
  profile.validate();
  if (profile.tensors.empty()) throw Error("planner: the profile has no tensors");
  PlanResult result = settings.small_tensor_elements > 0
                          ? plan_small_apart(profile, cost, settings)
                          : plan_every_tensor(profile, cost, settings);
  result.decision_s = std::chrono::duration<double>(Clock::now() - began).count();
  return result;
}

}  // namespace gradcomp::model
