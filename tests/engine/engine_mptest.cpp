// The engine across real processes (mpirun and the Gloo launcher, W = 2 and 4): gradients
// handed over in any order come back as the mean over ranks, bit-identical on every rank, for
// every route; checkpoints resume exactly; the timeline is written; ranks that registered
// different tensors get an error naming the first difference; memory stays bounded.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <numeric>

#include <nlohmann/json.hpp>

#include "gradcomp/engine.h"
#include "gradcomp/error.h"
#include "support/mp_test.h"
#include "engine_testing.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::gather_bytes;
using testing::world;

using engine_testing::expect_identical_across_ranks;
using engine_testing::model_tensors;
using engine_testing::plan_with;

// Rank r's gradients of step s: reproducible on every rank, so each rank can compute the mean.
std::vector<std::vector<float>> gradients(const std::vector<TensorInfo>& tensors, int rank,
                                          uint64_t step) {
  std::vector<std::vector<float>> g;
  for (size_t t = 0; t < tensors.size(); ++t) {
    g.push_back(engine_testing::gradient(tensors, t, rank, step));
  }
  return g;
}

// Hands every gradient over (in `order`), synchronizes, and returns the results.
std::vector<std::vector<float>> run_step(Engine& engine, uint64_t step,
                                         const std::vector<size_t>& order) {
  auto g = gradients(engine.plan().tensors, world()->rank(), step);
  for (size_t t : order) engine.ready(t, g[t]);
  engine.synchronize();
  return g;
}

std::vector<size_t> backward_order(size_t n) {
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  return order;
}

// Three uncompressed steps of `plan` over model_tensors(), the gradients handed over in a
// different order each step: the mean, the same bits on every rank.
void expect_the_mean_in_any_order(const Plan& plan) {
  Engine engine(world(), plan);
  const int W = world()->size();
  auto order = backward_order(model_tensors().size());
  for (uint64_t step = 0; step < 3; ++step) {
    if (step == 1) std::reverse(order.begin(), order.end());
    if (step == 2) std::rotate(order.begin(), order.begin() + 3, order.end());
    const auto got = run_step(engine, step, order);
    for (size_t t = 0; t < got.size(); ++t) {
      std::vector<double> mean(got[t].size(), 0.0);
      for (int r = 0; r < W; ++r) {
        const auto g = gradients(model_tensors(), r, step)[t];
        for (size_t i = 0; i < g.size(); ++i) mean[i] += g[i] / W;
      }
      for (size_t i = 0; i < got[t].size(); ++i) {
        ASSERT_NEAR(got[t][i], mean[i], 1e-5) << model_tensors()[t].name << "[" << i << "]";
      }
    }
    expect_identical_across_ranks(got);
  }
  EXPECT_EQ(engine.step(), 3u);
  EXPECT_EQ(engine.last_step().uncompressed_bytes,
            4u * (10 + 40000 + 64 + 36864 + 64 + 18432 + 1728 + 64));
}

TEST(Engine, UncompressedIsTheMeanInAnyOrder) { expect_the_mean_in_any_order(plan_with({})); }

// A plan that cuts tensors into slices, each slice in its own bucket: the caller hands over
// whole tensors and gets the mean back in them, as with whole tensors.
TEST(Engine, SlicedTensorsAreTheMeanInAnyOrder) {
  expect_the_mean_in_any_order(engine_testing::sliced_plan_with({}));
}

// Slices through compressing routes: every rank the same bits, and compressed (not the mean).
TEST(Engine, SlicedTensorsCompressedAreBitIdentical) {
  for (const Option& option : {Option{.codec = "topk:ratio=0.05", .feedback = "ef", .route = "allgather"},
                               Option{.codec = "powersgd", .feedback = "ef"},
                               Option{.codec = "qsgd", .route = "twoway"}}) {
    SCOPED_TRACE(option.codec);
    Engine engine(world(), engine_testing::sliced_plan_with(option), EngineOptions{.seed = 3});
    for (uint64_t step = 0; step < 3; ++step) {
      const auto got = run_step(engine, step, backward_order(model_tensors().size()));
      expect_identical_across_ranks(got);
      EXPECT_LT(engine.last_step().bytes_sent, engine.last_step().uncompressed_bytes);
    }
  }
}

