// Engine::set_plan across real processes (mpirun and the Gloo launcher, W = 2 and 4): over a run
// that switches plans every two steps, through every route with error feedback, what was
// applied plus what is still held equals the sum of the mean gradients; every rank ends every
// step with the same bits; ranks that change to different plans get an error and go on with
// the plan they had.
#include <gtest/gtest.h>

#include <cmath>

#include "gradcomp/engine.h"
#include "gradcomp/error.h"
#include "support/codec_testing.h"
#include "support/mp_test.h"

namespace gradcomp {
namespace {

using testing::gather_bytes;
using testing::world;

std::vector<TensorInfo> model_tensors() {
  return {{"fc.bias", 10},         {"fc.weight", 40000},  {"conv3.bias", 64},
          {"conv3.weight", 36864}, {"bn2.weight", 64},    {"conv2.weight", 18432},
          {"conv1.weight", 1728},  {"conv1.bias", 64}};
}

Plan plan_with(const Option& option) {
  DefaultPlanSettings settings;
  settings.bucket_bytes = 100'000;  // several buckets
  settings.min_compress_elements = 1000;
  settings.compressed = option;
  return make_default_plan(model_tensors(), settings);
}

// Rank r's gradient of tensor t at step s: every rank can compute every rank's.
std::vector<float> gradient(size_t t, int rank, uint64_t step) {
  return testing::gradient(model_tensors()[t].elements, 1000 * step + 17 * t + rank + 1);
}

void expect_identical_across_ranks(const std::vector<std::vector<float>>& got, uint64_t step) {
  std::vector<std::byte> mine;
  for (const auto& v : got) {
    const auto b = std::as_bytes(std::span(v));
    mine.insert(mine.end(), b.begin(), b.end());
  }
  const auto all = gather_bytes(mine);
  for (int r = 0; r < world()->size(); ++r) {
    ASSERT_TRUE(std::equal(mine.begin(), mine.end(), all.begin() + r * mine.size()))
        << "step " << step << ": rank " << world()->rank() << " differs from rank " << r;
  }
}

// Each option for two steps, then the uncompressed plan, which keeps nothing: at the end every
// residual has been delivered. Error feedback everywhere (worker and two-way servers), so the
// means add up to the gradients' (momenta would not: DGC and nesterov are left out).
TEST(PlanChange, NothingIsLostOverSwitchesThroughEveryRoute) {
  const std::vector<Option> options = {
      {.codec = "topk:ratio=0.05", .feedback = "ef", .route = "allgather"},
      {.codec = "powersgd", .feedback = "ef"},
      {.codec = "efsignsgd", .feedback = "ef", .route = "twoway"},
      {.codec = "topk:ratio=0.1", .feedback = "ef", .route = "hierarchical:inner=twoway"},
      // Over allgather: summed by the allreduce in float16, the sum would round beyond what
      // error feedback sees (each rank's own rounding).
      {.codec = "fp16", .feedback = "ef", .route = "allgather"},
      {.codec = "randomk:ratio=0.1", .feedback = "ef", .route = "hierarchical:inner=allreduce"},
      {}};
  const auto tensors = model_tensors();
  const int W = world()->size();
  Engine engine(world(), plan_with(options[0]), EngineOptions{.seed = 5, .local_size = 2});
  std::vector<std::vector<double>> applied, expected;
  for (const auto& t : tensors) {
    applied.emplace_back(t.elements, 0.0);
    expected.emplace_back(t.elements, 0.0);
  }
  uint64_t step = 0;
  for (size_t o = 0; o < options.size(); ++o) {
    if (o > 0) engine.set_plan(plan_with(options[o]));
    for (int repeat = 0; repeat < 2; ++repeat, ++step) {
      std::vector<std::vector<float>> got;
      for (size_t t = 0; t < tensors.size(); ++t) got.push_back(gradient(t, world()->rank(), step));
      for (size_t t = tensors.size(); t-- > 0;) engine.ready(t, got[t]);
      engine.synchronize();
      expect_identical_across_ranks(got, step);
      for (size_t t = 0; t < tensors.size(); ++t) {
        for (int r = 0; r < W; ++r) {
          const auto g = gradient(t, r, step);
          for (size_t i = 0; i < g.size(); ++i) expected[t][i] += double{g[i]} / W;
        }
        for (size_t i = 0; i < got[t].size(); ++i) applied[t][i] += got[t][i];
      }
    }
  }
  double worst = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (size_t i = 0; i < applied[t].size(); ++i) {
      worst = std::max(worst, std::fabs(applied[t][i] - expected[t][i]));
      ASSERT_NEAR(applied[t][i], expected[t][i], 1e-5) << tensors[t].name << "[" << i << "]";
    }
  }
  EXPECT_GT(worst, 0.0);  // float sums: equal within rounding, not by construction
  EXPECT_EQ(engine.step(), 2 * options.size());
  // Delivered, the carried memory is let go: as much memory as an engine built with this plan.
  Engine fresh(world(), plan_with({}), EngineOptions{.seed = 5});
  EXPECT_EQ(engine.memory_bytes(), fresh.memory_bytes());
}

// A plan change is a collective check, as construction is: ranks that change to different plans
// get a CommError naming the difference, and each goes on with the plan it had.
TEST(PlanChange, DifferentPlansOnTheRanksAreAnErrorAndChangeNothing) {
  const Option topk{.codec = "topk:ratio=0.05", .feedback = "ef", .route = "allgather"};
  Engine engine(world(), plan_with(topk), EngineOptions{.seed = 5});
  const bool odd = world()->rank() % 2 == 1;
  std::string text = "no error";
  try {
    engine.set_plan(plan_with(odd ? Option{.codec = "fp16"} : Option{}));
  } catch (const CommError& e) {
    text = e.what();
  }
  EXPECT_NE(text.find("different plans"), std::string::npos) << text;
  EXPECT_EQ(engine.plan().hash(), plan_with(topk).hash());
  std::vector<std::vector<float>> got;
  for (size_t t = 0; t < model_tensors().size(); ++t) got.push_back(gradient(t, world()->rank(), 0));
  for (size_t t = 0; t < got.size(); ++t) engine.ready(t, got[t]);
  engine.synchronize();
  expect_identical_across_ranks(got, 0);
}

}  // namespace
}  // namespace gradcomp
