// Overflow-safe routes between real processes (mpirun and `gradcomp launch`, W = 2 and 4).
//
// 1. A NaN or Inf in one rank's gradient makes the aggregate non-finite on every rank, for
//    every codec on every route it can take (that is what tells a loss scaler to skip).
// 2. Rollback: rank 0's gradient of step 1 holds a NaN (or an Inf), every other step is clean.
//    Step 1's aggregate is non-finite on every rank; the route's state after step 1 is its state
//    after step 0, bit for bit; every later aggregate is finite, bit-identical on every rank and
//    equal, bit for bit, to that of the same route run on steps 0, 2, 3, ... only (step 1's
//    data never fed). Equality is exact: randomness is keyed by the step number, which both
//    runs pass alike, and the state before step 2 is the same in both.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "gradcomp/error.h"
#include "gradcomp/spec.h"
#include "route/frames.h"
#include "route/route.h"
#include "support/codec_testing.h"
#include "route/node_split.h"
#include "support/mp_test.h"

namespace gradcomp::testing {
namespace {

constexpr uint64_t kSeed = 99;
constexpr size_t kBucket = 4;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t world_size() { return static_cast<uint32_t>(world()->size()); }
uint32_t my_rank() { return static_cast<uint32_t>(world()->rank()); }


RouteEnv env_for(const Option& option) {
  RouteEnv env{.world = world().get(), .seed = kSeed, .threads = 1};
  if (route_needs_nodes(option.route)) {
    env.intra = nodes().intra.get();
    env.leaders = nodes().leaders.get();
    env.cross = nodes().cross.get();
  }
  return env;
}

StepState step_state(uint64_t s) { return {.step = s, .lr = 0.1, .prev_lr = s == 0 ? 0 : 0.1}; }

// This rank's gradient at step s: different per rank and step.
std::vector<float> grad(size_t n, uint64_t s, uint64_t salt) {
  return gradient(n, 7 + my_rank() + 100 * s + 10000 * salt, 1.0f + 0.25f * my_rank());
}

std::vector<float> run_step(Route& route, std::vector<float> buffer, uint64_t s) {
  const Phases p(kBucket, world()->timeout(), nullptr);
  route.encode(buffer, step_state(s), p);
  route.exchange(step_state(s), p);
  route.decode(buffer, step_state(s), p);
  route.settle(route::all_finite(buffer), step_state(s));  // the bucket is the whole step
  return buffer;
}

bool any_non_finite(const std::vector<float>& x) {
  return std::any_of(x.begin(), x.end(), [](float v) { return !std::isfinite(v); });
}

bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// EXPECT (never ASSERT) before it: every rank must reach this collective.
void expect_same_on_all_ranks(const std::vector<float>& out) {
  const auto mine = std::as_bytes(std::span(out));
  const auto all = gather_bytes(mine);
  for (uint32_t r = 0; r < world_size(); ++r) {
    EXPECT_TRUE(mine.empty() || std::memcmp(all.data() + r * mine.size(), mine.data(),
                                            mine.size()) == 0)
        << "rank " << r << " ended with different bits than rank " << my_rank();
  }
}

std::string describe(const Option& o) {
  return fmt::format("route '{}', codec '{}', feedback '{}', W = {}", o.route, o.codec,
                     o.feedback, world_size());
}

bool fits(const Option& option) {
  try {
    check_route(option);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Every codec (threshold needs its tau) on every route it fits.
std::vector<Option> every_codec_on_every_route(const std::string& feedback) {
  std::vector<Option> options;
  for (const auto& name : codec_names()) {
    const std::string codec = name == "threshold" ? "threshold:tau=0.5" : name;
    for (const char* route : {"allreduce", "allgather", "twoway", "hierarchical:inner=allreduce",
                              "hierarchical:inner=allgather,intra=fp16",
                              "hierarchical:inner=twoway", "sharded:inner=allreduce",
                              "sharded:inner=allgather,intra=fp16", "sharded:inner=twoway"}) {
      const Option option{.codec = codec, .feedback = feedback, .route = route};
      if (fits(option)) options.push_back(option);
    }
  }
  return options;
}

TEST(RollbackMp, NonFiniteInOneRankReachesTheAggregateOnEveryRank) {
  const size_t n = 1001;
  for (const std::string feedback : {"none", "ef"}) {
    for (const Option& option : every_codec_on_every_route(feedback)) {
      for (const float bad : {kNaN, kInf, -kInf}) {
        for (const uint32_t culprit : {0u, world_size() - 1}) {
          SCOPED_TRACE(fmt::format("{}, {} on rank {}", describe(option), bad, culprit));
          const auto route = make_route(option, kBucket, n, env_for(option));
          auto g = grad(n, 0, 1);
          if (my_rank() == culprit) g[n - 2] = bad;
          const auto out = run_step(*route, g, 0);
          EXPECT_TRUE(any_non_finite(out)) << "the aggregate is finite: a loss scaler would not "
                                              "see the overflow";
          expect_same_on_all_ranks(out);
        }
      }
    }
  }
}

// Route A sees a NaN (or Inf) on rank 0 at step 1; route B never sees step 1.
void check_rollback(const Option& option, float bad, uint64_t salt) {
  SCOPED_TRACE(fmt::format("{}, step 1 holds {}", describe(option), bad));
  const size_t n = 1001;
  const auto a = make_route(option, kBucket, n, env_for(option));
  const auto b = make_route(option, kBucket, n, env_for(option));
  run_step(*a, grad(n, 0, salt), 0);
  run_step(*b, grad(n, 0, salt), 0);
  const auto before = a->save_state();
  auto g1 = grad(n, 1, salt);
  if (my_rank() == 0) g1[17] = bad;
  const auto bad_out = run_step(*a, g1, 1);
  EXPECT_TRUE(any_non_finite(bad_out)) << "step 1's aggregate is finite";
  expect_same_on_all_ranks(bad_out);
  EXPECT_TRUE(a->save_state() == before) << "the state after the skipped step differs";
  for (uint64_t s = 2; s < 5; ++s) {
    const auto out_a = run_step(*a, grad(n, s, salt), s);
    const auto out_b = run_step(*b, grad(n, s, salt), s);
    EXPECT_FALSE(any_non_finite(out_a)) << "step " << s << " is not finite";
    EXPECT_TRUE(same_bytes(out_a, out_b)) << "step " << s << " differs from the run without step 1";
    expect_same_on_all_ranks(out_a);
  }
  EXPECT_TRUE(a->save_state() == b->save_state()) << "final states differ";
}

std::vector<Option> rollback_cases() {
  std::vector<Option> cases;
  auto add = [&](const std::string& codec, const std::string& feedback) {
    for (const char* route : {"allreduce", "allgather", "twoway"}) {
      const Option option{.codec = codec, .feedback = feedback, .route = route};
      if (fits(option)) cases.push_back(option);
    }
  };
  for (const char* codec : {"qsgd", "fp16", "topk:ratio=0.1", "randomk:ratio=0.1", "powersgd",
                            "signsgd", "intq", "onebit", "efsignsgd", "dgc:ratio=0.1"}) {
    add(codec, "ef");
  }
  for (const char* codec : {"topk:ratio=0.1", "fp16", "powersgd"}) {
    add(codec, "dgc");
    add(codec, "nesterov");
    add(codec, "nesterov:ef=true");
  }
  add("signum", "none");    // codec state alone
  add("powersgd", "none");  // the warm start alone
  add("signum", "ef");
  cases.push_back({.codec = "qsgd", .feedback = "none", .route = "twoway:server_feedback=ef"});
  cases.push_back({.codec = "topk:ratio=0.1", .feedback = "ef",
                   .route = "hierarchical:inner=allgather"});
  cases.push_back({.codec = "powersgd", .feedback = "ef", .route = "hierarchical:inner=allreduce"});
  cases.push_back({.codec = "qsgd", .feedback = "ef", .route = "hierarchical:inner=twoway"});
  cases.push_back({.codec = "topk:ratio=0.1", .feedback = "ef", .route = "sharded:inner=allgather"});
  cases.push_back({.codec = "powersgd", .feedback = "ef", .route = "sharded:inner=allreduce"});
  return cases;
}

TEST(RollbackMp, ASkippedStepLeavesEveryStateAsBefore) {
  uint64_t salt = 0;
  for (const Option& option : rollback_cases()) {
    ++salt;
    check_rollback(option, salt % 2 == 0 ? kNaN : kInf, salt);
  }
}

}  // namespace
}  // namespace gradcomp::testing