// Buckets exchanged side by side on several streams end with the same bits as one after
// another on one: each bucket's collectives are the same, only when they run changes.
TEST(Engine, StreamsGiveTheSameBitsAsOneStream) {
  for (const Option& option :
       {Option{}, Option{.codec = "topk:ratio=0.05", .feedback = "ef", .route = "allgather"},
        Option{.codec = "powersgd", .feedback = "ef"},
        Option{.codec = "qsgd", .route = "twoway"}}) {
    SCOPED_TRACE(option.codec);
    std::vector<std::vector<std::vector<float>>> runs;
    for (const int streams : {1, 2, 3}) {
      Engine engine(world(), plan_with(option), EngineOptions{.seed = 3, .streams = streams});
      ASSERT_GE(engine.plan().buckets.size(), 3u);
      std::vector<std::vector<float>> all;
      for (uint64_t step = 0; step < 3; ++step) {
        const auto got = run_step(engine, step, backward_order(model_tensors().size()));
        expect_identical_across_ranks(got);
        all.insert(all.end(), got.begin(), got.end());
      }
      runs.push_back(std::move(all));
    }
    EXPECT_EQ(runs[1], runs[0]);
    EXPECT_EQ(runs[2], runs[0]);
  }
}

struct RouteCase {
  std::string name;
  Option option;
};

// Engines built in turn on one transport (a resume, a rebuilt plan) run their routes over nodes
// on the transport's node groups, split once, instead of a split of their own each.
TEST(Engine, EnginesInTurnShareTheTransportsNodeGroups) {
  const auto groups = world()->nodes(2);
  const long held = groups.use_count();
  const Option hierarchical{.codec = "topk:ratio=0.1", .feedback = "ef",
                            .route = "hierarchical:inner=allgather"};
  for (uint64_t round = 0; round < 3; ++round) {
    Engine engine(world(), plan_with(hierarchical), EngineOptions{.seed = 7, .local_size = 2});
    EXPECT_EQ(groups.use_count(), held + 1) << "round " << round;
    expect_identical_across_ranks(run_step(engine, round, backward_order(model_tensors().size())));
  }
  EXPECT_EQ(groups.use_count(), held);  // the engines let go; the transport keeps them
  EXPECT_EQ(world()->nodes(2), groups);
}

void PrintTo(const RouteCase& c, std::ostream* os) { *os << c.name; }

class EngineRoutes : public ::testing::TestWithParam<RouteCase> {};

