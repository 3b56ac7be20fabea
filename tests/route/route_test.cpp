// Routes in one process: spec parsing and checking (check_route / make_route errors), Phases'
// error wrapping, and the routes over a real transport of one rank (state checks, lengths).
#include "route/frames.h"
#include "route/route.h"
#include "route/routes.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "gradcomp/error.h"
#include "support/codec_testing.h"
#include "support/single_rank.h"
#include "gradcomp/op_queue.h"

namespace gradcomp::testing {
namespace {

// A real transport of one rank (Gloo, file store): the W = 1 paths of every route.
struct OneRank {
  std::shared_ptr<Transport> world = single_rank_transport();
  std::unique_ptr<Transport> intra = world->split(0, 0);
  std::unique_ptr<Transport> leaders = world->split(0, 0);
  RouteEnv env() const { return {.world = world.get()}; }
  RouteEnv nodes() const { return {.world = world.get(), .intra = intra.get(),
                                   .leaders = leaders.get()}; }
};

// A finished Work of the transports' own kind, successful or failed with `error`.
WorkPtr finished(std::exception_ptr error = nullptr) {
  auto work = std::make_shared<QueuedWork>();
  work->finish(std::move(error));
  return work;
}

// The message of the error check_route throws, with its type checked.
template <typename E>
std::string check_error(const Option& option) {
  try {
    check_route(option);
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong error type: ") + e.what();
  }
  return "no error";
}

void expect_contains(const std::string& text, const std::vector<std::string>& needles) {
  for (const auto& needle : needles) {
    EXPECT_NE(text.find(needle), std::string::npos) << "'" << needle << "' not in: " << text;
  }
}

TEST(Route, NamesInDocumentationOrder) {
  EXPECT_EQ(route_names(),
            (std::vector<std::string>{"allreduce", "allgather", "twoway", "hierarchical", "sharded",
                                      "servers"}));
}

TEST(Route, ValidOptionsPass) {
  for (const std::string route :
       {"allreduce", "allgather", "twoway", "twoway:server_feedback=ef",
        "hierarchical", "hierarchical:inner=allgather,intra=fp16",
        "hierarchical:inner=twoway,server_feedback=none", "servers",
        "servers:server_feedback=none"}) {
    EXPECT_NO_THROW(check_route({.codec = "randomk", .feedback = "ef", .route = route})) << route;
  }
}

TEST(Route, TheServerAppliesErrorFeedbackOnlyByDefault) {
  // The worker's momentum (dgc, nesterov) is applied once, on the worker; the server keeps a
  // residual. ef (with its parameters) and none carry over; an explicit choice is kept.
  const auto server = [](const std::string& feedback, const std::string& route = "twoway") {
    return parse_bucket_option({.codec = "topk", .feedback = feedback, .route = route})
        .server_feedback;
  };
  EXPECT_EQ(server("dgc"), "ef");
  EXPECT_EQ(server("nesterov:momentum=0.8"), "ef");
  EXPECT_EQ(server("ef:decay=0.5"), "ef:decay=0.5");
  EXPECT_EQ(server("none"), "none");
  EXPECT_EQ(server("dgc", "twoway:server_feedback=dgc"), "dgc");
  EXPECT_EQ(server("nesterov", "hierarchical:inner=twoway"), "ef");
  EXPECT_EQ(server("dgc", "servers"), "ef");  // dedicated servers: the same rule
  EXPECT_EQ(server("ef:decay=0.5", "servers"), "ef:decay=0.5");
}

// Dedicated servers are a route of their own, never the route across nodes (the node routes'
// inner routes run among the workers); the engine learns from the parsed option that it needs
// the server link.
TEST(Route, ServersIsNotAnInnerRoute) {
  const BucketOption o =
      parse_bucket_option({.codec = "topk", .feedback = "ef", .route = "servers"});
  EXPECT_EQ(o.route, RouteKind::kServers);
  EXPECT_TRUE(o.on_servers);
  EXPECT_FALSE(o.over_nodes);
  EXPECT_FALSE(parse_bucket_option({.codec = "topk", .route = "twoway"}).on_servers);
  expect_contains(check_error<SpecError>({.codec = "qsgd", .route = "sharded:inner=servers"}),
                  {"inner", "allreduce, allgather, twoway"});
  expect_contains(check_error<Error>({.codec = "powersgd", .route = "servers"}),
                  {"route 'servers' cannot carry codec 'powersgd"});
}

TEST(Route, UnknownRouteListsTheAvailableOnes) {
  expect_contains(check_error<SpecError>({.route = "ring"}),
                  {"unknown route 'ring'", "allreduce, allgather, twoway, hierarchical"});
}

TEST(Route, BadParametersSayWhatIsAllowed) {
  expect_contains(check_error<SpecError>({.route = "allreduce:chunks=2"}),
                  {"route 'allreduce'", "unknown parameter 'chunks'"});
  expect_contains(check_error<SpecError>({.route = "hierarchical:inner=ring"}),
                  {"inner", "allreduce, allgather, twoway"});
  expect_contains(check_error<SpecError>({.route = "hierarchical:intra=int8"}),
                  {"intra", "none, fp16"});
  expect_contains(check_error<SpecError>({.route = "twoway:server_feedback=adam"}),
                  {"server_feedback", "none, ef, dgc, nesterov"});
  expect_contains(check_error<SpecError>({.route = "allreduce:server_feedback=ef"}),
                  {"server_feedback", "two-way route"});
  expect_contains(check_error<SpecError>({.route = "hierarchical:server_feedback=ef"}),
                  {"server_feedback", "inner=twoway"});
}

// The route table answers every question about a route by its kind: its name, whether a
// codec fits (the same answer as the check of a plan), and a route spec's kind whatever its
// parameters.
TEST(Route, TheTableKnowsEveryRouteByKind) {
  EXPECT_EQ(route_kind("allreduce"), RouteKind::kAllreduce);
  EXPECT_EQ(route_kind("allgather"), RouteKind::kAllgather);
  EXPECT_EQ(route_kind("twoway:server_feedback=ef"), RouteKind::kTwoway);
  EXPECT_EQ(route_kind("hierarchical:inner=twoway,intra=fp16"), RouteKind::kHierarchical);
  EXPECT_NE(error_text([] { route_kind("ring"); }).find("unknown route 'ring'; available routes: "
                                                         "allreduce, allgather, twoway, hierarchical, sharded, "
                                                         "servers"),
            std::string::npos);
  for (const auto& codec : codec_names()) {
    if (codec == "threshold") continue;  // needs its tau
    const auto traits = make_codec(codec)->traits();
    for (const char* route : {"allreduce", "allgather", "twoway", "servers"}) {
      const bool checked = check_error<Error>({.codec = codec, .route = route}) == "no error";
      EXPECT_EQ(route::route_fits(route_kind(route), traits), checked) << codec << " " << route;
    }
  }
}

TEST(Route, BadCodecOrFeedbackIsASpecError) {
  expect_contains(check_error<SpecError>({.codec = "zip"}), {"unknown codec 'zip'"});
  expect_contains(check_error<SpecError>({.feedback = "memory"}), {"memory"});
}

TEST(Route, AllreduceNeedsASummableCodec) {
  expect_contains(check_error<Error>({.codec = "topk:ratio=0.1", .route = "allreduce"}),
                  {"route 'allreduce' cannot carry codec 'topk", "not summable",
                   "none, fp16, bf16, randomk, powersgd, intq"});
  // The same check through the inner route of a hierarchical one.
  expect_contains(check_error<Error>({.codec = "qsgd", .route = "hierarchical"}),
                  {"route 'allreduce'", "qsgd", "not summable"});
}

TEST(Route, TwowayNeedsAShardableSingleRoundCodec) {
  expect_contains(check_error<Error>({.codec = "powersgd", .route = "twoway"}),
                  {"route 'twoway' cannot carry codec 'powersgd", "not shardable", "topk"});
  expect_contains(check_error<Error>({.codec = "signum", .route = "twoway"}),
                  {"signum", "not shardable"});
  expect_contains(check_error<Error>({.codec = "intq", .route = "hierarchical:inner=twoway"}),
                  {"route 'twoway'", "intq"});
}

TEST(Route, AllgatherNeedsASingleRoundCodec) {
  expect_contains(check_error<Error>({.codec = "powersgd", .route = "allgather"}),
                  {"route 'allgather' cannot carry codec 'powersgd", "2 rounds", "'allreduce'"});
}

TEST(Route, MissingTransportsAreErrors) {
  EXPECT_NE(error_text([] { make_route(Option{}, 0, 10, {}); }).find("RouteEnv::world is null"),
            std::string::npos);
  const OneRank one;
  const std::string text = error_text([&] { make_route({.route = "hierarchical"}, 0, 10, one.env()); });
  expect_contains(text, {"route 'hierarchical' needs the node transports", "RouteEnv::intra"});
  // rank 0: a leader, but no leaders transport
  expect_contains(error_text([&] {
                    make_route({.route = "hierarchical"}, 0, 10,
                               {.world = one.world.get(), .intra = one.intra.get()});
                  }),
                  {"leads its node", "RouteEnv::leaders is null"});
}

TEST(Route, PhasesNameTheBucketAndPhaseAndKeepTheErrorType) {
  const Phases p(7, Milliseconds(10), nullptr);
  auto failing = [](auto error) { return finished(std::make_exception_ptr(error)); };
  try {
    p.wait(failing(TimeoutError("peer 2 did not answer")), "shards", Clock::now());
    ADD_FAILURE() << "no error";
  } catch (const TimeoutError& e) {
    EXPECT_STREQ(e.what(), "bucket 7, phase shards: peer 2 did not answer");
  }
  try {
    p.wait(failing(CommError("connection reset")), "allreduce", Clock::now());
    ADD_FAILURE() << "no error";
  } catch (const TimeoutError&) {
    ADD_FAILURE() << "a CommError became a TimeoutError";
  } catch (const CommError& e) {
    EXPECT_STREQ(e.what(), "bucket 7, phase allreduce: connection reset");
  }
  EXPECT_NO_THROW(p.wait(finished(), "sizes", Clock::now()));
}

// One step with one rank (W = 1), as the engine runs it: the bucket's buffer goes to encode and
// comes back to decode.
std::vector<float> one_step(Route& route, const std::vector<float>& grad, uint64_t step = 0) {
  const Phases p(0, Milliseconds(1000), nullptr);
  std::vector<float> buffer = grad;
  const StepState s{.step = step};
  route.encode(buffer, s, p);
  route.exchange(s, p);
  route.decode(buffer, s, p);
  route.settle(route::all_finite(buffer), s);  // the bucket is the whole step
  return buffer;
}

TEST(Route, EveryRouteAveragesOneRankToItsLosslessInput) {
  const OneRank one;
  const RouteEnv env = one.nodes();
  const auto grad = gradient(1001, 5);
  for (const std::string route : {"allreduce", "allgather", "twoway", "hierarchical",
                                  "hierarchical:inner=twoway"}) {
    for (const std::string feedback : {"none", "ef"}) {
      SCOPED_TRACE(route + " / " + feedback);
      const auto r = make_route({.codec = "none", .feedback = feedback, .route = route}, 0,
                                grad.size(), env);
      EXPECT_EQ(one_step(*r, grad), grad);
    }
  }
}

TEST(Route, LengthsAreChecked) {
  const OneRank one;
  const auto r = make_route({.codec = "fp16"}, 4, 10, one.env());
  const Phases p(4, Milliseconds(1000), nullptr);
  std::vector<float> wrong(11);
  expect_contains(error_text([&] { r->encode(wrong, {}, p); }),
                  {"route 'allreduce', bucket 4", "gradient of 11 elements", "the bucket has 10"});
}

TEST(Route, StateIsCheckedOnLoad) {
  const OneRank one;
  const Option option{.codec = "topk:ratio=0.1", .feedback = "ef", .route = "allgather"};
  const auto a = make_route(option, 0, 100, one.env());
  one_step(*a, gradient(100, 1));
  const auto state = a->save_state();
  EXPECT_NO_THROW(make_route(option, 0, 100, one.env())->load_state(state));
  expect_contains(error_text([&] { make_route(option, 0, 99, one.env())->load_state(state); }),
                  {"saved for a bucket of 100 elements", "99 elements"});
  expect_contains(error_text([&] {
                    make_route({.codec = "fp16", .feedback = "ef"}, 0, 100, one.env())
                        ->load_state(state);
                  }),
                  {"route 'allreduce' state", "different route"});
  auto truncated = state;
  truncated.resize(state.size() - 1);
  expect_contains(error_text([&] { make_route(option, 0, 100, one.env())->load_state(truncated); }),
                  {"route 'allgather' state"});
  expect_contains(error_text([&] { make_route(option, 0, 100, one.env())->load_state({}); }),
                  {"not a \"GCRS\" state", "only 0 bytes"});
}

TEST(Route, MemoryDoesNotGrowAcrossSteps) {
  const OneRank one;
  const auto r = make_route({.codec = "topk:ratio=0.1", .feedback = "ef", .route = "twoway"}, 0,
                            1000, one.env());
  one_step(*r, gradient(1000, 1), 0);
  const size_t after_first = r->memory_bytes();
  for (uint64_t s = 1; s < 5; ++s) one_step(*r, gradient(1000, s + 1), s);
  EXPECT_EQ(r->memory_bytes(), after_first);
}

}  // namespace
}  // namespace gradcomp::testing
