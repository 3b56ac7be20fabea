// fit_correction (gradcomp/model/correction.h): the terms of a model::Correction fitted to the
// step times of the auto scheduler's trials.
#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>

#include "gradcomp/model/correction.h"

namespace gradcomp::model {

namespace {

// The grids. Latencies span a loopback socket's to a congested WAN's; bandwidth scales what a
// step's long transfers get against the probes' short ones (a token bucket's burst: 0.85 of
// the probes' rate at 1 Gbit/s x 4 on the emulated cluster), never above 1: a faster link would
// make room for a step overhead under the bound the uncompressed trials set (below), a cost of
// every step taken from the slow codecs; a codec's own slow-down what its work on cores the
// ranks share costs the backward pass (PowerSGD's and dither's trials at 1 Gbit/s ran as if
// 1.25-2x with 2 ranks on 2 cores, 2-2.5x with 4, 3.5x with 8, while random-k's plans, never
// tried, measured close to calibrated with 2 and 4).
constexpr double kLatencies[] = {0.0,  1e-5, 2e-5, 5e-5, 1e-4, 2e-4,
                                 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2};
constexpr double kBandwidthScales[] = {1.0,   0.975, 0.95,  0.925, 0.9,   0.875, 0.85,
                                      0.825, 0.8,   0.775, 0.75,  0.725, 0.7,   0.675,
                                      0.65,  0.625, 0.6,   0.575, 0.55,  0.525, 0.5};
constexpr double kFitLambdas[] = {1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0};
constexpr double kCoarseLatencies[] = {0.0, 1e-4, 5e-4, 2e-3, 1e-2};
constexpr int kMaxRounds = 3;  // the latency, then each codec's slow-down; again until stable
// Slow codecs and costly messages both slow a compressed plan, and a few trials cannot always
// tell them apart (two trials: either fits about as well). A codec gets a slow-down of its own
// only on evidence: when that halves the error the other terms leave on the trials that run
// it, by more than the trials' noise (a step measures within about 1%). The link's latency
// likewise, on the uncompressed trials.
constexpr double kTrialNoise = 0.01;

bool evident(const Correction& with, const Correction& without) {
  return with.error_after < std::min(without.error_after - kTrialNoise, 0.5 * without.error_after);
}

bool same_terms(const Correction& a, const Correction& b) {
  return a.extra_latency_s == b.extra_latency_s && a.codec_lambdas == b.codec_lambdas;
}

// The trials, and the corrections' errors on them.
class Trials {
 public:
  Trials(const Profile& profile, const Cluster& cluster, const CodecCosts& codecs,
         const std::vector<std::pair<Plan, double>>& trials)
      : profile_(profile), cluster_(cluster), codecs_(codecs), trials_(trials) {
    std::map<std::string, double> elements;  // over all trials, per codec
    std::set<std::string> mostly;            // codecs that compress most of some trial
    for (const auto& [plan, seconds] : trials) {
      auto mine = elements_by_codec(plan);
      double total = 0;
      for (const auto& [name, n] : mine) total += n;
      totals_.push_back(total);
      const double compressed = total - (mine.contains("none") ? mine["none"] : 0);
      auto& names = codecs_of_.emplace_back();
      for (const auto& [name, n] : mine) {
        if (name == "none") continue;
        names.insert(name);
        elements[name] += n;
        if (2 * n >= compressed) mostly.insert(name);
      }
      elements_.push_back(std::move(mine));
    }
    tried_.assign(mostly.begin(), mostly.end());
    std::stable_sort(tried_.begin(), tried_.end(),
                     [&](const auto& a, const auto& b) { return elements[a] > elements[b]; });
  }

  bool usable() const {
    return !trials_.empty() && std::all_of(trials_.begin(), trials_.end(),
                                           [](const auto& t) { return t.second > 0; });
  }
  // The codecs that get a slow-down of their own: each compresses most of some trial's elements
  // (a codec in a corner of a trial cannot be told from the codec that fills it), the one that
  // compressed the most elements over the trials first.
  const std::vector<std::string>& tried() const { return tried_; }

  // `c` with its step overhead (closed form, or none) and its error on the trials.
  Correction scored(Correction c, bool with_overhead = true) const {
    const CostModel& cost = cost_model(c);
    std::vector<double> predicted;
    for (size_t i = 0; i < trials_.size(); ++i) predicted.push_back(simulated(c, cost, i));
    c.step_overhead_s = with_overhead ? overhead(predicted) : 0;
    c.error_after = error(predicted, c.step_overhead_s);
    return c;
  }

