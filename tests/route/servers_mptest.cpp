// Route 'servers' between real processes (mpirun and `gradcomp launch`, W = 2 and 4), with W
// dedicated parameter servers: each worker process runs one server (run_server) on a thread of
// its own, reached over the server link exactly as separate `gradcomp server` processes are.
// With S = W the servers cut a bucket as the co-located two-way route does (shard s on server
// s, the same randomness keys and decoding order), so the two must agree bit for bit; that is
// the reference here (route_mptest.cpp checks twoway against an in-process reference).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>

#include "gradcomp/error.h"
#include "gradcomp/server.h"
#include "route/frames.h"
#include "route/route_step.h"
#include "route/server_link.h"
#include "support/codec_testing.h"
#include "support/mp_test.h"
#include "support/server_threads.h"

namespace gradcomp::testing {
namespace {

constexpr uint64_t kSeed = 4321;
constexpr size_t kBucket = 5;
constexpr int kSteps = 3;

uint32_t world_size() { return static_cast<uint32_t>(world()->size()); }
uint32_t my_rank() { return static_cast<uint32_t>(world()->rank()); }

[[maybe_unused]] auto* const g_servers = ::testing::AddGlobalTestEnvironment(new ServerThreads);

StepState step_state(uint64_t s) {
  return {.step = s, .lr = 0.1 / static_cast<double>(s + 1),
          .prev_lr = s == 0 ? 0.0 : 0.1 / static_cast<double>(s)};
}

// Rank r's gradient at `step`: different per rank and step.
std::vector<float> input(size_t n, uint64_t step, uint64_t salt) {
  return gradient(n, 1 + my_rank() + 100 * step + 10000 * salt,
                  1.0f + 0.5f * static_cast<float>(my_rank()));
}

// The two routes of one option, built as the engine builds them, holding the link's claim.
struct Pair {
  std::shared_ptr<route::ServerLink> link;
  std::unique_ptr<Route> twoway;
  std::unique_ptr<Route> servers;
};

Pair make_pair(const std::string& option, size_t n) {
  Pair p;
  p.link = route::ServerLink::claim(*world());
  RouteEnv env{.world = world().get(), .seed = kSeed, .threads = 1};
  env.servers = p.link.get();
  p.twoway = make_route(parse_option(option + "|twoway"), kBucket, n, env);
  p.servers = make_route(parse_option(option + "|servers"), kBucket, n, env);
  return p;
}

std::vector<float> run_step(Route& route, const std::vector<float>& grad, const StepState& s) {
  return run_route_step(route, grad, s, kBucket, world()->timeout());
}

void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = std::memcmp(&got[i], &want[i], sizeof(float)) == 0 ||
                      (std::isnan(got[i]) && std::isnan(want[i]));
    ASSERT_TRUE(same) << what << ": element " << i << " of " << got.size() << ": servers "
                      << got[i] << ", twoway " << want[i];
  }
}

void expect_same_on_every_rank(const std::vector<float>& x, const std::string& what) {
  const auto all = gather_bytes(std::as_bytes(std::span(x)));
  const size_t bytes = x.size() * sizeof(float);
  if (bytes == 0) return;  // memcmp wants addresses even for nothing
  for (uint32_t r = 1; r < world_size(); ++r) {
    ASSERT_EQ(std::memcmp(all.data(), all.data() + r * bytes, bytes), 0)
        << what << ": rank " << r << " differs from rank 0";
  }
}

class ServersRoute : public ::testing::TestWithParam<std::string> {};

TEST_P(ServersRoute, MatchesTheCoLocatedTwoWayRouteBitForBit) {
  const std::string option = GetParam();
  uint64_t salt = 0;
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}, size_t{100003}}) {
    Pair p = make_pair(option, n);
    for (int s = 0; s < kSteps; ++s) {
      const auto grad = input(n, static_cast<uint64_t>(s), salt);
      const auto want = run_step(*p.twoway, grad, step_state(static_cast<uint64_t>(s)));
      const auto got = run_step(*p.servers, grad, step_state(static_cast<uint64_t>(s)));
      const std::string what = fmt::format("{} n={} step {}", option, n, s);
      expect_same_bits(got, want, what);
      expect_same_on_every_rank(got, what);
    }
    ++salt;
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, ServersRoute,
                         ::testing::Values("qsgd|ef", "topk:ratio=0.05|ef", "fp16|none",
                                           "signsgd|ef", "randomk:ratio=0.1|ef", "terngrad|none",
                                           "natural|none", "threshold:tau=0.01|ef"),
                         [](const auto& info) {
                           std::string name;
                           for (char c : info.param) name += std::isalnum(c) ? c : '_';
                           return name;
                         });

