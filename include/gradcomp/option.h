// Option: how one bucket of a plan is compressed and how it travels (codec, feedback, route,
// warm-up), and the short form users type for it. The plan (plan.h) holds one per bucket; the
// routes (routes.h) build themselves from one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gradcomp {

// Where a bucket's first encoding runs: on the thread that hands over the bucket's last
// gradient (no hand-off latency, but it delays the backward pass), or on the engine's encoder
// thread (overlaps with the backward pass).
enum class EncodeOn { kEngine, kCaller };

// How one bucket is compressed and routed.
struct Option {
  std::string codec = "none";     // codec spec, e.g. "topk:ratio=0.01"
  std::string feedback = "none";  // worker-side feedback spec, e.g. "ef"
  // Route spec: "allreduce", "allgather", "twoway" (server_feedback=<spec>),
  // "hierarchical" (inner=allreduce|allgather|twoway, intra=none|fp16), "sharded" (likewise),
  // "servers" (server_feedback=<spec>; dedicated parameter servers, docs/servers.md).
  std::string route = "allreduce";
  EncodeOn encode_on = EncodeOn::kEngine;
  // Warm-up: engine steps before this one exchange the bucket uncompressed (the exact float32
  // mean, a plain allreduce), leaving the codec and feedback untouched; from this step on the
  // option runs as written. Published recipes (PowerSGD's start_powerSGD_iter) avoid the
  // accuracy loss of compressing the first steps this way. 0: compress from the first step.
  uint64_t start_step = 0;

  bool operator==(const Option&) const = default;
};

// Parses the short form users type, "codec[|feedback[|route[|start=N]]]" (e.g. "fp16",
// "topk:ratio=0.01|ef", "qsgd||twoway", "topk:ratio=0.01|ef||start=500"). A missing feedback is
// "none"; a missing route is "allreduce" when the codec's frames can be summed and "allgather"
// otherwise; start=N sets Option::start_step (default 0). Throws SpecError naming the unknown
// codec, feedback or route and listing the available ones, or the malformed start field.
Option parse_option(const std::string& text);

// Whether the option text names its route (a non-empty third field): "qsgd||twoway" does,
// "qsgd" and "efsignsgd|ef||start=469" do not (parse_option fills in the default route).
bool option_names_route(const std::string& text);

// The patterns a bucket may travel by (the route layer's table, src/route/route.cpp).
enum class RouteKind {
  kAllreduce,     // summable frames, summed by the transport
  kAllgather,     // any single-round codec: every rank decodes every frame
  kTwoway,        // shards to co-located servers and back, compressed both ways
  kHierarchical,  // inside the node first, then an inner route among node leaders
  kSharded,       // reduce-scatter inside the node, an inner route per shard across nodes,
                  // allgather inside the node
  kServers,       // shards to dedicated parameter servers and back, compressed both ways
};

// The route names an option may name, in the table's order.
const std::vector<std::string>& route_names();
// The kind of route a route spec names ("twoway", "hierarchical:inner=allgather", ...; its
// parameters are not checked here); SpecError listing the route names when it names none.
RouteKind route_kind(const std::string& route);
// Whether a route spec's route runs over nodes (hierarchical, sharded): the engine then splits
// the world into nodes, and the spec takes an inner route (inner=, intra=).
bool route_needs_nodes(const std::string& route);
// The name of a route kind ("sharded").
const std::string& route_name(RouteKind kind);

// An Option checked and parsed, once: Plan::validate makes one per bucket, the engine builds
// each bucket's route from it and the cost model prices it, so nothing parses a bucket's
// strings again. Made by parse_bucket_option.
struct BucketOption {
  Option text;                              // as written: the plan's JSON and hash
  RouteKind route = RouteKind::kAllreduce;
  bool over_nodes = false;                  // hierarchical, sharded: the engine splits nodes
  bool on_servers = false;                  // servers: the engine claims the server link
  RouteKind inner = RouteKind::kAllreduce;  // over nodes: the route across nodes
  bool intra_fp16 = false;                  // over nodes: the node's sum as float16
  // A two-way route (also as the inner route) or route servers: the server side's feedback spec; by default the
  // worker's error feedback without momentum (dgc and nesterov apply theirs on the worker).
  std::string server_feedback;

  // The flat route the codec travels over: the route itself, or the one across nodes.
  RouteKind codec_route() const { return over_nodes ? inner : route; }
  bool operator==(const BucketOption&) const = default;
};

// Checks an option as the route that would carry it does and parses it: SpecError on an
// unknown or malformed codec, feedback or route, Error when the codec cannot travel that way.
BucketOption parse_bucket_option(const Option& option);
// parse_bucket_option for its checks alone.
void check_route(const Option& option);

}  // namespace gradcomp