  // The best link (rate, and latency per message when it is evident) for `from`, without a
  // step overhead; ties keep the earlier point of the grids (the smaller correction). Fitted on
  // the uncompressed trials: every plan pays these terms, so only the trials every plan
  // resembles may set them (a slowness of the compressed trials, fitted as a slower link, would
  // slow every codec's plans). Without an overhead: what an uncompressed step loses is first
  // its bytes' time (one trial cannot tell a slower link from time outside the model; a slower
  // link is what the probes miss, 15% at 1 Gbit/s x 4 on the emulated cluster), and the
  // overhead may take only what the link leaves.
  Correction best_link(const Correction& from) const {
    const auto best_over = [&](std::span<const double> latencies) {
      Correction best = scored(from, false);
      for (double bandwidth : kBandwidthScales) {
        for (double extra : latencies) {
          Correction c = from;
          c.bandwidth_scale = bandwidth;
          c.extra_latency_s = extra;
          c = scored(c, false);
          if (c.error_after < best.error_after - 1e-12) best = c;
        }
      }
      return best;
    };
    const Correction rate = best_over(std::span(kLatencies).first(1));
    if (trials_.size() < 2) return rate;  // one trial cannot tell a latency from a rate
    const Correction rate_and_latency = best_over(kLatencies);
    return evident(rate_and_latency, rate) ? rate_and_latency : rate;
  }

  // The best extra latency per message for `from`.
  Correction best_latency(const Correction& from) const {
    Correction best = scored(from);
    for (double extra : kLatencies) {
      Correction c = from;
      c.extra_latency_s = extra;
      c = scored(c);
      if (c.error_after < best.error_after - 1e-12) best = c;
    }
    return best;
  }

  // `from` with the best slow-down of its own for `codec`, if there is evidence of one on the
  // trials that run it (else none: the global lambda).
  Correction best_codec_lambda(const Correction& from, const std::string& codec) const {
    Correction without = from;
    without.codec_lambdas.erase(codec);
    without = scored(without);
    Correction best = without;
    for (double lambda : kFitLambdas) {
      Correction c = from;
      c.codec_lambdas[codec] = lambda;
      c = scored(c);
      if (c.error_after < best.error_after - 1e-12) best = c;
    }
    return evident_on(codec, best, without) ? best : without;
  }

  // Alternately the latency for the codecs' slow-downs so far and each codec's slow-down for
  // that latency, until a round changes nothing.
  Correction descend(const Correction& from) const {
    Correction best = from;
    for (int round = 0; round < kMaxRounds; ++round) {
      Correction next = best_latency(best);
      for (const std::string& codec : tried_) next = best_codec_lambda(next, codec);
      const bool stable = same_terms(next, best);
      best = next;
      if (stable) break;
    }
    return best;
  }

  // `fit` without the codecs' own slow-downs that the latency, refitted, does about as well
  // without (evidence at one point of the grid is not evidence).
  Correction evident_codec_lambdas_only(Correction fit) const {
    for (const std::string& codec : tried_) {
      if (!fit.codec_lambdas.contains(codec)) continue;
      Correction without = fit;
      without.codec_lambdas.erase(codec);
      without = best_latency(without);
      if (!evident_on(codec, fit, without)) fit = without;
    }
    return fit;
  }

  // The latency and the codecs' slow-downs together: each codec's slow-down the best for each
  // latency of a coarse grid.
  Correction coarse_joint(const Correction& from) const {
    Correction best = scored(from);
    for (double extra : kCoarseLatencies) {
      Correction c = from;
      c.extra_latency_s = extra;
      for (const std::string& codec : tried_) c = best_codec_lambda(c, codec);
      if (c.error_after < best.error_after - 1e-12) best = c;
    }
    return best;
  }

 private:
  // Trial i's step as `c` (with `cost`, its cost model) predicts it, without the overhead.
  double simulated(const Correction& c, const CostModel& cost, size_t i) const {
    const SimulatorSettings settings{.lambda = c.lambda_of(elements_[i], totals_[i])};
    return simulate(profile_, trials_[i].first, cost, settings).iteration_s;
  }

  // The cost model of `c`'s link and codec costs: the last one made when they are the same (the
  // codec slow-down passes try a dozen slow-downs on one model; making a model copies every
  // codec's costs, which took most of the fit's time).
  const CostModel& cost_model(const Correction& c) const {
    const std::array<double, 3> key{c.extra_latency_s, c.bandwidth_scale, c.cost_scale};
    if (!cost_ || cost_key_ != key) {
      cost_.emplace(c.cost_model(cluster_, codecs_));
      cost_key_ = key;
    }
    return *cost_;
  }