// The engine's order: the exchange stage pushes the next bucket before the decode stage has
// pulled the last one. The servers pull in push order on a thread of their own, and every
// bucket still matches the two-way route.
TEST(ServersRoutePipeline, PushesAheadOfPullsMatchTheTwoWayRoute) {
  const size_t n = 30011;
  constexpr size_t kBuckets = 3;
  auto link = route::ServerLink::claim(*world());
  RouteEnv env{.world = world().get(), .seed = kSeed, .threads = 1};
  env.servers = link.get();
  std::unique_ptr<Route> twoway[kBuckets], servers[kBuckets];
  for (size_t b = 0; b < kBuckets; ++b) {
    twoway[b] = make_route(parse_option("qsgd|ef|twoway"), kBucket + b, n, env);
    servers[b] = make_route(parse_option("qsgd|ef|servers"), kBucket + b, n, env);
  }
  for (uint64_t s = 0; s < kSteps; ++s) {
    const StepState step = step_state(s);
    const Phases p(kBucket, world()->timeout(), nullptr);
    std::vector<float> got[kBuckets];
    for (size_t b = 0; b < kBuckets; ++b) {
      got[b] = input(n, s, 30 + b);
      servers[b]->encode(got[b], step, p);
      servers[b]->exchange(step, p);  // pushed; bucket b - 1 not pulled yet
    }
    for (size_t b = 0; b < kBuckets; ++b) servers[b]->decode(got[b], step, p);
    for (size_t b = 0; b < kBuckets; ++b) {
      servers[b]->settle(route::all_finite(got[b]), step);
      const auto want = run_step(*twoway[b], input(n, s, 30 + b), step);
      expect_same_bits(got[b], want, fmt::format("bucket {} step {}", b, s));
    }
  }
}

// A step the engine does not keep (a non-finite mean) is rolled back on the servers too: the
// next steps match the two-way route, which rolls its co-located server back.
TEST(ServersRouteSettle, ARolledBackStepIsRolledBackOnTheServers) {
  const size_t n = 4099;
  Pair p = make_pair("topk:ratio=0.02|ef", n);
  for (int s = 0; s < 4; ++s) {
    auto grad = input(n, static_cast<uint64_t>(s), 7);
    if (s == 1 && my_rank() == 0) grad[17] = std::nanf("");
    const auto want = run_step(*p.twoway, grad, step_state(static_cast<uint64_t>(s)));
    const auto got = run_step(*p.servers, grad, step_state(static_cast<uint64_t>(s)));
    expect_same_bits(got, want, fmt::format("step {}", s));
  }
}

// Retiring the route brings back what the servers held: over the ranks, what the workers hand
// over adds up to what the two-way route's ranks hand over (there the shard's owner adds W
// times its server memory, here every worker adds it once).
TEST(ServersRouteRetire, HandsBackWhatTheServersHold) {
  const size_t n = 2003;
  Pair p = make_pair("topk:ratio=0.02|ef", n);
  for (int s = 0; s < 2; ++s) {
    const auto grad = input(n, static_cast<uint64_t>(s), 9);
    run_step(*p.twoway, grad, step_state(static_cast<uint64_t>(s)));
    run_step(*p.servers, grad, step_state(static_cast<uint64_t>(s)));
  }
  std::vector<float> twoway(n, 0.0f), servers(n, 0.0f), worker_only(n, 0.0f);
  p.twoway->carry(twoway);
  p.servers->carry(worker_only);
  p.servers->retire(servers);
  const auto sum_over_ranks = [&](const std::vector<float>& x) {
    const auto all = gather_bytes(std::as_bytes(std::span(x)));
    std::vector<double> sum(n, 0.0);
    for (uint32_t r = 0; r < world_size(); ++r) {
      const auto* v = reinterpret_cast<const float*>(all.data() + r * n * sizeof(float));
      for (size_t i = 0; i < n; ++i) sum[i] += v[i];
    }
    return sum;
  };
  const auto want = sum_over_ranks(twoway);
  const auto got = sum_over_ranks(servers);
  const auto workers = sum_over_ranks(worker_only);
  double server_part = 0;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << "element " << i;
    server_part += std::fabs(got[i] - workers[i]);
  }
  EXPECT_GT(server_part, 0) << "the servers held nothing: the test shows nothing";
}

