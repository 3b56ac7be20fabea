// The parsed route spec and the factories of the route classes (one per file in src/route/).
// make_route (route.cpp) parses and checks; the factories assume a checked configuration.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gradcomp/codec.h"
#include "route/route.h"

namespace gradcomp::route {

// Everything a route class needs to build itself.
struct RouteConfig {
  BucketOption option;   // the bucket's, checked and parsed
  RouteKind kind = RouteKind::kAllreduce;  // the route to build: option.route, or option.inner
  const std::string& codec() const { return option.text.codec; }        // codec spec
  const std::string& feedback() const { return option.text.feedback; }  // worker's feedback
  size_t bucket = 0;
  // The randomness key of the route's codec calls (Context::bucket): the bucket, or one
  // stream of it (shard_key) when the bucket is cut into shards that travel on their own.
  uint64_t key = 0;
  size_t elements = 0;
  std::vector<TensorShape> layout;  // the bucket's tensors (empty: not known)
  RouteEnv env;
};

// The codec of a route that encodes the whole bucket, told the bucket's layout.
std::unique_ptr<Codec> make_bucket_codec(const RouteConfig& config);

// Throws Error when `codec` cannot travel over route `name` (not for hierarchical: pass its
// inner route).
void check_codec_fits(const std::string& name, const Codec& codec);
// Whether codecs of `traits` can travel over a flat route of `kind` (for hierarchical, its
// inner route decides).
bool route_fits(RouteKind kind, const CodecTraits& traits);

std::unique_ptr<Route> make_allreduce_route(const RouteConfig& config);
std::unique_ptr<Route> make_allgather_route(const RouteConfig& config);
std::unique_ptr<Route> make_twoway_route(const RouteConfig& config);
std::unique_ptr<Route> make_hierarchical_route(const RouteConfig& config);
std::unique_ptr<Route> make_sharded_route(const RouteConfig& config);
std::unique_ptr<Route> make_servers_route(const RouteConfig& config);
// Option::start_step: `plain` (codec none, feedback none, allreduce) before start_step, then
// `main`, the option's route.
std::unique_ptr<Route> make_warmup_route(std::unique_ptr<Route> plain, std::unique_ptr<Route> main,
                                         uint64_t start_step);
// The configuration of the flat route (config.option.inner) a route over nodes runs across them,
// over the transport `across`; the node transports are not passed on.
RouteConfig inner_route_config(const RouteConfig& config, Transport* across);
// The route among leaders (or the whole route when not hierarchical) by name.
std::unique_ptr<Route> make_flat_route(const RouteConfig& config);

}  // namespace gradcomp::route
