// What the engine's tests share: the small plans they run, one step of the single-rank plan,
// the multi-rank model and its reproducible gradients, and the bit-identity check across ranks
// (the last two for the *_mptest files, which link the multi-process main).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "gradcomp/engine.h"
#include "gradcomp/plan.h"
#include "support/codec_testing.h"
#include "support/mp_test.h"

namespace gradcomp::engine_testing {

// Two tensors, w (1,000 elements, compressed with `option`) and b (10, uncompressed).
inline Plan small_plan(const Option& option = {}) {
  DefaultPlanSettings settings;
  settings.min_compress_elements = 100;
  settings.compressed = option;
  return make_default_plan({{"w", 1000}, {"b", 10}}, settings);
}

// One step of a small_plan engine over w and b (b all ones) at loss scale `scale`; returns w's
// mean.
inline std::vector<float> step(Engine& engine, std::vector<float> w, double scale = 1) {
  std::vector<float> b(10, 1.0f);
  engine.set_loss_scale(scale);
  engine.ready("w", w);
  engine.ready("b", b);
  engine.synchronize();
  return w;
}

// A small model: conv-like weights with biases between them (and an empty tensor), in backward
// order.
inline std::vector<TensorInfo> model_tensors() {
  return {{"fc.bias", 10},        {"fc.weight", 40000},  {"conv3.bias", 64},
          {"conv3.weight", 36864}, {"bn2.weight", 64},    {"conv2.weight", 18432},
          {"empty", 0},           {"conv1.weight", 1728}, {"conv1.bias", 64}};
}

// model_tensors() in several buckets (100 kB), those of 1,000 elements or more with `option`.
inline Plan plan_with(const Option& option) {
  DefaultPlanSettings settings;
  settings.bucket_bytes = 100'000;
  settings.min_compress_elements = 1000;
  settings.compressed = option;
  return make_default_plan(model_tensors(), settings);
}

// model_tensors() with fc.weight cut into 3 slices, conv3.weight into 2 and conv2.weight into
// 4, the slices of one tensor in different buckets (pieces: fc.bias 0, fc.weight#0-2 1-3,
// conv3.bias 4, conv3.weight#0-1 5-6, bn2.weight 7, conv2.weight#0-3 8-11, empty 12,
// conv1.weight 13, conv1.bias 14); the buckets of large pieces with `option`.
inline Plan sliced_plan_with(const Option& option) {
  Plan plan;
  plan.tensors = model_tensors();
  plan.tensors[1].slices = 3;
  plan.tensors[3].slices = 2;
  plan.tensors[5].slices = 4;
  plan.buckets = {{{1}, option},         {{2, 5}, option},          {{0, 4, 7}, Option{}},
                  {{3, 8, 9}, option},   {{6, 10, 11, 13}, option}, {{12, 14}, Option{}}};
  return plan;
}

// Rank r's gradient of tensor t at step s: reproducible on every rank, so each rank can compute
// every rank's (and the mean).
inline std::vector<float> gradient(const std::vector<TensorInfo>& tensors, size_t t, int rank,
                                   uint64_t step) {
  return testing::gradient(tensors[t].elements, 1000 * step + 17 * t + rank + 1);
}

// Every rank holds the same bytes in `g`; `what` says where, when one differs.
inline void expect_identical_across_ranks(const std::vector<std::vector<float>>& g,
                                          const std::string& what = "") {
  std::vector<std::byte> mine;
  for (const auto& v : g) {
    const auto b = std::as_bytes(std::span(v));
    mine.insert(mine.end(), b.begin(), b.end());
  }
  const auto all = testing::gather_bytes(mine);
  for (int r = 0; r < testing::world()->size(); ++r) {
    EXPECT_TRUE(std::equal(mine.begin(), mine.end(), all.begin() + r * mine.size()))
        << what << ": rank " << testing::world()->rank() << " differs from rank " << r;
  }
}

}  // namespace gradcomp::engine_testing
