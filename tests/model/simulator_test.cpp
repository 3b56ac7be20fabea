// The simulator on timelines small enough to work out by hand.
//
// Setup: 2 workers on 2 nodes, a link with no latency at 100 kB/s, and fp16 priced at 10 us per
// element to encode and to decode (passes are free). fp16 sends 2 bytes per element and a
// 2-rank ring allreduce moves (2-1)/2 * 2 = 1 times them, so a bucket of n elements costs
//   encode 10 us * n, exchange 20 us * n, decode 10 us * n:
// 1000 elements: 10, 20, 10 ms; 2000 elements: 20, 40, 20 ms.
#include "gradcomp/model/simulator.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

// Every allocation of this test program is counted: simulate() must make none once warm.
namespace {
std::atomic<size_t> g_allocations{0};
}  // namespace

void* operator new(size_t bytes) {
  ++g_allocations;
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
// GCC pairs the library's inlined `new` with this free() and warns; they do match (malloc).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace gradcomp::model {
namespace {

using testing::contains;

using testing::error_text;

constexpr double kMs = 1e-3;

CostModel cost_model() {
  Cluster c;
  c.workers = 2;
  c.per_node = 1;
  c.inter = {1e5, 0};
  CodecCosts costs;
  costs.set("none", {});
  costs.set("fp16", {.encode = {0, 1e-5}, .encode_ef = {0, 1e-5}, .decode = {0, 1e-5}});
  return CostModel(c, costs);
}

// Forward 10 ms, backward 100 ms; three gradients ready 20, 35 and 90 ms into backward.
Profile simulator_profile() {
  Profile p;
  p.model = "hand";
  p.source = "by hand";
  p.batch_size = 1;
  p.forward_s = 10 * kMs;
  p.backward_s = 100 * kMs;
  p.tensors = {{"a", 1000, 20 * kMs}, {"b", 2000, 35 * kMs}, {"c", 1000, 90 * kMs}};
  return p;
}

Plan plan(std::vector<std::vector<size_t>> buckets, const Option& option) {
  Plan plan;
  plan.tensors = simulator_profile().tensor_infos();
  for (auto& tensors : buckets) plan.buckets.push_back({std::move(tensors), option});
  return plan;
}

Option fp16(EncodeOn where = EncodeOn::kEngine) {
  Option o = parse_option("fp16");
  o.encode_on = where;
  return o;
}

// The span named `name`, or a failure.
const Span& span(const SimResult& r, const std::string& name) {
  for (const Span& s : r.spans) {
    if (s.name == name) return s;
  }
  ADD_FAILURE() << "no span '" << name << "'";
  static const Span none;
  return none;
}

void expect_span(const SimResult& r, const std::string& name, const std::string& lane,
                 double start_ms, double end_ms) {
  const Span& s = span(r, name);
  EXPECT_EQ(s.lane, lane) << name;
  EXPECT_NEAR(s.start_s, start_ms * kMs, 1e-12) << name;
  EXPECT_NEAR(s.end_s, end_ms * kMs, 1e-12) << name;
}

TEST(Simulator, ThreeBucketsOnTheEngineThreads) {
  const SimResult r =
      simulate(simulator_profile(), plan({{0}, {1}, {2}}, fp16()), cost_model(), {}, true);
  // Ready at 10 + 20 = 30, 10 + 35 = 45, 10 + 90 = 100 ms.
  expect_span(r, "bucket 0 encode", "encode", 30, 40);
  expect_span(r, "bucket 0 allreduce", "exchange", 40, 60);
  expect_span(r, "bucket 0 decode", "decode", 60, 70);
  // The encoder is free at 40: bucket 1 starts when ready; its exchange waits for its encode.
  expect_span(r, "bucket 1 encode", "encode", 45, 65);
  expect_span(r, "bucket 1 allreduce", "exchange", 65, 105);
  expect_span(r, "bucket 1 decode", "decode", 105, 125);
  // Bucket 2's exchange waits for bucket 1's, its decode for its exchange.
  expect_span(r, "bucket 2 encode", "encode", 100, 110);
  expect_span(r, "bucket 2 allreduce", "exchange", 110, 130);
  expect_span(r, "bucket 2 decode", "decode", 130, 140);
  expect_span(r, "forward", "compute", 0, 10);
  expect_span(r, "backward", "compute", 10, 110);
  EXPECT_NEAR(r.backward_end_s, 110 * kMs, 1e-12);
  EXPECT_NEAR(r.exchange_end_s, 140 * kMs, 1e-12);
  EXPECT_NEAR(r.iteration_s, 140 * kMs, 1e-12);
  EXPECT_DOUBLE_EQ(r.bytes_sent, 2.0 * 4000);
}

TEST(Simulator, CallerEncodingDelaysEveryLaterGradient) {
  Plan p = plan({{0}, {1}, {2}}, fp16());
  p.buckets[1].option.encode_on = EncodeOn::kCaller;
  const SimResult r = simulate(simulator_profile(), p, cost_model(), {}, true);
  expect_span(r, "bucket 0 encode", "encode", 30, 40);
  // Bucket 1 is encoded on the compute thread from 45 to 65 ms: backward pauses 20 ms.
  expect_span(r, "bucket 1 encode", "compute", 45, 65);
  expect_span(r, "bucket 1 allreduce", "exchange", 65, 105);
  // Gradient c comes 20 ms late: 10 + 90 + 20 = 120.
  expect_span(r, "bucket 2 encode", "encode", 120, 130);
  expect_span(r, "bucket 2 allreduce", "exchange", 130, 150);
  expect_span(r, "bucket 2 decode", "decode", 150, 160);
  EXPECT_NEAR(r.backward_end_s, 130 * kMs, 1e-12);
  EXPECT_NEAR(r.iteration_s, 160 * kMs, 1e-12);
  // The compute lane: forward, backward up to the hand-over, the encode, the rest of backward.
  std::vector<std::pair<double, double>> compute;
  for (const Span& s : r.spans) {
    if (s.lane == "compute") compute.emplace_back(s.start_s / kMs, s.end_s / kMs);
  }
  ASSERT_EQ(compute.size(), 4u);
  EXPECT_NEAR(compute[1].first, 10, 1e-9);
  EXPECT_NEAR(compute[1].second, 45, 1e-9);
  EXPECT_NEAR(compute[3].first, 65, 1e-9);
  EXPECT_NEAR(compute[3].second, 130, 1e-9);
}

TEST(Simulator, LambdaStretchesBackward) {
  const SimResult r = simulate(simulator_profile(), plan({{0}, {1}, {2}}, fp16()), cost_model(),
                               {.lambda = 1.5}, true);
  expect_span(r, "bucket 0 encode", "encode", 10 + 30, 50);
  expect_span(r, "bucket 1 encode", "encode", 10 + 52.5, 82.5);
  expect_span(r, "bucket 2 encode", "encode", 10 + 135, 155);
  EXPECT_NEAR(r.backward_end_s, 160 * kMs, 1e-12);
  // Bucket 2: exchange 155-175, decode 175-185.
  EXPECT_NEAR(r.iteration_s, 185 * kMs, 1e-12);
}

TEST(Simulator, BucketsLaunchInPlanOrder) {
  // Bucket 0 holds the last gradient: bucket 1 ({a, b}, complete at 45) waits for it.
  const SimResult r =
      simulate(simulator_profile(), plan({{2}, {0, 1}}, fp16()), cost_model(), {}, true);
  expect_span(r, "bucket 0 encode", "encode", 100, 110);
  expect_span(r, "bucket 1 encode", "encode", 110, 140);
  expect_span(r, "bucket 1 allreduce", "exchange", 140, 200);
}

TEST(Simulator, FreeCompressionReachesTheComputeBound) {
  Cluster c;
  c.workers = 1;
  CodecCosts costs;
  costs.set("none", {});
  const SimResult r = simulate(simulator_profile(), plan({{0, 1, 2}}, {}), CostModel(c, costs));
  EXPECT_DOUBLE_EQ(r.iteration_s, compute_bound(simulator_profile()));
  EXPECT_DOUBLE_EQ(compute_bound(simulator_profile()), 110 * kMs);
  EXPECT_TRUE(r.spans.empty());  // not asked for
}

TEST(Simulator, MultiPhaseBucketsListEachPhase) {
  Cluster c;
  c.workers = 4;
  c.inter = {1e9, 1e-6};
  CodecCosts costs;
  costs.set("none", {});
  costs.set("threshold", {.encode = {0, 1e-9}, .encode_ef = {0, 1e-9}, .decode = {0, 1e-9}});
  const CostModel model(c, costs);
  // threshold's frames vary in size, so its allgather route has two phases: sizes, then frames.
  const Option option = parse_option("threshold:tau=0.1");
  const SimResult r = simulate(simulator_profile(), plan({{0, 1, 2}}, option), model, {}, true);
  const BucketCost b = model.bucket(option, 4000);
  const Span& sizes = span(r, "bucket 0 sizes");
  const Span& frames = span(r, "bucket 0 allgather");
  EXPECT_DOUBLE_EQ(sizes.end_s, frames.start_s);
  EXPECT_NEAR(frames.end_s - sizes.start_s, b.exchange_s(), 1e-15);
  EXPECT_DOUBLE_EQ(r.bytes_sent, b.bytes_sent());
}

TEST(Simulator, ChromeTraceHasOneThreadPerLane) {
  const SimResult r =
      simulate(simulator_profile(), plan({{0}, {1}, {2}}, fp16()), cost_model(), {}, true);
  const nlohmann::json trace = r.chrome_trace();
  ASSERT_TRUE(trace.is_array());
  int threads = 0, spans = 0;
  for (const auto& e : trace) {
    if (e["ph"] == "M" && e["name"] == "thread_name") ++threads;
    if (e["ph"] == "X") {
      ++spans;
      if (e["name"] == "bucket 1 allreduce") {
        EXPECT_NEAR(e["ts"].get<double>(), 65000, 1e-6);  // microseconds
        EXPECT_NEAR(e["dur"].get<double>(), 40000, 1e-6);
        EXPECT_EQ(e["tid"], 2);
        EXPECT_EQ(e["args"]["bucket"], 1);
      }
    }
  }
  EXPECT_EQ(threads, 4);
  EXPECT_EQ(spans, static_cast<int>(r.spans.size()));
}

TEST(Simulator, PlansThatDoNotFitTheProfileAreErrors) {
  Plan p = plan({{0}, {1}, {2}}, fp16());
  p.tensors[1].name = "other";
  EXPECT_TRUE(contains(error_text([&] { simulate(simulator_profile(), p, cost_model()); }),
                       "plan tensor 1 is 'other'"));
  p = plan({{0}, {1}}, fp16());
  EXPECT_TRUE(contains(error_text([&] { simulate(simulator_profile(), p, cost_model()); }),
                       "tensor 2 ('c') is in no bucket"));
  p = plan({{0, 1}, {1, 2}}, fp16());
  EXPECT_TRUE(contains(error_text([&] { simulate(simulator_profile(), p, cost_model()); }),
                       "in another bucket"));
  p = plan({{0}, {1}, {2}}, fp16());
  EXPECT_TRUE(
      contains(error_text([&] { simulate(simulator_profile(), p, cost_model(), {.lambda = 0.5}); }),
               "lambda = 0.5 must be >= 1"));
}

TEST(Simulator, ProfileFromAFile) {
  // tests/model/data/tiny.json: the same gradients as simulator_profile(), as the profile loader
  // reads them.
  const auto path = std::filesystem::path(__FILE__).parent_path() / "data" / "tiny.json";
  const Profile loaded = load_profile(path.string());
  EXPECT_EQ(loaded.tensors.size(), 3u);
  const SimResult r = simulate(loaded, plan({{0}, {1}, {2}}, fp16()), cost_model());
  EXPECT_NEAR(r.iteration_s, 140 * kMs, 1e-12);
}

TEST(Simulator, AllocatesNothingOnceWarm) {
  // ResNet-101's size: 314 tensors, one bucket each, options alternating.
  Profile big;
  big.model = "big";
  big.source = "generated";
  big.batch_size = 1;
  big.forward_s = 0.05;
  big.backward_s = 0.1;
  Plan p;
  for (size_t i = 0; i < 314; ++i) {
    big.tensors.push_back({fmt::format("t{}", i), 1000 + 37 * i, 0.1 * i / 314});
    p.buckets.push_back({{i}, i % 2 ? fp16() : Option{}});
  }
  p.tensors = big.tensor_infos();
  const CostModel model = cost_model();
  const double expected = simulate(big, p, model).iteration_s;  // warm: options parsed, scratch grown
  const size_t before = g_allocations.load();
  const auto start = std::chrono::steady_clock::now();
  constexpr int kRuns = 200;
  for (int i = 0; i < kRuns; ++i) EXPECT_EQ(simulate(big, p, model).iteration_s, expected);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(g_allocations.load(), before);
  std::printf("simulate, 314 buckets: %.1f us per call\n", seconds / kRuns * 1e6);
}

}  // namespace
}  // namespace gradcomp::model