std::unique_ptr<Route> make_servers(const std::string& option, size_t n,
                                    route::ServerLink& link) {
  RouteEnv env{.world = world().get(), .seed = kSeed, .threads = 1};
  env.servers = &link;
  return make_route(parse_option(option), kBucket, n, env);
}

// Steps [begin, end) of one input sequence; the outputs, concatenated.
std::vector<float> run_steps(Route& route, size_t n, uint64_t begin, uint64_t end) {
  std::vector<float> out;
  for (uint64_t s = begin; s < end; ++s) {
    const auto mean = run_step(route, input(n, s, 5), step_state(s));
    out.insert(out.end(), mean.begin(), mean.end());
  }
  return out;
}

// The servers' state is saved with the workers' once fetched (each server's by one worker),
// and resumes exactly: into a new bucket (fresh server shards) and into the same one mid-run.
TEST(ServersRouteState, ACheckpointWithTheServersStateResumesExactly) {
  const size_t n = 999;
  const std::string option = "topk:ratio=0.02|none|servers:server_feedback=ef";
  auto link = route::ServerLink::claim(*world());
  auto trained = make_servers(option, n, *link);
  run_steps(*trained, n, 0, 3);
  try {
    trained->save_state();
    FAIL() << "save_state saved without the servers' state";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_ranks=True"), std::string::npos) << e.what();
  }
  trained->fetch_remote_state();
  const auto saved = trained->save_state();
  EXPECT_EQ(trained->save_state(), saved);  // saving twice changes nothing
  const auto want = run_steps(*trained, n, 3, 6);

  auto resumed = make_servers(option, n, *link);
  resumed->load_state(saved);
  EXPECT_EQ(resumed->save_state(), saved);  // what goes back to the servers next
  expect_same_bits(run_steps(*resumed, n, 3, 6), want, "resumed into new shards");
  trained->load_state(saved);
  expect_same_bits(run_steps(*trained, n, 3, 6), want, "resumed mid-run");

  // Without the servers' state (all of this option's) the steps go elsewhere.
  auto fresh = make_servers(option, n, *link);
  const auto workers_only = make_servers("topk:ratio=0.02|none|servers:server_feedback=none", n,
                                         *link)
                                ->save_state();
  fresh->load_state(saved);
  EXPECT_NE(run_steps(*fresh, n, 3, 6), run_steps(*make_servers(option, n, *link), n, 3, 6));
  EXPECT_THROW(fresh->load_state(workers_only), Error);  // no servers' part: refused
}

// An undo state (Engine::StateFor::kUndo) leaves the servers' state where it is: a load undone
// by it changes nothing.
TEST(ServersRouteState, AnUndoneLoadChangesNothing) {
  const size_t n = 1001;
  const std::string option = "qsgd|ef|servers";
  auto link = route::ServerLink::claim(*world());
  auto other = make_servers(option, n, *link);
  run_steps(*other, n, 0, 4);
  other->fetch_remote_state();
  const auto elsewhere = other->save_state();
  auto kept = make_servers(option, n, *link);
  auto undone = make_servers(option, n, *link);
  run_steps(*kept, n, 0, 2);
  run_steps(*undone, n, 0, 2);
  const auto undo = undone->save_undo_state();
  EXPECT_THROW(undone->save_state(), Error);  // an undo state is not a checkpoint
  undone->load_state(elsewhere);
  undone->load_state(undo);
  expect_same_bits(run_steps(*undone, n, 2, 4), run_steps(*kept, n, 2, 4), "after the undo");
}

