// Route 'servers' between real processes (mpirun and `gradcomp launch`, W = 2 and 4), with W
// dedicated parameter servers: each worker process runs one server (run_server) on a thread of
// its own, reached over the server link exactly as separate `gradcomp server` processes are.
// With S = W the servers cut a bucket as the co-located two-way route does (shard s on server
// s, the same randomness keys and decoding order), so the two must agree bit for bit; that is
// the reference here (route_mptest.cpp checks twoway against an in-process reference).
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

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

namespace gradcomp::testing {
namespace {

constexpr uint64_t kSeed = 4321;
constexpr size_t kBucket = 5;
constexpr int kSteps = 3;

uint32_t world_size() { return static_cast<uint32_t>(world()->size()); }
uint32_t my_rank() { return static_cast<uint32_t>(world()->rank()); }

// A port free now on the loopback (rank 0's; the others get it from rank 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw Error("free_port: no socket");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// One server per worker process, on a thread, for the whole run; stopped at the end.
class Servers : public ::testing::Environment {
 public:
  void SetUp() override {
    int port = my_rank() == 0 ? free_port() : 0;
    world()->broadcast(std::as_writable_bytes(std::span(&port, 1)), 0)->wait(world()->timeout());
    const std::string store = fmt::format("tcp://127.0.0.1:{}", port);
    ::setenv("GRADCOMP_SERVERS", std::to_string(world_size()).c_str(), 1);
    ::setenv("GRADCOMP_SERVER_STORE", store.c_str(), 1);
    ServerOptions o;
    o.index = static_cast<int>(my_rank());
    o.servers = static_cast<int>(world_size());
    o.workers = static_cast<int>(world_size());
    o.store = store;
    o.timeout = world()->timeout();
    thread_ = std::thread([this, o] {
      try {
        run_server(o);
      } catch (...) {
        error_ = std::current_exception();
      }
    });
  }
  void TearDown() override {
    stop_servers();
    thread_.join();
    if (error_) {
      try {
        std::rethrow_exception(error_);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "server " << my_rank() << ": " << e.what();
      }
    }
  }

 private:
  std::thread thread_;
  std::exception_ptr error_;
};

[[maybe_unused]] auto* const g_servers = ::testing::AddGlobalTestEnvironment(new Servers);

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
                                           "natural|none"),
                         [](const auto& info) {
                           std::string name;
                           for (char c : info.param) name += std::isalnum(c) ? c : '_';
                           return name;
                         });

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

TEST(ServersRouteState, CheckpointsRefuseServerMemoryAndKeepTheWorkers) {
  const size_t n = 999;
  auto link = route::ServerLink::claim(*world());
  RouteEnv env{.world = world().get(), .seed = kSeed, .threads = 1};
  env.servers = link.get();
  auto with_memory = make_route(parse_option("qsgd|ef|servers"), kBucket, n, env);
  try {
    with_memory->save_state();
    FAIL() << "save_state took the servers' memory as saved";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("twoway"), std::string::npos) << e.what();
  }
  auto without = make_route(parse_option("qsgd|ef|servers:server_feedback=none"), kBucket, n, env);
  run_step(*without, input(n, 0, 3), step_state(0));
  const auto saved = without->save_state();
  auto fresh = make_route(parse_option("qsgd|ef|servers:server_feedback=none"), kBucket, n, env);
  fresh->load_state(saved);
  EXPECT_EQ(fresh->save_state(), saved);
}

TEST(ServersRouteLink, OneLiveEngineAtATimeAndAClearErrorWithoutALink) {
  auto link = route::ServerLink::claim(*world());
  try {
    route::ServerLink::claim(*world());
    FAIL() << "a second claim was granted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("another live engine"), std::string::npos) << e.what();
  }
  link.reset();
  link = route::ServerLink::claim(*world());  // released: granted again
  EXPECT_EQ(link->servers(), world_size());
  RouteEnv no_link{.world = world().get(), .seed = kSeed, .threads = 1};
  EXPECT_THROW(make_route(parse_option("qsgd|ef|servers"), kBucket, 10, no_link), Error);
}

}  // namespace
}  // namespace gradcomp::testing