TEST_P(EngineRoutes, BitIdenticalAcrossRanksAndCompressed) {
  Engine engine(world(), plan_with(GetParam().option), EngineOptions{.seed = 7, .local_size = 2});
  for (uint64_t step = 0; step < 4; ++step) {
    const auto got = run_step(engine, step, backward_order(model_tensors().size()));
    expect_identical_across_ranks(got);
    for (const auto& v : got) {
      for (float x : v) ASSERT_TRUE(std::isfinite(x));
    }
  }
  // (Routes over nodes send the whole bucket inside the node: they compress across nodes.)
  const bool nodes = route_needs_nodes(GetParam().option.route);
  if (GetParam().option.codec != "none" && !nodes) {
    EXPECT_LT(engine.last_step().bytes_sent, engine.last_step().uncompressed_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Routes, EngineRoutes,
    ::testing::Values(
        RouteCase{"fp16_allreduce", {.codec = "fp16"}},
        RouteCase{"intq_allreduce", {.codec = "intq", .feedback = "ef"}},
        RouteCase{"powersgd_allreduce", {.codec = "powersgd", .feedback = "ef"}},
        RouteCase{"topk_allgather", {.codec = "topk:ratio=0.05", .feedback = "ef",
                                     .route = "allgather"}},
        RouteCase{"qsgd_allgather_on_caller",
                  {.codec = "qsgd", .route = "allgather", .encode_on = EncodeOn::kCaller}},
        RouteCase{"efsignsgd_twoway", {.codec = "efsignsgd", .feedback = "ef",
                                       .route = "twoway"}},
        RouteCase{"randomk_hierarchical",
                  {.codec = "randomk:ratio=0.1", .route = "hierarchical:inner=allreduce"}},
        RouteCase{"topk_hierarchical_twoway",
                  {.codec = "topk:ratio=0.1", .feedback = "ef",
                   .route = "hierarchical:inner=twoway,intra=fp16"}},
        RouteCase{"powersgd_hierarchical_from_step_2",
                  {.codec = "powersgd", .feedback = "ef", .route = "hierarchical:inner=allreduce",
                   .start_step = 2}},
        RouteCase{"randomk_sharded",
                  {.codec = "randomk:ratio=0.1", .route = "sharded:inner=allreduce"}},
        RouteCase{"topk_sharded_twoway",
                  {.codec = "topk:ratio=0.1", .feedback = "ef",
                   .route = "sharded:inner=twoway,intra=fp16"}},
        RouteCase{"dgc_allgather_from_step_2",
                  {.codec = "dgc:ratio=0.01,stage_steps=1", .feedback = "dgc",
                   .route = "allgather", .start_step = 2}}),
    [](const auto& info) { return info.param.name; });

class EngineCheckpoint : public ::testing::TestWithParam<RouteCase> {};

// A checkpoint taken after 3 steps, loaded into a new engine, gives the same next steps as the
// engine that went on: feedback residuals, codec state (PowerSGD's warm start), step-keyed
// randomness (randomk) and the step counter all resume.
TEST_P(EngineCheckpoint, ResumesBitExactly) {
  const Plan plan = plan_with(GetParam().option);
  const auto order = backward_order(model_tensors().size());
  Engine first(world(), plan, EngineOptions{.seed = 3});
  for (uint64_t s = 0; s < 3; ++s) run_step(first, s, order);
  const auto state = first.save_state();
  std::vector<std::vector<std::vector<float>>> uninterrupted;
  for (uint64_t s = 3; s < 5; ++s) uninterrupted.push_back(run_step(first, s, order));

  Engine resumed(world(), plan, EngineOptions{.seed = 3});
  resumed.load_state(state);
  EXPECT_EQ(resumed.step(), 3u);
  for (uint64_t s = 3; s < 5; ++s) {
    EXPECT_EQ(run_step(resumed, s, order), uninterrupted[s - 3]) << "step " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Options, EngineCheckpoint,
    ::testing::Values(
        RouteCase{"topk_ef_allgather", {.codec = "topk:ratio=0.05", .feedback = "ef",
                                        .route = "allgather"}},
        RouteCase{"powersgd_ef_allreduce", {.codec = "powersgd", .feedback = "ef"}},
        RouteCase{"randomk_allreduce", {.codec = "randomk:ratio=0.1"}},
        RouteCase{"efsignsgd_twoway", {.codec = "efsignsgd", .feedback = "ef",
                                       .route = "twoway"}},
        // Saved at step 3, before the switch at step 4: the resumed run crosses it.
        RouteCase{"powersgd_ef_allreduce_from_step_4",
                  {.codec = "powersgd", .feedback = "ef", .start_step = 4}}),
    [](const auto& info) { return info.param.name; });

// Option::start_step = 2: steps 0 and 1 are the exact float32 mean (the bits of codec none
// without feedback) with the feedback left unsized; steps 2 and 3 are what the compressed
// option gives from an empty memory (top-k does not depend on the step number, so an engine
// compressing from step 0 fed the same gradients is the reference); every rank bit-identical.
TEST(Engine, WarmupExchangesUncompressedUntilStartStep) {
  const Option topk{.codec = "topk:ratio=0.05", .feedback = "ef", .route = "allgather"};
  Option warm = topk;
  warm.start_step = 2;
  Engine engine(world(), plan_with(warm), EngineOptions{.seed = 3});
  // The same buckets uncompressed: an allreduce sums each element in an order set by its place
  // in the buffer, so other buckets could differ in the last bit.
  Plan same_buckets = plan_with(warm);
  for (Bucket& b : same_buckets.buckets) b.option = Option{};
  Engine plain(world(), same_buckets, EngineOptions{.seed = 3});
  Engine compressed(world(), plan_with(topk), EngineOptions{.seed = 3});
  const size_t fresh_memory = engine.memory_bytes();
  const auto order = backward_order(model_tensors().size());
  for (uint64_t s = 0; s < 4; ++s) {
    const auto got = run_step(engine, s, order);
    expect_identical_across_ranks(got);
    if (s < 2) {
      EXPECT_EQ(got, run_step(plain, s, order)) << "step " << s;
      EXPECT_EQ(engine.memory_bytes(), fresh_memory) << "step " << s;
      EXPECT_EQ(engine.last_step().bytes_sent, engine.last_step().uncompressed_bytes);
    } else {
      // The compressed engine's step s - 2 sees step s's gradients.
      auto g = gradients(model_tensors(), world()->rank(), s);
      for (size_t t : order) compressed.ready(t, g[t]);
      compressed.synchronize();
      EXPECT_EQ(got, g) << "step " << s;
      EXPECT_GT(engine.memory_bytes(), fresh_memory) << "step " << s;
      EXPECT_LT(engine.last_step().bytes_sent, engine.last_step().uncompressed_bytes);
    }
  }
}

// A checkpoint taken before the switch (step 1) or after it (step 3) resumes bit-exactly
// across it: the step counter decides which way a bucket travels.
TEST(Engine, WarmupResumesAcrossTheSwitch) {
  for (const Option& option :
       {Option{.codec = "topk:ratio=0.05", .feedback = "ef", .route = "allgather",
               .start_step = 2},
        Option{.codec = "dgc:ratio=0.01,stage_steps=1", .feedback = "dgc",
               .route = "allgather", .start_step = 2}}) {
    const Plan plan = plan_with(option);
    const auto order = backward_order(model_tensors().size());
    Engine first(world(), plan, EngineOptions{.seed = 3});
    std::vector<std::vector<std::byte>> states;
    std::vector<std::vector<std::vector<float>>> uninterrupted;
    for (uint64_t s = 0; s < 6; ++s) {
      if (s == 1 || s == 3) states.push_back(first.save_state());
      uninterrupted.push_back(run_step(first, s, order));
    }
    for (const uint64_t from : {1u, 3u}) {
      Engine resumed(world(), plan, EngineOptions{.seed = 3});
      resumed.load_state(states[from == 1 ? 0 : 1]);
      for (uint64_t s = from; s < 6; ++s) {
        EXPECT_EQ(run_step(resumed, s, order), uninterrupted[s])
            << option.codec << ": resumed at " << from << ", step " << s;
      }
    }
  }
}

// A checkpoint belongs to its plan, seed and rank.
TEST(Engine, CheckpointsAreRefusedElsewhere) {
  const Plan plan = plan_with({.codec = "topk:ratio=0.05", .feedback = "ef", .route = "allgather"});
  Engine engine(world(), plan, EngineOptions{.seed = 3});
  run_step(engine, 0, backward_order(model_tensors().size()));
  const auto state = engine.save_state();

  Engine other_plan(world(), plan_with({}), EngineOptions{.seed = 3});
  EXPECT_NE(testing::error_text([&] { other_plan.load_state(state); }).find("another plan"),
            std::string::npos);
  Engine other_seed(world(), plan, EngineOptions{.seed = 4});
  EXPECT_NE(testing::error_text([&] { other_seed.load_state(state); }).find("seed 3"),
            std::string::npos);
  // Every rank's state has the same size here; rank r tries rank r+1's.
  const auto all = gather_bytes(state);
  const int W = world()->size();
  const size_t next = static_cast<size_t>((world()->rank() + 1) % W);
  const std::span<const std::byte> theirs(all.data() + next * state.size(), state.size());
  const std::string text = testing::error_text([&] { engine.load_state(theirs); });
  EXPECT_NE(text.find("saved by rank " + std::to_string(next)), std::string::npos) << text;
  EXPECT_EQ(text.find("another number of ranks"), std::string::npos) << text;
  // A state of a job of another size says how to go on with this one.
  std::shared_ptr<Transport> alone = world()->split(world()->rank(), 0);  // a world of 1
  Engine single(alone, plan, EngineOptions{.seed = 3});
  run_step(single, 0, backward_order(model_tensors().size()));
  const std::string resized = testing::error_text([&] { engine.load_state(single.save_state()); });
  EXPECT_NE(resized.find("saved by rank 0 of 1"), std::string::npos) << resized;
  EXPECT_NE(resized.find("another number of ranks"), std::string::npos) << resized;
}

TEST(Engine, WritesATimelinePerRank) {
  const std::string path = "/tmp/gradcomp_engine_timeline_" + std::to_string(getppid()) + ".json";
  const Plan plan = plan_with({.codec = "topk:ratio=0.05", .route = "allgather"});
  {
    Engine engine(world(), plan, EngineOptions{.timeline = path});
    for (uint64_t s = 0; s < 2; ++s) run_step(engine, s, backward_order(9));
  }
  const std::string mine =
      "/tmp/gradcomp_engine_timeline_" + std::to_string(getppid()) + ".rank" +
      std::to_string(world()->rank()) + ".json";
  std::ifstream in(mine);
  ASSERT_TRUE(in) << mine;
  const auto trace = nlohmann::json::parse(in);
  std::set<std::string> names;
  std::set<int> lanes;
  for (const auto& e : trace) {
    if (e.value("ph", "") == "X") {
      names.insert(e["name"].get<std::string>());
      lanes.insert(e["tid"].get<int>());
      EXPECT_EQ(e["pid"].get<int>(), world()->rank());
      EXPECT_GE(e["dur"].get<double>(), 0.0);
    }
  }
  for (const char* phase : {"ready", "encode", "decode", "write back"}) {
    EXPECT_TRUE(names.count(phase)) << "no '" << phase << "' event";
  }
  EXPECT_EQ(lanes.size(), plan.buckets.size());
  std::remove(mine.c_str());
}

// The engine's constructor compares the ranks' tensors, plans and settings.
std::string construction_error(const Plan& plan, const EngineOptions& options) {
  try {
    Engine engine(world(), plan, options);
  } catch (const CommError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Engine, MismatchedRegistrationNamesTheFirstDifference) {
  auto tensors = model_tensors();
  if (world()->rank() == 1) tensors[3].elements += 1;  // conv3.weight differs on rank 1
  const std::string message = construction_error(make_default_plan(tensors), {});
  EXPECT_NE(message.find("tensor 3"), std::string::npos) << message;
  EXPECT_NE(message.find("different tensors"), std::string::npos) << message;
  if (world()->rank() == 1) {
    EXPECT_NE(message.find("conv3.weight"), std::string::npos) << message;
  }
  world()->barrier()->wait(world()->timeout());  // the transport itself still works
}

TEST(Engine, DifferentPlansSeedsAndNodesAreErrors) {
  const bool odd = world()->rank() % 2 == 1;
  // Same tensors, another codec on odd ranks (one of them hierarchical: no split may start).
  const Option mine = odd ? Option{.codec = "fp16", .route = "hierarchical"} : Option{};
  std::string text = construction_error(plan_with(mine), {.local_size = 2});
  EXPECT_NE(text.find("different plans"), std::string::npos) << text;
  EXPECT_NE(text.find("bucket"), std::string::npos) << text;
  text = construction_error(plan_with({}), {.seed = odd ? 2u : 1u});
  EXPECT_NE(text.find("different seeds"), std::string::npos) << text;
  text = construction_error(plan_with({.route = "hierarchical"}), {.local_size = odd ? 1 : 2});
  EXPECT_NE(text.find("different local sizes"), std::string::npos) << text;
  // Before any stream is split: a rank splitting alone would wait for the others.
  text = construction_error(plan_with({}), {.streams = odd ? 1 : 2});
  EXPECT_NE(text.find("different stream counts"), std::string::npos) << text;
  world()->barrier()->wait(world()->timeout());
}

// The engine's buffers (fused buffers, frames, worker and server feedback state) stay within
// 4.5x the gradient bytes and do not grow. ef holds e and the spare discard() needs (2x); the
// two-way route adds its server ef (2/W x) and shard sum (1/W x): 4.05x at W = 2 with top-k's
// frames. (With W = 1 the two-way route would hold more: worker and server feedback and the
// shard sum each cover the whole bucket.)
TEST(Engine, MemoryStaysBoundedOverManySteps) {
  for (const char* route : {"allgather", "twoway"}) {
    SCOPED_TRACE(route);
    const Plan plan = plan_with({.codec = "topk:ratio=0.05", .feedback = "ef", .route = route});
    Engine engine(world(), plan);
    size_t gradient_bytes = 0;
    for (const auto& t : plan.tensors) gradient_bytes += 4 * t.elements;
    const auto order = backward_order(plan.tensors.size());
    auto g = gradients(plan.tensors, world()->rank(), 0);
    for (size_t t : order) engine.ready(t, g[t]);
    engine.synchronize();
    const size_t after_first = engine.memory_bytes();
    for (int s = 1; s < 100; ++s) {
      for (size_t t : order) engine.ready(t, g[t]);
      engine.synchronize();
    }
    EXPECT_EQ(engine.memory_bytes(), after_first);
    EXPECT_LE(engine.memory_bytes(), 9 * gradient_bytes / 2);
  }
}

TEST(Engine, ZeroTensorsAndEmptyBuckets) {
  Engine engine(world(), make_default_plan({{"a", 0}, {"b", 0}}));
  std::vector<float> none;
  for (int s = 0; s < 3; ++s) {
    engine.ready("a", none);
    engine.ready("b", none);
    engine.synchronize();
  }
  EXPECT_EQ(engine.step(), 3u);
}

}  // namespace
}  // namespace gradcomp
