// The route table, make_route, check_route and route_names: parsing and checking
// Option::route; Phases.
#include "route/route.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "gradcomp/error.h"
#include "gradcomp/spec.h"
#include "route/routes.h"

namespace gradcomp {

void Phases::wait(const WorkPtr& work, const char* phase, Clock::time_point issued) const {
  // The transport's message says what failed; the prefix says which bucket and phase, the
  // question a user of a many-bucket job asks first. The error type is kept.
  try {
    work->wait(timeout_);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("bucket {}, phase {}: {}", bucket_, phase, e.what()));
  } catch (const CommError& e) {
    throw CommError(fmt::format("bucket {}, phase {}: {}", bucket_, phase, e.what()));
  }
  record(phase, issued, Clock::now());
}

void Phases::record(const char* phase, Clock::time_point start, Clock::time_point end) const {
  if (timeline_ != nullptr) timeline_->span(static_cast<int>(bucket_), phase, start, end);
}

namespace route {
namespace {

// Why a codec of traits `t` cannot travel over a route of the kind; empty when it can.
std::string summed_misfit(const CodecTraits& t) { return t.summable ? "" : "is not summable"; }
std::string gathered_misfit(const CodecTraits& t) {
  if (t.rounds <= 1) return {};
  return fmt::format("has {} rounds (communication between phases needs route 'allreduce')",
                     t.rounds);
}
std::string sharded_misfit(const CodecTraits& t) {
  if (!t.shardable) return "is not shardable";
  return t.rounds > 1 ? fmt::format("has {} rounds", t.rounds) : "";
}
std::string inner_decides(const CodecTraits&) { return {}; }

// The route table: a row per route, as the codec table has a row per codec. A new route is a
// file with its factory (routes.h) and a row here.
struct RouteRow {
  const char* name;
  RouteKind kind;
  std::string (*misfit)(const CodecTraits&);
  std::unique_ptr<Route> (*make)(const RouteConfig&);
  bool needs_nodes;    // the engine splits the world into nodes (RouteEnv::intra, leaders)
  bool needs_servers;  // dedicated parameter servers (RouteEnv::servers)
};

const RouteRow kRoutes[] = {
    {"allreduce", RouteKind::kAllreduce, summed_misfit, make_allreduce_route, false, false},
    {"allgather", RouteKind::kAllgather, gathered_misfit, make_allgather_route, false, false},
    {"twoway", RouteKind::kTwoway, sharded_misfit, make_twoway_route, false, false},
    {"hierarchical", RouteKind::kHierarchical, inner_decides, make_hierarchical_route, true,
     false},
    {"sharded", RouteKind::kSharded, inner_decides, make_sharded_route, true, false},
    {"servers", RouteKind::kServers, sharded_misfit, make_servers_route, false, true},
};

const RouteRow& row_of(RouteKind kind) {
  for (const auto& r : kRoutes) {
    if (r.kind == kind) return r;
  }
  throw Error("route table: a route kind without a row");
}

// The flat routes a route over nodes may run across them (not those of dedicated servers).
std::vector<std::string> flat_route_names() {
  std::vector<std::string> names;
  for (const auto& r : kRoutes) {
    if (!r.needs_nodes && !r.needs_servers) names.emplace_back(r.name);
  }
  return names;
}

// Why `codec` cannot travel over `route`, or empty when it can.
std::string misfit(const std::string& route, const CodecTraits& t) {
  return row_of(route_kind(route)).misfit(t);
}

// The codecs (at their default parameters) that fit `route`, for error messages.
std::vector<std::string> codecs_fitting(const std::string& route) {
  std::vector<std::string> names;
  for (const auto& name : codec_names()) {
    try {
      if (misfit(route, make_codec(name)->traits()).empty()) names.push_back(name);
    } catch (const SpecError&) {  // a codec with a required parameter (threshold's tau)
    }
  }
  return names;
}

// The server side of a two-way route applies error feedback only: the worker's spec when it is
// `ef` (its parameters kept) or `none`; `ef` when the worker's adds momentum (dgc, nesterov),
// which the worker has applied already (BytePS-Compress's server keeps a residual, no momentum).
std::string default_server_feedback(const std::string& worker) {
  const std::string name = Spec::parse(worker, "feedback").name();
  return name == "ef" || name == "none" ? worker : "ef";
}

// Fails unless `text` is a feedback spec make_feedback accepts.
void check_feedback(const std::string& text) { make_feedback(text); }

}  // namespace

// The route spec's parameters: inner route and intra cast over nodes, the server feedback of a
// two-way route (SpecError on unknown names or keys, or a server feedback without a server).
void parse_route(const Option& option, BucketOption& out) {
  Spec spec = Spec::parse(option.route, "route");
  out.route = route_kind(spec.name());
  out.over_nodes = row_of(out.route).needs_nodes;
  out.on_servers = row_of(out.route).needs_servers;
  if (out.over_nodes) {
    out.inner = route_kind(spec.get_choice("inner", "allreduce", flat_route_names()));
    out.intra_fp16 = spec.get_choice("intra", "none", {"none", "fp16"}) == "fp16";
  }
  const bool has_server =
      out.codec_route() == RouteKind::kTwoway || out.route == RouteKind::kServers;
  if (has_server || spec.has("server_feedback")) {
    if (!has_server) {
      spec.fail(
          "parameter 'server_feedback' needs a two-way route (route 'twoway' or 'servers', or "
          "'hierarchical' or 'sharded' with inner=twoway)");
    }
    // Feedback names only: a spec's values cannot hold commas, so parameters of the server
    // feedback would be cut.
    out.server_feedback = spec.get_choice(
        "server_feedback", default_server_feedback(option.feedback), feedback_names());
  }
  spec.finish();
}

void check_codec_fits(const std::string& route, const Codec& codec) {
  const std::string why = misfit(route, codec.traits());
  if (why.empty()) return;
  throw Error(fmt::format("route '{}' cannot carry codec '{}': it {}; codecs route '{}' can "
                          "carry: {}",
                          route, codec.spec(), why, route, fmt::join(codecs_fitting(route), ", ")));
}

std::unique_ptr<Codec> make_bucket_codec(const RouteConfig& config) {
  auto codec = make_codec(config.codec());
  if (!config.layout.empty()) codec->set_layout(config.layout);
  return codec;
}

bool route_fits(RouteKind kind, const CodecTraits& traits) {
  return row_of(kind).misfit(traits).empty();
}

RouteConfig inner_route_config(const RouteConfig& config, Transport* across) {
  RouteConfig inner = config;
  inner.kind = config.option.inner;
  inner.env = RouteEnv{.world = across, .seed = config.env.seed, .threads = config.env.threads};
  return inner;
}

std::unique_ptr<Route> make_flat_route(const RouteConfig& config) {
  const std::string& name = route_name(config.kind);
  if (config.env.world == nullptr) {
    throw Error(fmt::format("route '{}' needs a transport (RouteEnv::world is null)", name));
  }
  const RouteRow& row = row_of(config.kind);
  if (row.needs_nodes) {
    throw Error(fmt::format("route '{}' is not a flat route; allowed: {}", name,
                            fmt::join(flat_route_names(), ", ")));
  }
  return row.make(config);
}

}  // namespace route

