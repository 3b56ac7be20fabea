// The utility study's iteration-time model (utility_model.h), on the cost model's flat
// collectives: a ring over all workers, at the inter-node link when the workers span several
// nodes and at the intra-node link when they share one.
#include "gradcomp/model/utility_model.h"

#include <fmt/format.h>

#include <cmath>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/feedback.h"
#include "gradcomp/plan.h"
#include "gradcomp/spec.h"

namespace gradcomp::model {
namespace {

void check_inputs(double gradient_bytes, double backward_s, const UtilityMethod& m,
                  const UtilitySettings& s) {
  const auto require = [](bool ok, std::string_view what) {
    if (!ok) throw Error(fmt::format("utility model: {}", what));
  };
  require(gradient_bytes >= 0 && std::isfinite(gradient_bytes), "gradient_bytes must be >= 0");
  require(backward_s >= 0 && std::isfinite(backward_s), "backward_s must be >= 0");
  require(m.ratio >= 1 && std::isfinite(m.ratio),
          fmt::format("method '{}': ratio = {} must be >= 1", m.name, m.ratio));
  require(m.rounds >= 1, fmt::format("method '{}': rounds = {} must be >= 1", m.name, m.rounds));
  require(m.encode_s >= 0 && m.decode_s >= 0,
          fmt::format("method '{}': encode_s and decode_s must be >= 0", m.name));
  require(m.lambda >= 1 && std::isfinite(m.lambda),
          fmt::format("method '{}': lambda = {} must be >= 1", m.name, m.lambda));
  require(s.bucket_bytes > 0, "bucket_bytes must be > 0");
}

// The collective a method needs for x compressed bytes, every round paying its latency (the
// rounds split the bytes between them, as PowerSGD's P and Q do).
struct CollectiveCost {
  const CostModel& net;
  const UtilityMethod& m;
  double operator()(double x) const {
    const auto one = [&](double bytes) {
      return m.collective == Collective::kAllreduce ? net.allreduce(bytes) : net.allgather(bytes);
    };
    return one(x) + (m.rounds - 1) * one(0);
  }
};

}  // namespace

double utility_iteration_time(double gradient_bytes, double backward_s, const Cluster& cluster,
                              const UtilityMethod& m, const UtilitySettings& settings) {
  check_inputs(gradient_bytes, backward_s, m, settings);
  const CostModel net(cluster, CodecCosts{});
  const CollectiveCost coll{net, m};
  // Every worker's message is decoded when frames are gathered; a summed one only once.
  const double decode = m.decode_s * (m.collective == Collective::kAllgather ? cluster.workers : 1);
  if (m.schedule == Schedule::kSerial) {
    return backward_s + m.encode_s + coll(gradient_bytes / m.ratio) + decode;
  }
  // DDP's buckets: k - 1 of the cap, the last holding the rest; each bucket's exchange carries
  // its share of the decoding.
  const double cap = settings.bucket_bytes;
  const double k = std::max(1.0, std::ceil(gradient_bytes / cap));
  const double last = gradient_bytes - (k - 1) * cap;
  const auto bucket = [&](double bytes) {
    const double share = gradient_bytes > 0 ? bytes / gradient_bytes : 1;
    return coll(bytes / m.ratio) + decode * share;
  };
  const double compute = m.lambda * backward_s + m.encode_s;
  if (settings.tail == TailForm::kOverlapped) {
    return std::max(compute, (k - 1) * bucket(cap) + bucket(last));
  }
  return std::max(compute, (k - 1) * bucket(cap)) + bucket(last);
}

UtilityMethod utility_method(const std::string& codec_spec, double gradient_elements,
                             const CodecCosts& codecs, Schedule schedule, double lambda) {
  // "codec" or the plan's short form "codec|feedback|route" (route: allreduce or allgather).
  Option option;
  try {
    option = parse_option(codec_spec);  // checks that the codec can travel on the route
  } catch (const Error& e) {
    throw Error(fmt::format("utility model: method '{}': {}", codec_spec, e.what()));
  }
  const auto codec = make_codec(option.codec);
  const CodecTraits traits = codec->traits();
  UtilityMethod m;
  m.name = codec_spec;
  m.schedule = schedule;
  m.lambda = lambda;
  const bool feedback = Spec::parse(make_feedback(option.feedback)->spec(), "feedback").name() != "none";
  const RouteKind kind = route_kind(option.route);
  if (codec->id() == CodecId::kNone && !feedback && kind == RouteKind::kAllreduce) {
    m.name = "syncSGD";  // DDP itself: the raw gradient, nothing to encode
    return m;
  }
  if (kind != RouteKind::kAllreduce && kind != RouteKind::kAllgather) {
    throw Error(fmt::format("utility model: '{}': route '{}' is not modelled; allowed: "
                            "allreduce, allgather",
                            codec_spec, option.route));
  }
  m.ratio = 32 / traits.bits_per_element;
  m.collective = kind == RouteKind::kAllreduce ? Collective::kAllreduce : Collective::kAllgather;
  m.rounds = m.collective == Collective::kAllreduce ? traits.rounds : 1;
  const CodecCost& cost = codecs.of(*codec);
  const CodecCost* none = codecs.find("none");
  const double compensate = feedback && none != nullptr ? none->decode.at(gradient_elements) : 0;
  m.encode_s = compensate + (feedback ? cost.encode_ef : cost.encode).at(gradient_elements);
  m.decode_s = cost.decode.at(gradient_elements);
  return m;
}

namespace {

// The bandwidth a sweep varies: the link the flat ring runs on.
void set_bandwidth(Cluster& cluster, double bytes_per_s) {
  cluster.inter.bytes_per_s = bytes_per_s;
  if (cluster.nodes() == 1) cluster.intra.bytes_per_s = bytes_per_s;
}

}  // namespace

double crossover_bandwidth(double gradient_bytes, double backward_s, Cluster cluster,
                           const UtilityMethod& method, const UtilityMethod& baseline,
                           double low, double high, const UtilitySettings& settings) {
  if (!(low > 0) || !(high >= low)) {
    throw Error(fmt::format("crossover_bandwidth: need 0 < low <= high (bytes per second), got "
                            "[{}, {}]", low, high));
  }
  const auto faster = [&](double bw) {
    set_bandwidth(cluster, bw);
    return utility_iteration_time(gradient_bytes, backward_s, cluster, method, settings) <
           utility_iteration_time(gradient_bytes, backward_s, cluster, baseline, settings);
  };
  if (faster(high)) return high;
  // A coarse scan down from `high` finds the highest bandwidth where the method wins (the gain
  // need not shrink monotonically, e.g. across a compute-bound plateau), then bisection on a
  // logarithmic scale pins the crossing down.
  constexpr int kScan = 64;
  const double step = std::log(high / low) / kScan;
  double above = high;
  for (int i = 1; i <= kScan; ++i) {
    const double bw = i == kScan ? low : high * std::exp(-step * i);
    if (faster(bw)) {
      double lo = bw, hi = above;
      for (int j = 0; j < 60 && hi / lo > 1 + 1e-12; ++j) {
        const double mid = std::sqrt(lo * hi);
        (faster(mid) ? lo : hi) = mid;
      }
      return lo;
    }
    above = bw;
  }
  return 0;
}

}  // namespace gradcomp::model
