// CostModel: how long each piece of a step takes, in the alpha-beta form.
//
// Collectives (n bytes per rank, p ranks, link alpha / beta = 1 / bandwidth), the textbook costs
// of the algorithms our transports run:
//   ring allreduce        2 (p-1) alpha + 2 (p-1)/p n beta
//   ring allgather        (p-1) alpha + (p-1) m beta        (m bytes contributed per rank)
//   alltoall              (p-1) alpha + (p-1)/p n beta
//   broadcast (pipelined) log2(p) alpha + n beta
// A flat collective over several nodes is limited by the NIC: the ring crosses each node's NIC
// once per step, so it runs at the inter-node link; alltoall sends per_node times the
// cross-node share through each NIC.
//
// Codecs: encode and decode cost a + b n seconds for n elements, per codec (calibrated from
// `gradcomp bench codecs`, or given); the frame size comes from the codec's traits.
//
// Routes: a bucket's exchange is a list of phases (collectives and the computation between
// them, such as the two-way route's server step), from the route, codec and cluster.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gradcomp/codec.h"
#include "gradcomp/model/cluster.h"
#include "gradcomp/plan.h"

namespace gradcomp::model {

// Seconds = a + b * elements.
struct Linear {
  double a = 0;
  double b = 0;
  double at(double elements) const { return a + b * elements; }
  bool operator==(const Linear&) const = default;
};

struct CodecCost {
  Linear encode;     // encode without feedback
  Linear encode_ef;  // encode with the residual fused (there is feedback); the feedback's own
                     // compensate pass is costed apart, as a pass over the bucket
  Linear decode;     // decode-accumulate of one frame of n elements
  bool operator==(const CodecCost&) const = default;
};

// Costs per codec name ("topk", not "topk:ratio=0.01": parameters change the frame size, which
// comes from the traits, not the per-element cost). JSON: {"topk": {"encode": {"a": .., "b":
// ..}, "encode_ef": {...}, "decode": {...}}, ...} (encode_ef defaults to encode), optionally
// wrapped as {"source": "...", "codecs": {...}}. The entry "none" (a plain decode-accumulate:
// read two arrays, write one) also prices the passes routes make over a whole bucket
// (feedback's compensate, finalize, write back); without it those passes cost nothing.
class CodecCosts {
 public:
  // The costs measured on this project's machine by `gradcomp bench codecs` (one core),
  // shipped as profiles/codec-costs.json.
  static CodecCosts shipped();
  static CodecCosts from_json(const nlohmann::json& json);
  // Fits a + b n per codec to `gradcomp bench codecs --json` output (least squares over sizes).
  static CodecCosts fit_bench(const nlohmann::json& bench);
  nlohmann::json to_json() const;
  // Entries are keyed by a codec's canonical spec ("powersgd:rank=4,cols=0,warm_start=true")
  // or by its name alone ("powersgd"), which prices every setting of the codec without an
  // entry of its own. Throws Error naming the codec when there is no entry (listing the ones
  // there are).
  const CodecCost& of(const std::string& spec_or_name) const;
  // The costs of this codec's spec, else of its name.
  const CodecCost& of(const Codec& codec) const;
  const CodecCost* find(const std::string& spec_or_name) const;  // nullptr when absent
  std::vector<std::string> names() const;
  void set(const std::string& spec_or_name, CodecCost cost);
  // A measured setting: its spec's entry, and its codec name's when the name has none yet, so
  // that measuring settings in the order they are listed prices the settings not measured
  // like the first (the one recommended, listed first).
  void set_measured(const std::string& name, const std::string& spec, CodecCost cost);
  // Multiplies every cost by `factor` (a faster or slower device than the one measured).
  CodecCosts scaled(double factor) const;

 private:
  std::map<std::string, CodecCost> costs_;
};

// One step of a bucket's exchange.
struct Phase {
  std::string name;     // "allreduce", "sizes", "frames", "server", "intra", "broadcast", ...
  double seconds = 0;
  double bytes = 0;     // sent per rank
};

struct BucketCost {
  double encode_s = 0;        // on the encoding thread (caller's or engine's)
  std::vector<Phase> phases;  // on the exchanging thread, in order
  double decode_s = 0;        // on the decoding thread: decode every frame, finalize, write back
  double exchange_s() const;
  double bytes_sent() const;  // per rank, all phases
};

// BucketCost without the phase list: what the simulator and the planner need, computed without
// allocating.
struct BucketTimes {
  double encode_s = 0;
  double exchange_s = 0;
  double decode_s = 0;
  double bytes = 0;
};

namespace detail {
class OptionCache;
}

class CostModel {
 public:
  CostModel(Cluster cluster, CodecCosts codecs);

  const Cluster& cluster() const { return cluster_; }
  const CodecCosts& codecs() const { return codecs_; }

  // The collectives on a link among p ranks (n bytes per rank; allgather: m per rank).
  static double ring_allreduce(const Link& link, int p, double n);
  static double ring_allgather(const Link& link, int p, double m);
  static double alltoall(const Link& link, int p, double n);
  static double broadcast(const Link& link, int p, double n);

  // Flat collectives over all workers of the cluster (NIC-limited across nodes).
  double allreduce(double n) const;
  double allgather(double m) const;
  double alltoall(double n) const;

  // The cost of one bucket of `elements` float32 values under `option` (codec, feedback,
  // route). Throws Error for an option the route cannot carry.
  BucketCost bucket(const Option& option, double elements) const;
  // The same sums, no allocation once `option` has been seen (options are parsed once and
  // cached; copies of a CostModel share the cache). Thread-safe.
  BucketTimes bucket_times(const Option& option, double elements) const;

 private:
  Cluster cluster_;
  CodecCosts codecs_;
  std::shared_ptr<detail::OptionCache> cache_;
};

}  // namespace gradcomp::model