// A server state of another shape is refused before anything changes.
TEST(ServersRouteState, AServerStateOfAnotherBucketIsRefusedWhenLoaded) {
  const size_t n = 999;
  auto link = route::ServerLink::claim(*world());
  auto route = make_servers("qsgd|ef|servers", n, *link);
  auto smaller = make_servers("qsgd|ef|servers", n - 100, *link);
  for (Route* r : {route.get(), smaller.get()}) {
    run_steps(*r, r == route.get() ? n : n - 100, 0, 1);
    r->fetch_remote_state();
  }
  const auto saved = route->save_state();
  const route::StateShape shape{n, world_size()};
  auto parts = route::load_parts("servers", saved, shape, 3, true);
  const auto smaller_state = smaller->save_state();
  const auto theirs =
      route::load_parts("servers", smaller_state, {n - 100, world_size()}, 3, true);
  ASSERT_EQ(parts.size(), 4U);  // as many servers as workers: each keeps one
  parts[3] = theirs[3];
  std::vector<std::vector<std::byte>> copies;
  for (auto part : parts) copies.emplace_back(part.begin(), part.end());
  try {
    route->load_state(route::save_parts("servers", shape, copies));
    FAIL() << "a server state of another bucket was loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("elements"), std::string::npos) << e.what();
  }
  EXPECT_EQ(route->save_state(), saved);
  run_steps(*route, n, 1, 2);  // and the link still agrees with the servers
}

// Two live engines of one process (a GAN's two optimizers) claim a channel each and exchange
// at the same time from two threads; each matches the two-way route bit for bit. A channel an
// engine freed serves the next claim.
TEST(ServersRouteLink, TwoLiveEnginesExchangeTogetherOnChannelsOfTheirOwn) {
  const size_t n = 20011;
  const std::string options[2] = {"qsgd|ef", "topk:ratio=0.05|ef"};
  RouteEnv env{.world = world().get(), .seed = kSeed, .threads = 1};
  std::vector<float> want[2][kSteps];
  for (int e = 0; e < 2; ++e) {  // the references, one after the other on the workers' world
    auto twoway = make_route(parse_option(options[e] + "|twoway"), kBucket + e, n, env);
    for (int s = 0; s < kSteps; ++s) {
      want[e][s] = run_step(*twoway, input(n, s, 40 + e), step_state(s));
    }
  }
  std::shared_ptr<route::ServerLink> links[2] = {route::ServerLink::claim(*world()),
                                                 route::ServerLink::claim(*world())};
  ASSERT_NE(links[0].get(), links[1].get());
  std::vector<float> got[2][kSteps];
  std::exception_ptr failed[2];
  std::vector<std::thread> engines;
  for (int e = 0; e < 2; ++e) {
    engines.emplace_back([&, e] {
      try {
        RouteEnv own = env;
        own.servers = links[e].get();
        auto servers = make_route(parse_option(options[e] + "|servers"), kBucket + e, n, own);
        for (int s = 0; s < kSteps; ++s) {
          got[e][s] = run_step(*servers, input(n, s, 40 + e), step_state(s));
        }
      } catch (...) {
        failed[e] = std::current_exception();
      }
    });
  }
  for (auto& t : engines) t.join();
  for (int e = 0; e < 2; ++e) {
    if (failed[e]) std::rethrow_exception(failed[e]);
    for (int s = 0; s < kSteps; ++s) {
      expect_same_bits(got[e][s], want[e][s], fmt::format("engine {} step {}", e, s));
    }
  }
  route::ServerLink* freed = links[0].get();
  links[0].reset();
  auto again = route::ServerLink::claim(*world());
  EXPECT_EQ(again.get(), freed);
  RouteEnv own = env;
  own.servers = again.get();
  auto servers = make_route(parse_option("qsgd|ef|servers"), kBucket, n, own);
  auto twoway = make_route(parse_option("qsgd|ef|twoway"), kBucket, n, env);
  const auto grad = input(n, 0, 50);
  expect_same_bits(run_step(*servers, grad, step_state(0)), run_step(*twoway, grad, step_state(0)),
                   "a freed channel claimed again");
}

TEST(ServersRouteLink, WithoutALinkTheRouteIsAClearError) {
  RouteEnv no_link{.world = world().get(), .seed = kSeed, .threads = 1};
  EXPECT_THROW(make_route(parse_option("qsgd|ef|servers"), kBucket, 10, no_link), Error);
}

}  // namespace
}  // namespace gradcomp::testing
