// CostModel: alpha-beta collectives and the cost of one bucket on each route, mirroring what
// the route classes in src/route/ do, phase by phase.
//
// Computation is priced from CodecCosts: a codec's encode (encode_ef when there is feedback)
// and decode-accumulate per frame; "a pass" over a bucket (feedback's compensate, finalize plus
// the engine's write back, the hierarchical route's node mean) at the cost of the codec "none"'s
// decode-accumulate, which moves the same bytes (read two arrays, write one).
// Multi-round codecs encode once per round on different threads (round 0 on the encoding
// thread, the others between the collectives), so their measured encode is split evenly.
#include "gradcomp/model/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string_view>
#include <tuple>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/feedback.h"
#include "gradcomp/frame.h"
#include "gradcomp/spec.h"

namespace gradcomp::model {

// ---- collectives

namespace {

double steps_log2(int p) { return std::ceil(std::log2(static_cast<double>(p))); }

// p ranks, `per_node` of them per node: a ring or an exchange among them, limited by the
// slowest link each step crosses.
struct Group {
  int p = 1;
  int per_node = 1;
  Link inter;
  Link intra;

  bool one_node() const { return per_node >= p; }
  const Link& ring_link() const { return one_node() ? intra : inter; }
  double allreduce(double n) const { return CostModel::ring_allreduce(ring_link(), p, n); }
  double allgather(double m) const { return CostModel::ring_allgather(ring_link(), p, m); }
  double broadcast(double n) const { return CostModel::broadcast(ring_link(), p, n); }
  // n bytes per rank, n/p to each rank. Across nodes each NIC carries per_node ranks' share for
  // the other nodes; the intra-node share travels at the same time on the intra link.
  double alltoall(double n) const {
    if (one_node()) return CostModel::alltoall(intra, p, n);
    const double cross = per_node * (p - per_node) / static_cast<double>(p) * n / inter.bytes_per_s;
    const double local = (per_node - 1) / static_cast<double>(p) * n / intra.bytes_per_s;
    return (p - 1) * inter.latency_s + std::max(cross, local);
  }
};

Group world_group(const Cluster& c) { return {c.workers, c.per_node, c.inter, c.intra}; }
// The node leaders: one per node, each on its own NIC.
Group leader_group(const Cluster& c) { return {c.nodes(), 1, c.inter, c.inter}; }

}  // namespace

double CostModel::ring_allreduce(const Link& link, int p, double n) {
  if (p <= 1) return 0;
  return 2 * (p - 1) * link.latency_s + 2.0 * (p - 1) / p * n / link.bytes_per_s;
}

double CostModel::ring_allgather(const Link& link, int p, double m) {
  if (p <= 1) return 0;
  return (p - 1) * link.latency_s + (p - 1) * m / link.bytes_per_s;
}

double CostModel::alltoall(const Link& link, int p, double n) {
  if (p <= 1) return 0;
  return (p - 1) * link.latency_s + (p - 1.0) / p * n / link.bytes_per_s;
}

double CostModel::broadcast(const Link& link, int p, double n) {
  if (p <= 1) return 0;
  return steps_log2(p) * link.latency_s + n / link.bytes_per_s;
}

double CostModel::allreduce(double n) const { return world_group(cluster_).allreduce(n); }
double CostModel::allgather(double m) const { return world_group(cluster_).allgather(m); }
double CostModel::alltoall(double n) const { return world_group(cluster_).alltoall(n); }

double BucketCost::exchange_s() const {
  double s = 0;
  for (const Phase& p : phases) s += p.seconds;
  return s;
}

double BucketCost::bytes_sent() const {
  double b = 0;
  for (const Phase& p : phases) b += p.bytes;
  return b;
}

// ---- options, parsed once

namespace detail {

// What the cost of a route depends on, from an Option: the codec object (frame sizes), its
// traits and costs, the route's shape. Immutable once built.
struct RouteModel {
  enum class Kind { kDirect, kAllreduce, kAllgather, kTwoway, kHierarchical, kSharded, kServers };
  Kind kind = Kind::kDirect;
  std::unique_ptr<Codec> codec;
  CodecTraits traits;
  CodecCost cost;
  bool feedback = false;         // worker side
  bool server_feedback = false;  // twoway, servers
  bool intra_fp16 = false;       // hierarchical, sharded
  std::unique_ptr<RouteModel> inner;  // hierarchical, sharded: the route across nodes
};

class OptionCache {
 public:
  explicit OptionCache(const CodecCosts& costs) : costs_(costs) {
    if (const CodecCost* none = costs.find("none")) pass_ = none->decode;
    const CodecCost* fp16 = costs.find("fp16");
    to_half_ = fp16 ? fp16->encode : pass_;
    from_half_ = fp16 ? fp16->decode : pass_;
  }