  // Whether `with` fits the trials that run `codec` evidently better than `without`.
  bool evident_on(const std::string& codec, const Correction& with,
                  const Correction& without) const {
    return evident(on_trials_of(codec, with), on_trials_of(codec, without));
  }

  // `c` (its overhead kept) with its error on the trials that run `codec`.
  Correction on_trials_of(const std::string& codec, Correction c) const {
    const CostModel& cost = cost_model(c);
    double sum = 0;
    int count = 0;
    for (size_t i = 0; i < trials_.size(); ++i) {
      if (!codecs_of_[i].contains(codec)) continue;
      const double measured = trials_[i].second;
      sum += std::fabs(simulated(c, cost, i) + c.step_overhead_s - measured) / measured;
      ++count;
    }
    c.error_after = count > 0 ? sum / count : 0;
    return c;
  }

  // Mean relative error of predictions + overhead against the measurements.
  double error(const std::vector<double>& predicted, double overhead) const {
    double sum = 0;
    for (size_t i = 0; i < predicted.size(); ++i) {
      const double measured = trials_[i].second;
      sum += std::fabs(predicted[i] + overhead - measured) / measured;
    }
    return sum / static_cast<double>(predicted.size());
  }

  // The overhead that fits best in the mean, never negative (the model's compute is a
  // measurement of this job: only time outside it is missing) and never above what an
  // uncompressed trial leaves unexplained: time outside the model (the optimizer, the
  // framework) is in every step, the uncompressed plan's too. Without that bound, codecs slower
  // than the model thinks (PowerSGD and dither on cores the workers share) were taken for a
  // cost of every step: fitted on their trials, +136 ms a step at 1 Gbit/s x 4, and random-k's
  // default plan, none of the trials, predicted 64% slow.
  double overhead(const std::vector<double>& predicted) const {
    double sum = 0;
    double bound = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < predicted.size(); ++i) {
      const double missed = trials_[i].second - predicted[i];
      sum += missed;
      if (codecs_of_[i].empty()) bound = std::min(bound, missed);  // an uncompressed trial
    }
    return std::clamp(sum / static_cast<double>(predicted.size()), 0.0, std::max(0.0, bound));
  }

  const Profile& profile_;
  const Cluster& cluster_;
  const CodecCosts& codecs_;
  const std::vector<std::pair<Plan, double>>& trials_;
  std::vector<std::map<std::string, double>> elements_;  // each trial's elements per codec
  std::vector<double> totals_;                            // ... and in all
  std::vector<std::set<std::string>> codecs_of_;          // each trial's codec names but none
  mutable std::optional<CostModel> cost_;          // cost_model's last, for cost_key_
  mutable std::array<double, 3> cost_key_{};
  std::vector<std::string> tried_;
};

}  // namespace

Correction fit_correction(const Profile& profile, const Cluster& cluster, const CodecCosts& codecs,
                          const std::vector<std::pair<Plan, double>>& trials) {
  const Trials t(profile, cluster, codecs, trials);
  if (!t.usable()) return {};
  Correction identity;
  identity.error_before = identity.error_after = t.scored(identity, false).error_after;
  // The link (its rate; its latency per message when two trials tell it), on the uncompressed
  // trials alone (when there are some: auto always has one).
  std::vector<std::pair<Plan, double>> lossless;
  std::copy_if(trials.begin(), trials.end(), std::back_inserter(lossless),
               [](const auto& trial) { return !trial.first.compressed(); });
  Correction base = identity;
  if (!lossless.empty()) {
    base = Trials(profile, cluster, codecs, lossless).best_link(identity);
  }
  // Then, on all trials, the latency per message and each codec's own slow-down, by coordinate
  // descent from two starts (the terms are coupled: a slow codec's trials can be fitted, worse,
  // by a costlier message, and the other way round, and one term at a time can stop short of
  // the best): from none, and from the best of a coarse joint search.
  Correction best = t.descend(base);
  if (!t.tried().empty()) {
    const Correction joint = t.descend(t.coarse_joint(base));
    if (joint.error_after < best.error_after - 1e-12) best = joint;
  }
  best = t.evident_codec_lambdas_only(best);
  if (!(best.error_after < identity.error_after - 1e-12)) return identity;
  best.error_before = identity.error_before;
  return best;
}

}  // namespace gradcomp::model
