// The planner against brute force on small instances, its guarantees (never worse than the
// best uncompressed plan, only allowed options, deterministic) and its errors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "gradcomp/error.h"
#include "gradcomp/model/planner.h"
#include "gradcomp/recommended.h"
#include "support/sanitizers.h"

namespace gradcomp::model {
namespace {

Profile random_profile(std::mt19937& rng, size_t tensors) {
  std::uniform_int_distribution<int> log_size(6, 23);
  std::uniform_real_distribution<double> gap(0.0, 4e-3);
  Profile p;
  p.model = "random";
  p.source = "test";
  p.batch_size = 1;
  double t = 0;
  for (size_t i = 0; i < tensors; ++i) {
    t += gap(rng);
    p.tensors.push_back({"t" + std::to_string(i), size_t{1} << log_size(rng), t});
  }
  p.backward_s = t + gap(rng);
  p.forward_s = p.backward_s / 2;
  return p;
}

Cluster random_cluster(std::mt19937& rng) {
  std::uniform_real_distribution<double> log_rate(8.0, 10.7);  // 100 MB/s .. 50 GB/s
  std::uniform_int_distribution<int> log_workers(1, 6);
  Cluster c;
  c.workers = 1 << log_workers(rng);
  c.per_node = 1;
  c.inter.bytes_per_s = std::pow(10.0, log_rate(rng));
  c.inter.latency_s = 20e-6;
  return c;
}

CodecCosts test_costs() {
  CodecCosts costs;
  // encode, encode with feedback, decode: a + b n seconds.
  costs.set("none", {{0, 0}, {0, 0}, {1e-6, 0.1e-9}});
  costs.set("fp16", {{2e-6, 0.3e-9}, {2e-6, 0.4e-9}, {2e-6, 0.3e-9}});
  costs.set("topk", {{10e-6, 2e-9}, {10e-6, 2.5e-9}, {5e-6, 0.2e-9}});
  return costs;
}

PlannerSettings three_options() {
  PlannerSettings s;
  s.codecs = {"fp16|none|allreduce", "topk:ratio=0.01|ef|allgather"};
  s.try_caller_encoding = false;
  s.slice_from_elements = 0;  // the exhaustive search keeps tensors whole
  return s;
}

TEST(Planner, ThreeOptionsOnAnyCluster) {
  Cluster c;
  c.workers = 8;
  EXPECT_EQ(candidate_options(three_options(), c).size(), 3u);
}

TEST(Planner, MatchesExhaustiveSearchOnRandomSmallInstances) {
  // Under AddressSanitizer (with the fuzzers' coverage instrumentation, ~3x slower again) two
  // rounds of every size instead of five.
  constexpr int kInstances = testing::kAddressSanitizer ? 16 : 40;
  std::mt19937 rng(7);
  for (int instance = 0; instance < kInstances; ++instance) {
    const size_t n = 2 + instance % 8;  // 2..9 tensors
    const Profile profile = random_profile(rng, n);
    const CostModel cost(random_cluster(rng), test_costs());
    const auto settings = three_options();
    const auto dp = make_plan(profile, cost, settings);
    const auto brute = exhaustive_plan(profile, cost, settings);
    SCOPED_TRACE(::testing::Message() << "instance " << instance << ", " << n << " tensors");
    EXPECT_LE(dp.predicted.iteration_s, brute.predicted.iteration_s * 1.01);
    EXPECT_GE(dp.predicted.iteration_s, brute.predicted.iteration_s * (1 - 1e-9));
    EXPECT_NEAR(dp.uncompressed_s, brute.uncompressed_s, brute.uncompressed_s * 0.01);
  }
}

TEST(Planner, MatchesExhaustiveSearchAtTwelveTensors) {
  // Twelve tensors of 2^20 elements, buckets of at most four (16 MB): brute force stays at
  // about two million plans. Under AddressSanitizer (a Debug build with coverage
  // instrumentation, ~50x slower) nine tensors keep the test to seconds; the DP code it checks
  // is the same.
  constexpr size_t kTensors = testing::kAddressSanitizer ? 9 : 12;
  std::mt19937 rng(12);
  Profile profile = random_profile(rng, kTensors);
  for (auto& t : profile.tensors) t.elements = size_t{1} << 20;
  for (const double gbit : {1.0}) {  // where compressing some buckets and not others pays
    Cluster cluster;
    cluster.workers = 16;
    cluster.inter.bytes_per_s = gbit * 1.25e8;
    const CostModel cost(cluster, test_costs());
    PlannerSettings settings = three_options();
    settings.max_bucket_bytes = 16u << 20;
    const auto dp = make_plan(profile, cost, settings);
    const auto brute = exhaustive_plan(profile, cost, settings);
    SCOPED_TRACE(::testing::Message() << gbit << " Gbit/s");
    EXPECT_LE(dp.predicted.iteration_s, brute.predicted.iteration_s * 1.01);
    EXPECT_GE(dp.predicted.iteration_s, brute.predicted.iteration_s * (1 - 1e-9));
  }
}

TEST(Planner, NeverPredictsWorseThanTheBestUncompressedPlan) {
  std::mt19937 rng(3);
  for (int instance = 0; instance < 20; ++instance) {
    const Profile profile = random_profile(rng, 30 + instance * 5);
    const CostModel cost(random_cluster(rng), test_costs());
    PlannerSettings settings = three_options();
    settings.try_caller_encoding = true;
    const auto result = make_plan(profile, cost, settings);
    EXPECT_LE(result.predicted.iteration_s, result.uncompressed_s * (1 + 1e-12));
    EXPECT_NO_THROW(result.plan.validate());
  }
}

// 8 workers on 100 Mbit/s: compression pays.
Cluster slow_cluster() {
  Cluster slow;
  slow.workers = 8;
  slow.inter.bytes_per_s = 1.25e7;
  return slow;
}

TEST(Planner, CompressesWhenTheNetworkIsSlowAndNotWhenItIsFast) {
  std::mt19937 rng(5);
  const Profile profile = random_profile(rng, 20);
  const Cluster slow = slow_cluster();
  Cluster fast = slow;
  fast.inter.bytes_per_s = 1e12;
  const auto on_slow = make_plan(profile, CostModel(slow, test_costs()), three_options());
  const auto on_fast = make_plan(profile, CostModel(fast, test_costs()), three_options());
  auto compressed = [](const Plan& plan) {
    for (const auto& b : plan.buckets) {
      if (b.option.codec != "none") return true;
    }
    return false;
  };
  EXPECT_TRUE(compressed(on_slow.plan));
  EXPECT_LT(on_slow.predicted.iteration_s, on_slow.uncompressed_s);
  EXPECT_FALSE(compressed(on_fast.plan));
}

// One large tensor ready first (as a classifier's weight in VGG-16), smaller ones after it.
Profile one_large_tensor() {
  Profile p;
  p.model = "large-first";
  p.source = "test";
  p.batch_size = 1;
  p.tensors.push_back({"fc.weight", size_t{1} << 24, 1e-3});
  for (int i = 0; i < 12; ++i) {
    p.tensors.push_back({fmt::format("conv{}.weight", i), size_t{1} << 18, 2e-3 * (i + 1)});
  }
  p.backward_s = 0.03;
  p.forward_s = 0.015;
  return p;
}

// A large tensor cut into slices pipelines its encoding, exchange and decoding: the planner
// slices it where that is predicted faster, the simulator prices the sliced plan as predicted,
// and with slicing off the tensors stay whole.
TEST(Planner, SlicesALargeTensorWhereItPipelines) {
  const Profile profile = one_large_tensor();
  const CostModel cost(slow_cluster(), test_costs());
  PlannerSettings settings = three_options();
  settings.slice_from_elements = size_t{1} << 22;
  const auto sliced = make_plan(profile, cost, settings);
  settings.slice_from_elements = 0;
  const auto whole = make_plan(profile, cost, settings);
  ASSERT_TRUE(sliced.plan.sliced());
  EXPECT_FALSE(whole.plan.sliced());
  EXPECT_GT(sliced.plan.tensors[0].slices, 1u);
  for (size_t t = 1; t < profile.tensors.size(); ++t) EXPECT_EQ(sliced.plan.tensors[t].slices, 1u);
  EXPECT_LT(sliced.predicted.iteration_s, (1 - kSliceGain) * whole.predicted.iteration_s);
  EXPECT_NO_THROW(sliced.plan.validate());
  EXPECT_EQ(simulate(profile, sliced.plan, cost).iteration_s, sliced.predicted.iteration_s);
  // The registered tensors are the profile's: the plan runs on the model as it is.
  for (size_t t = 0; t < profile.tensors.size(); ++t) {
    EXPECT_EQ(sliced.plan.tensors[t].name, profile.tensors[t].name);
    EXPECT_EQ(sliced.plan.tensors[t].elements, profile.tensors[t].elements);
  }
  // Fast enough a network that nothing is worth compressing or cutting: whole tensors.
  Cluster fast = slow_cluster();
  fast.inter.bytes_per_s = 1e12;
  settings.slice_from_elements = size_t{1} << 22;
  EXPECT_FALSE(make_plan(profile, CostModel(fast, test_costs()), settings).plan.sliced());
}

// The case: VGG-16 (fc6 alone is 102.8M elements) on 64 workers at 25 Gbit/s, with
// the shipped codec costs and the recommended options.
TEST(Planner, SlicesSpeedUpVgg16At25GbitOn64Workers) {
  const Profile profile = load_profile("vgg16");
  Cluster cluster;
  cluster.workers = 64;
  cluster.inter.bytes_per_s = 25e9 / 8;
  cluster.inter.latency_s = 10e-6;
  const CostModel cost(cluster, CodecCosts::shipped());
  PlannerSettings settings;
  settings.codecs = recommended_options({OptimizerFamily::kSgd, OptimizerFamily::kAdam});
  const auto whole = make_plan(profile, cost, settings);  // by default, tensors stay whole
  EXPECT_FALSE(whole.plan.sliced());
  settings.slice_from_elements = size_t{1} << 22;
  const auto sliced = make_plan(profile, cost, settings);
  EXPECT_TRUE(sliced.plan.sliced());
  EXPECT_LT(sliced.predicted.iteration_s, 0.9 * whole.predicted.iteration_s);
}

// start_step goes into the compressed buckets only, and does not change the search (the cost
// model prices the steady state).
TEST(Planner, StartStepGoesIntoCompressedBucketsOnly) {
  std::mt19937 rng(5);
  const Profile profile = random_profile(rng, 20);
  const CostModel cost(slow_cluster(), test_costs());
  auto settings = three_options();
  const auto steady = make_plan(profile, cost, settings);
  settings.start_step = 700;
  const auto warm = make_plan(profile, cost, settings);
  ASSERT_EQ(warm.plan.buckets.size(), steady.plan.buckets.size());
  size_t compressed = 0;
  for (size_t b = 0; b < warm.plan.buckets.size(); ++b) {
    Option expected = steady.plan.buckets[b].option;
    if (expected.codec != "none") {
      expected.start_step = 700;
      ++compressed;
    }
    EXPECT_EQ(warm.plan.buckets[b].option, expected) << "bucket " << b;
    EXPECT_EQ(warm.plan.buckets[b].tensors, steady.plan.buckets[b].tensors) << "bucket " << b;
  }
  EXPECT_GT(compressed, 0u);
  EXPECT_EQ(warm.predicted.iteration_s, steady.predicted.iteration_s);
}

TEST(Planner, IsDeterministic) {
  std::mt19937 rng(9);
  const Profile profile = random_profile(rng, 80);
  const CostModel cost(random_cluster(rng), test_costs());
  EXPECT_EQ(make_plan(profile, cost, three_options()).plan,
            make_plan(profile, cost, three_options()).plan);
}

TEST(Planner, UsesOnlyAllowedOptionsAndRespectsMinimumSize) {
  std::mt19937 rng(11);
  const Profile profile = random_profile(rng, 40);
  Cluster cluster;
  cluster.workers = 8;
  cluster.inter.bytes_per_s = 1.25e7;
  PlannerSettings settings = three_options();
  settings.min_compress_elements = 1 << 20;
  const auto result = make_plan(profile, CostModel(cluster, test_costs()), settings);
  for (size_t b = 0; b < result.plan.buckets.size(); ++b) {
    const auto& o = result.plan.buckets[b].option;
    EXPECT_TRUE(o.codec == "none" || o.codec == "fp16" || o.codec == "topk:ratio=0.01");
    if (o.codec != "none") {
      EXPECT_GE(result.plan.bucket_elements(b), size_t{1} << 20);
    }
  }
}

// Whether a compressed bucket of the plan holds a piece of a tensor under `small` elements.
bool compresses_a_small_tensor(const Plan& plan, size_t small) {
  const auto pieces = plan.pieces();
  for (const Bucket& b : plan.buckets) {
    if (b.option.codec == "none") continue;
    for (size_t p : b.tensors) {
      if (plan.tensors[pieces[p].tensor].elements < small) return true;
    }
  }
  return false;
}

// small_tensor_elements: tensors under it never travel compressed, whatever the bucket; they
// share one uncompressed bucket; the others are still compressed where that pays, sliced too;
// the plan is priced on the whole profile and never predicted worse than uncompressed.
TEST(Planner, SmallTensorsNeverTravelCompressed) {
  constexpr size_t kSmall = size_t{1} << 14;
  std::mt19937 rng(11);
  Profile profile = random_profile(rng, 40);
  profile.tensors[3].elements = size_t{1} << 24;  // a tensor worth slicing
  const CostModel cost(slow_cluster(), test_costs());
  PlannerSettings settings = three_options();
  settings.slice_from_elements = size_t{1} << 22;
  const auto every = make_plan(profile, cost, settings);
  ASSERT_TRUE(compresses_a_small_tensor(every.plan, kSmall));  // else the test shows nothing
  settings.small_tensor_elements = kSmall;
  const auto apart = make_plan(profile, cost, settings);
  EXPECT_FALSE(compresses_a_small_tensor(apart.plan, kSmall));
  EXPECT_NO_THROW(apart.plan.validate());  // every piece in exactly one bucket
  EXPECT_TRUE(apart.plan.sliced());
  size_t compressed = 0, holding_small = 0;
  for (const Bucket& b : apart.plan.buckets) {
    compressed += b.option.codec != "none";
    bool small = false;
    for (size_t p : b.tensors)
      small |= apart.plan.tensors[apart.plan.pieces()[p].tensor].elements < kSmall;
    holding_small += small;
  }
  EXPECT_GT(compressed, 0u);
  EXPECT_EQ(holding_small, 1u);
  for (size_t t = 0; t < profile.tensors.size(); ++t) {
    EXPECT_EQ(apart.plan.tensors[t].name, profile.tensors[t].name);
  }
  EXPECT_EQ(simulate(profile, apart.plan, cost).iteration_s, apart.predicted.iteration_s);
  EXPECT_LE(apart.predicted.iteration_s, apart.uncompressed_s);
  // Launch order: by each bucket's last piece, as tensors become ready.
  for (size_t b = 1; b < apart.plan.buckets.size(); ++b) {
    EXPECT_LT(apart.plan.buckets[b - 1].tensors.back(), apart.plan.buckets[b].tensors.back());
  }
  // All small, or none: the plan is uncompressed, or the rule changes nothing.
  settings.small_tensor_elements = size_t{1} << 30;
  EXPECT_FALSE(compresses_a_small_tensor(make_plan(profile, cost, settings).plan, 1u << 30));
  settings.small_tensor_elements = 1;
  EXPECT_EQ(make_plan(profile, cost, settings).plan, every.plan);
}

TEST(Planner, OneLossyStepExcludesTwoWayAndHierarchicalTwoWay) {
  Cluster cluster;
  cluster.workers = 16;
  cluster.per_node = 4;
  PlannerSettings settings;
  settings.codecs = {"topk:ratio=0.01|ef"};
  settings.one_lossy_step = true;
  for (const auto& o : candidate_options(settings, cluster)) {
    EXPECT_EQ(o.route.find("twoway"), std::string::npos) << o.route;
  }
  settings.one_lossy_step = false;
  bool twoway = false;
  for (const auto& o : candidate_options(settings, cluster)) {
    twoway = twoway || o.route.find("twoway") != std::string::npos;
  }
  EXPECT_TRUE(twoway);
}

// Route servers only to a job that has servers (the cluster says how many), only to codecs it
// can carry, never inside a route over nodes, and not when one lossy step is the rule.
TEST(Planner, OffersTheServersRouteOnlyToAJobWithServers) {
  Cluster cluster;
  cluster.workers = 16;
  cluster.per_node = 4;
  PlannerSettings settings;
  settings.codecs = {"topk:ratio=0.01|ef", "powersgd:rank=4|ef"};
  const auto routes_of = [&](const std::string& codec) {
    std::multiset<std::string> routes;
    for (const auto& o : candidate_options(settings, cluster)) {
      if (o.codec.rfind(codec, 0) == 0 && o.encode_on == EncodeOn::kEngine) routes.insert(o.route);
    }
    return routes;
  };
  EXPECT_EQ(routes_of("topk").count("twoway"), 1u);
  EXPECT_EQ(routes_of("topk").count("servers"), 0u);
  cluster.servers = 4;
  EXPECT_EQ(routes_of("topk").count("servers"), 1u);
  EXPECT_EQ(routes_of("none").count("servers"), 0u);
  EXPECT_EQ(routes_of("powersgd").count("servers"), 0u);  // not shardable: twoway neither
  EXPECT_EQ(routes_of("powersgd").count("twoway"), 0u);
  for (const auto& r : routes_of("topk")) EXPECT_EQ(r.find("inner=servers"), std::string::npos);
  settings.one_lossy_step = true;
  EXPECT_EQ(routes_of("topk").count("servers"), 0u);
}

// Over nodes the planner offers both routes, but not the sharded one to a codec that compresses
// each tensor on its own: its shards cut through the tensors.
TEST(Planner, ShardsOverNodesOnlyCodecsThatIgnoreTheLayout) {
  Cluster cluster;
  cluster.workers = 16;
  cluster.per_node = 4;
  PlannerSettings settings;
  const auto routes = [&](const char* codec) {
    settings.codecs = {codec};
    std::set<std::string> out;
    for (const auto& o : candidate_options(settings, cluster)) {
      if (o.codec != "none") out.insert(o.route);
    }
    return out;
  };
  EXPECT_TRUE(routes("topk:ratio=0.01|ef").contains("sharded:inner=allgather"));
  EXPECT_TRUE(routes("topk:ratio=0.01|ef").contains("hierarchical:inner=allgather"));
  const auto powersgd = routes("powersgd:rank=4|ef");
  EXPECT_TRUE(powersgd.contains("hierarchical:inner=allreduce"));
  for (const auto& r : powersgd) EXPECT_EQ(r.rfind("sharded", 0), std::string::npos) << r;
}

TEST(Planner, AWarmUpWithoutARouteKeepsEveryRouteAndItsStart) {
  Cluster cluster;
  cluster.workers = 4;
  PlannerSettings settings;
  settings.codecs = {"efsignsgd|ef"};
  std::vector<std::string> plain;
  for (const auto& o : candidate_options(settings, cluster)) plain.push_back(o.route);
  settings.codecs = {"efsignsgd|ef||start=469"};
  std::vector<std::string> warm;
  for (const auto& o : candidate_options(settings, cluster)) {
    warm.push_back(o.route);
    EXPECT_EQ(o.start_step, o.codec == "none" ? 0u : 469u) << o.codec << " " << o.route;
  }
  EXPECT_EQ(warm, plain);
  EXPECT_GT(warm.size(), 2u);  // none, and efsignsgd over allgather and twoway at least
  settings.codecs = {"efsignsgd|ef|twoway|start=469"};
  for (const auto& o : candidate_options(settings, cluster)) {
    if (o.codec != "none") {
      EXPECT_EQ(o.route, "twoway");
    }
  }
}

TEST(Planner, UnknownCodecIsAnErrorListingTheCodecs) {
  Cluster cluster;
  PlannerSettings settings;
  settings.codecs = {"zip"};
  try {
    candidate_options(settings, cluster);
    FAIL() << "no error";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("available codecs"), std::string::npos) << e.what();
  }
}

TEST(Planner, ExhaustiveSearchRefusesLargeInstances) {
  std::mt19937 rng(1);
  const Profile profile = random_profile(rng, 20);
  EXPECT_THROW(exhaustive_plan(profile, CostModel(Cluster{}, test_costs()), three_options()),
               Error);
}

}  // namespace
}  // namespace gradcomp::model