  // The model of `option`, built on first use. The map only grows, so references stay valid.
  const RouteModel& get(const Option& option) {
    std::lock_guard lock(mutex_);
    auto it = models_.find(option);
    if (it == models_.end()) {
      it = models_.emplace(Key{option.codec, option.feedback, option.route}, build(option)).first;
    }
    return *it->second;
  }

  Linear pass() const { return pass_; }
  Linear to_half() const { return to_half_; }
  Linear from_half() const { return from_half_; }

 private:
  struct Key {
    std::string codec, feedback, route;
  };
  // Compares keys with Options directly, so a lookup builds no string.
  struct Less {
    using is_transparent = void;
    static auto tie(const Key& k) { return std::tie(k.codec, k.feedback, k.route); }
    static auto tie(const Option& o) { return std::tie(o.codec, o.feedback, o.route); }
    template <class A, class B>
    bool operator()(const A& a, const B& b) const { return tie(a) < tie(b); }
  };

  std::unique_ptr<RouteModel> build(const Option& option) const;
  std::unique_ptr<RouteModel> build_flat(const BucketOption& option, RouteKind kind) const;

  CodecCosts costs_;
  Linear pass_, to_half_, from_half_;
  std::mutex mutex_;
  std::map<Key, std::unique_ptr<RouteModel>, Less> models_;
};

namespace {

bool is_none(const std::string& spec, std::string_view what) {
  return Spec::parse(spec, what).name() == "none";
}

}  // namespace

std::unique_ptr<RouteModel> OptionCache::build_flat(const BucketOption& option,
                                                    RouteKind kind) const {
  auto m = std::make_unique<RouteModel>();
  m->codec = make_codec(option.text.codec);
  m->traits = m->codec->traits();
  m->feedback = !is_none(make_feedback(option.text.feedback)->spec(), "feedback");
  if (kind == RouteKind::kAllreduce && m->codec->id() == CodecId::kNone && !m->feedback) {
    m->kind = RouteModel::Kind::kDirect;  // the raw float32 buffer: no codec cost needed
    return m;
  }
  m->cost = costs_.of(*m->codec);
  switch (kind) {
    case RouteKind::kAllreduce: m->kind = RouteModel::Kind::kAllreduce; break;
    case RouteKind::kAllgather: m->kind = RouteModel::Kind::kAllgather; break;
    case RouteKind::kTwoway:
    case RouteKind::kServers:
      m->kind = kind == RouteKind::kTwoway ? RouteModel::Kind::kTwoway : RouteModel::Kind::kServers;
      m->server_feedback = !is_none(option.server_feedback, "feedback");
      break;
    case RouteKind::kHierarchical:
    case RouteKind::kSharded:
      throw Error(fmt::format("route '{}' is not a flat route", route_name(kind)));
  }
  return m;
}

// The option is parsed (and checked: the codec fits its route) once, here, per cached option.
std::unique_ptr<RouteModel> OptionCache::build(const Option& text) const {
  const BucketOption option = parse_bucket_option(text);
  if (!option.over_nodes) return build_flat(option, option.route);
  auto m = std::make_unique<RouteModel>();
  m->kind = option.route == RouteKind::kSharded ? RouteModel::Kind::kSharded
                                                : RouteModel::Kind::kHierarchical;
  m->intra_fp16 = option.intra_fp16;
  m->inner = build_flat(option, option.inner);
  return m;
}

}  // namespace detail

// ---- routes, phase by phase

namespace {

using detail::OptionCache;
using detail::RouteModel;

constexpr double kSizeWord = sizeof(uint64_t);  // the frame sizes routes exchange first
                                                // (codecs without a fixed frame size)

// Where the phases of a route go: summed (bucket_times) or listed (bucket).
struct SumSink {
  BucketTimes* out;
  void operator()(const char*, double seconds, double bytes) const {
    out->exchange_s += seconds;
    out->bytes += bytes;
  }
};
struct NullSink {
  void operator()(const char*, double, double) const {}
};
struct ListSink {
  std::vector<Phase>* out;
  void operator()(const char* name, double seconds, double bytes) const {
    out->push_back({name, seconds, bytes});
  }
};

// The thread-bound parts of a route: encoding before, decoding after its phases.
struct EndCosts {
  double encode_s = 0;
  double decode_s = 0;
};

double frame_bytes(const Codec& codec, double elements) {
  return static_cast<double>(codec.max_frame_bytes(static_cast<size_t>(std::ceil(elements))));
}

// Compensate (a pass, with feedback) and encode of n elements.
double encode_cost(const RouteModel& m, bool feedback, Linear pass, double n) {
  return feedback ? pass.at(n) + m.cost.encode_ef.at(n) : m.cost.encode.at(n);
}

template <class Sink>
EndCosts allreduce_route(const RouteModel& m, const Group& g, Linear pass, double n, Sink& sink) {
  if (m.kind == RouteModel::Kind::kDirect) {
    sink("allreduce", g.allreduce(4 * n), 4 * n);
    return {0, pass.at(n)};  // the scaling pass 1/W, then the write back
  }
  const int rounds = std::max(1, m.traits.rounds);
  const double encode_all = m.feedback ? m.cost.encode_ef.at(n) : m.cost.encode.at(n);
  const double per_round = encode_all / rounds;
  const auto elements = static_cast<size_t>(std::ceil(n));
  for (int r = 0; r + 1 < rounds; ++r) {
    const double payload = static_cast<double>(m.codec->max_round_bytes(r, elements)) - kFrameHeaderBytes;
    sink(r == 0 ? "round 0" : "round", g.allreduce(payload), payload);
    sink("encode", per_round, 0);
  }
  const double payload = frame_bytes(*m.codec, n) - kFrameHeaderBytes;
  sink("allreduce", g.allreduce(payload), payload);
  if (!m.traits.payload_carries_nonfinite) {
    sink("non-finite flag", g.allreduce(4), 4);  // one word, issued after the payload
  }
  const double compensate = m.feedback ? pass.at(n) : 0;
  return {compensate + per_round, m.cost.decode.at(n) + pass.at(n)};
}

template <class Sink>
EndCosts allgather_route(const RouteModel& m, const Group& g, Linear pass, double n, Sink& sink) {
  const double frame = frame_bytes(*m.codec, n);
  if (!m.traits.fixed_frame_size) sink("sizes", g.allgather(kSizeWord), kSizeWord);
  sink("allgather", g.allgather(frame), frame);
  return {encode_cost(m, m.feedback, pass, n), g.p * m.cost.decode.at(n) + pass.at(n)};
}

template <class Sink>
EndCosts twoway_route(const RouteModel& m, const Group& g, Linear pass, double n, Sink& sink) {
  const double w = g.p, shard = n / w;
  const double frame = frame_bytes(*m.codec, shard);
  const bool sizes = !m.traits.fixed_frame_size;
  // Bytes sent count the frames for the other ranks: a rank's own shard stays with it.
  if (sizes) sink("shard sizes", g.alltoall(kSizeWord * w), kSizeWord * (w - 1));
  sink("shards", g.alltoall(frame * w), frame * (w - 1));
  // The server: decode W frames of its shard, finalize, compensate and re-encode it.
  const double server = w * m.cost.decode.at(shard) + pass.at(shard) +
                        encode_cost(m, m.server_feedback, pass, shard);
  sink("server", server, 0);
  if (sizes) sink("result sizes", g.allgather(kSizeWord), kSizeWord);
  sink("results", g.allgather(frame), frame);
  const double compensate = m.feedback ? pass.at(n) : 0;
  const double encode = compensate + w * (m.feedback ? m.cost.encode_ef : m.cost.encode).at(shard);
  return {encode, w * m.cost.decode.at(shard) + pass.at(n)};
}

// W workers and S dedicated servers, every one on an `inter` link of its own. A push: each
// worker sends its S shard frames (about one compressed bucket) while each server receives W
// frames of its shard; the busier NIC sets the time. A pull is the same the other way; it runs in
// the decode stage (on the link's pull stream), so it overlaps the next bucket's push. The
// server's decoding and re-encoding run on the servers' cores, off the workers' thread.
template <class Sink>
EndCosts servers_route(const RouteModel& m, const Cluster& c, Linear pass, double n, Sink& sink) {
  const double w = c.workers, s = c.server_count(), shard = n / s;
  const Link& link = c.inter;
  const double frame = frame_bytes(*m.codec, shard);
  const double ranks = w + s;
  // Control header (route/server_link.h, 112 bytes): a broadcast from worker 0 to W + S ranks,
  // priced by its latency. Its bytes are not a worker's: worker 0 alone sends it, and the
  // route's byte counters leave it out, as here.
  sink("control", std::ceil(std::log2(ranks)) * link.latency_s, 0);
  // Size words: a word from each worker to each server (the link's alltoallv sends no empty
  // blocks), so the busier end has max(W, S) messages.
  const double sizes = std::max(w, s) * link.latency_s;
  const auto move = [&](double worker_bytes, double server_bytes) {
    return std::max(s * link.latency_s + worker_bytes / link.bytes_per_s,
                    w * link.latency_s + server_bytes / link.bytes_per_s);
  };
  if (!m.traits.fixed_frame_size) sink("shard sizes", sizes, kSizeWord * s);
  sink("shards", move(s * frame, w * frame), s * frame);
  sink("server", w * m.cost.decode.at(shard) + pass.at(shard) +
                     encode_cost(m, m.server_feedback, pass, shard), 0);
  const double pull = (m.traits.fixed_frame_size ? 0 : sizes) + move(s * frame, w * frame);
  const double compensate = m.feedback ? pass.at(n) : 0;
  const double encode = compensate + s * (m.feedback ? m.cost.encode_ef : m.cost.encode).at(shard);
  return {encode, pull + s * m.cost.decode.at(shard) + pass.at(n)};
}

template <class Sink>
EndCosts flat_route(const RouteModel& m, const Group& g, Linear pass, double n, Sink& sink) {
  switch (m.kind) {
    case RouteModel::Kind::kAllgather: return allgather_route(m, g, pass, n, sink);
    case RouteModel::Kind::kTwoway: return twoway_route(m, g, pass, n, sink);
    default: return allreduce_route(m, g, pass, n, sink);
  }
}

// Inside the node, then the inner route among the leaders on the exchanging thread (its
// encode and decode are phases there), then a broadcast inside the node.
template <class Sink>
EndCosts hierarchical_route(const RouteModel& m, const Cluster& c, const OptionCache& cache,
                            double n, Sink& sink) {
  const int local = c.per_node;
  const Link& intra = c.intra;
  const double wire = (m.intra_fp16 ? 2 : 4) * n;
  if (local > 1) sink("intra allreduce", CostModel::ring_allreduce(intra, local, wire), wire);
  const Linear pass = cache.pass();
  sink("node mean", (m.intra_fp16 ? cache.from_half() : pass).at(n), 0);
  // The inner route's encode comes before its collectives: price it first, unrecorded.
  NullSink none;
  const EndCosts inner = flat_route(*m.inner, leader_group(c), pass, n, none);
  sink("encode", inner.encode_s, 0);
  flat_route(*m.inner, leader_group(c), pass, n, sink);
  sink("decode", inner.decode_s, 0);
  if (local > 1) sink("intra broadcast", CostModel::broadcast(intra, local, 4 * n), 4 * n);
  return {m.intra_fp16 ? cache.to_half().at(n) : 0, pass.at(n)};
}

// Every rank of a node at work: a reduce-scatter inside the node, the inner route on one shard
// (n / L elements) among the ranks of one local index, the L of a node sharing its NIC, then an
// allgather inside the node.
template <class Sink>
EndCosts sharded_route(const RouteModel& m, const Cluster& c, const OptionCache& cache, double n,
                       Sink& sink) {
  const int local = c.per_node;
  const double shard = n / local;
  const double wire = (m.intra_fp16 ? 2 : 4) * n;
  if (local > 1) {
    sink("intra reduce-scatter", CostModel::alltoall(c.intra, local, wire),
         wire * (local - 1) / local);
  }
  const Linear pass = cache.pass();
  sink("node mean", (m.intra_fp16 ? cache.from_half() : pass).at(n), 0);
  Link shared = c.inter;  // the node's NIC, shared by its L concurrent inner routes
  shared.bytes_per_s /= local;
  const Group cross{c.nodes(), 1, shared, shared};
  NullSink none;
  const EndCosts inner = flat_route(*m.inner, cross, pass, shard, none);
  sink("encode", inner.encode_s, 0);
  flat_route(*m.inner, cross, pass, shard, sink);
  sink("decode", inner.decode_s, 0);
  if (local > 1) {
    sink("intra allgather", CostModel::ring_allgather(c.intra, local, 4 * shard),
         4 * shard * (local - 1));
  }
  return {m.intra_fp16 ? cache.to_half().at(n) : 0, pass.at(n)};
}

template <class Sink>
EndCosts route_cost(const RouteModel& m, const Cluster& c, const OptionCache& cache, double n,
                    Sink& sink) {
  if (m.kind == RouteModel::Kind::kHierarchical) return hierarchical_route(m, c, cache, n, sink);
  if (m.kind == RouteModel::Kind::kSharded) return sharded_route(m, c, cache, n, sink);
  if (m.kind == RouteModel::Kind::kServers) return servers_route(m, c, cache.pass(), n, sink);
  return flat_route(m, world_group(c), cache.pass(), n, sink);
}

}  // namespace

CostModel::CostModel(Cluster cluster, CodecCosts codecs)
    : cluster_(std::move(cluster)), codecs_(std::move(codecs)),
      cache_(std::make_shared<detail::OptionCache>(codecs_)) {
  cluster_.validate();
}

BucketCost CostModel::bucket(const Option& option, double elements) const {
  BucketCost out;
  out.phases.reserve(8);
  ListSink sink{&out.phases};
  const EndCosts ends = route_cost(cache_->get(option), cluster_, *cache_, elements, sink);
  out.encode_s = ends.encode_s;
  out.decode_s = ends.decode_s;
  return out;
}

BucketTimes CostModel::bucket_times(const Option& option, double elements) const {
  BucketTimes out;
  SumSink sink{&out};
  const EndCosts ends = route_cost(cache_->get(option), cluster_, *cache_, elements, sink);
  out.encode_s = ends.encode_s;
  out.decode_s = ends.decode_s;
  return out;
}

}  // namespace gradcomp::model