const std::vector<std::string>& route_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& r : route::kRoutes) v.emplace_back(r.name);
    return v;
  }();
  return names;
}

RouteKind route_kind(const std::string& route) {
  const std::string name = Spec::parse(route, "route").name();
  for (const auto& r : route::kRoutes) {
    if (name == r.name) return r.kind;
  }
  throw SpecError(fmt::format("unknown route '{}'; available routes: {}", name,
                              fmt::join(route_names(), ", ")));
}

bool route_needs_nodes(const std::string& route) {
  return route::row_of(route_kind(route)).needs_nodes;
}

const std::string& route_name(RouteKind kind) {
  for (size_t i = 0; i < std::size(route::kRoutes); ++i) {
    if (route::kRoutes[i].kind == kind) return route_names()[i];
  }
  throw Error("route table: a route kind without a row");
}

BucketOption parse_bucket_option(const Option& option) {
  BucketOption out;
  out.text = option;
  route::parse_route(option, out);
  const auto codec = make_codec(option.codec);
  route::check_feedback(option.feedback);
  if (!out.server_feedback.empty()) route::check_feedback(out.server_feedback);
  route::check_codec_fits(route_name(out.codec_route()), *codec);
  return out;
}

void check_route(const Option& option) { parse_bucket_option(option); }

namespace {

std::unique_ptr<Route> make_option_route(const BucketOption& option, size_t bucket,
                                         size_t elements, const RouteEnv& env,
                                         std::span<const TensorShape> layout) {
  route::RouteConfig config{.option = option,
                            .kind = option.route,
                            .bucket = bucket,
                            .key = bucket,
                            .elements = elements,
                            .layout = {layout.begin(), layout.end()},
                            .env = env};
  const auto& row = route::row_of(config.kind);
  return row.needs_nodes ? row.make(config) : route::make_flat_route(config);
}

}  // namespace

std::unique_ptr<Route> make_route(const BucketOption& option, size_t bucket, size_t elements,
                                  const RouteEnv& env, std::span<const TensorShape> layout) {
  size_t layout_elements = 0;
  for (const TensorShape& t : layout) layout_elements += t.elements;
  if (!layout.empty() && layout_elements != elements) {
    throw Error(fmt::format("bucket {}: its {} tensors hold {} elements, not the bucket's {}",
                            bucket, layout.size(), layout_elements, elements));
  }
  auto main = make_option_route(option, bucket, elements, env, layout);
  if (option.text.start_step == 0) return main;
  // Warm-up: an uncompressed allreduce over the whole world (Option's defaults) until
  // start_step.
  return route::make_warmup_route(
      make_option_route(parse_bucket_option(Option{}), bucket, elements, env, layout),
      std::move(main), option.text.start_step);
}

std::unique_ptr<Route> make_route(const Option& option, size_t bucket, size_t elements,
                                  const RouteEnv& env, std::span<const TensorShape> layout) {
  return make_route(parse_bucket_option(option), bucket, elements, env, layout);
}

}  // namespace gradcomp
