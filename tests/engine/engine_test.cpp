// The engine in one process (a real Gloo transport of one rank): W = 1 gives back the
// gradient itself, bad input is a clear Error, and a broken engine stays broken.
#include "gradcomp/engine.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <thread>

#include "engine_testing.h"
#include "gradcomp/error.h"
#include "gradcomp/frame.h"
#include "support/codec_testing.h"
#include "support/sanitizers.h"
#include "support/single_rank.h"

namespace gradcomp {
namespace {

using testing::error_text;

std::shared_ptr<Transport> single_rank() { return testing::single_rank_transport(); }

using engine_testing::small_plan;

long resident_kb() {  // this process's resident memory
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

// The sanitizers keep freed blocks resident (ASan's quarantine) or add shadow memory as memory
// is touched (TSan), so resident memory says something only in the regular build, which runs
// the tests that measure it too.
constexpr bool kResidentMemoryMeans = !testing::kAddressSanitizer && !testing::kThreadSanitizer;

TEST(EngineSingleRank, MeanOfOneRankIsTheGradient) {
  Engine engine(single_rank(), small_plan());
  auto w = testing::gradient(1000, 1);
  auto b = testing::gradient(10, 2);
  const auto w0 = w, b0 = b;
  engine.ready("b", b);
  engine.ready("w", w);
  engine.synchronize();
  EXPECT_EQ(w, w0);
  EXPECT_EQ(b, b0);
  EXPECT_EQ(engine.step(), 1u);
}

TEST(EngineSingleRank, CompressedRoutesWorkWithOneRank) {
  for (const char* route : {"allgather", "twoway"}) {
    Engine engine(single_rank(), small_plan({.codec = "topk:ratio=0.1", .feedback = "ef",
                                             .route = route}));
    auto w = testing::gradient(1000, 1);
    auto b = testing::gradient(10, 2);
    engine.ready("w", w);
    engine.ready("b", b);
    engine.synchronize();
    const size_t kept = static_cast<size_t>(std::count_if(w.begin(), w.end(),
                                                          [](float x) { return x != 0; }));
    EXPECT_EQ(kept, 100u) << route;
  }
}

// Option::start_step: the first steps give back the gradient itself (the exact mean of one
// rank) and leave the feedback unsized; from start_step on the bucket is compressed.
TEST(EngineSingleRank, WarmupIsUncompressedUntilStartStep) {
  const Plan plan = small_plan({.codec = "topk:ratio=0.1", .feedback = "ef",
                                .route = "allgather", .start_step = 2});
  Engine engine(single_rank(), plan);
  const size_t fresh_memory = engine.memory_bytes();
  const size_t fresh_state = engine.save_state().size();
  for (uint64_t step = 0; step < 4; ++step) {
    auto w = testing::gradient(1000, 1 + step);
    auto b = testing::gradient(10, 2);
    const auto w0 = w;
    engine.ready("w", w);
    engine.ready("b", b);
    engine.synchronize();
    const auto kept = std::count_if(w.begin(), w.end(), [](float x) { return x != 0; });
    if (step < 2) {
      EXPECT_EQ(w, w0) << "step " << step;
      EXPECT_EQ(engine.memory_bytes(), fresh_memory) << "step " << step;
      EXPECT_EQ(engine.save_state().size(), fresh_state) << "step " << step;
    } else {
      EXPECT_EQ(kept, 100) << "step " << step;
      EXPECT_GT(engine.memory_bytes(), fresh_memory) << "step " << step;
      EXPECT_GT(engine.save_state().size(), fresh_state) << "step " << step;
    }
  }
}

TEST(EngineSingleRank, BadInputIsAClearError) {
  Engine engine(single_rank(), small_plan());
  std::vector<float> w(1000), wrong(999), b(10);
  EXPECT_NE(error_text([&] { engine.ready(7, w); }).find("tensor 7 is not registered"),
            std::string::npos);
  EXPECT_NE(error_text([&] { engine.ready("nope", w); }).find("no registered tensor is named"),
            std::string::npos);
  EXPECT_NE(error_text([&] { engine.ready("w", wrong); }).find("has 999 elements"),
            std::string::npos);
  engine.ready("w", w);
  EXPECT_NE(error_text([&] { engine.ready("w", w); }).find("handed over twice"),
            std::string::npos);
  EXPECT_NE(error_text([&] { engine.set_learning_rate(-1); }).find("not a learning rate"),
            std::string::npos);
  // A missing tensor stops the step: the engine is broken from then on.
  EXPECT_NE(error_text([&] { engine.synchronize(); }).find("not handed over"), std::string::npos);
  EXPECT_NE(error_text([&] { engine.ready("b", b); }).find("not handed over"), std::string::npos);
}

TEST(EngineSingleRank, RejectsBadPlansAndOptions) {
  Plan plan = small_plan();
  plan.buckets.pop_back();  // a tensor in no bucket
  EXPECT_NE(error_text([&] { Engine e(single_rank(), plan); }), "no error");
  EXPECT_NE(error_text([&] { Engine e(nullptr, small_plan()); }).find("transport is null"),
            std::string::npos);
  EngineOptions no_threads;
  no_threads.codec_threads = 0;
  EXPECT_NE(error_text([&] { Engine e(single_rank(), small_plan(), no_threads); }).find("codec_threads"),
            std::string::npos);
  EXPECT_NE(error_text([&] {
              Engine e(single_rank(), small_plan(), EngineOptions{.timeline = "/nonexistent/x.json"});
            }).find("/nonexistent"),
            std::string::npos);
  for (const int streams : {-1, 17}) {
    const std::string text = error_text(
        [&] { Engine e(single_rank(), small_plan(), EngineOptions{.streams = streams}); });
    EXPECT_NE(text.find(fmt::format("streams is {}; it must be from 1 to 16", streams)),
              std::string::npos)
        << text;
  }
  // GRADCOMP_STREAMS when streams is 0: a bad value is an error naming it, a good one is used.
  for (const char* bad : {"0", "two", "2x", "99"}) {
    setenv("GRADCOMP_STREAMS", bad, 1);
    const std::string text = error_text([&] { Engine e(single_rank(), small_plan()); });
    EXPECT_NE(
        text.find(fmt::format("GRADCOMP_STREAMS='{}' must be a whole number from 1 to 16", bad)),
        std::string::npos)
        << text;
  }
  setenv("GRADCOMP_STREAMS", "3", 1);
  EXPECT_EQ(error_text([&] { Engine e(single_rank(), small_plan()); }), "no error");
  unsetenv("GRADCOMP_STREAMS");
}

TEST(EngineSingleRank, StateOfAStepInFlightIsRefused) {
  Engine engine(single_rank(), small_plan({.codec = "topk:ratio=0.1", .feedback = "ef",
                                           .route = "allgather"}));
  std::vector<float> w(1000, 1.0f), b(10, 1.0f);
  engine.ready("w", w);
  EXPECT_NE(error_text([&] { engine.save_state(); }).find("in flight"), std::string::npos);
  engine.ready("b", b);
  engine.synchronize();
  const auto state = engine.save_state();
  auto truncated = state;
  truncated.resize(truncated.size() / 2);
  EXPECT_NE(error_text([&] { engine.load_state(truncated); }).find("truncated"),
            std::string::npos);
  engine.load_state(state);
  EXPECT_EQ(engine.step(), 1u);
}

// An idle engine sleeps on condition variables: between steps its threads (and the
// transport's) use no CPU. Measured as process CPU time, not wall time, over half a second.
TEST(EngineSingleRank, AnIdleEngineUsesNoCpu) {
  Engine engine(single_rank(), small_plan({.codec = "topk:ratio=0.1", .feedback = "ef",
                                           .route = "allgather"}));
  std::vector<float> w(1000, 1.0f), b(10, 1.0f);
  engine.ready("w", w);
  engine.ready("b", b);
  engine.synchronize();
  auto cpu_seconds = [] {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
  };
  const double before = cpu_seconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double used = cpu_seconds() - before;
  EXPECT_LT(used, 0.02) << "an idle engine used " << used << " s of CPU in 0.5 s";
}

// Resident memory after 10,000 steps equals that after the first hundred: the engine's buffers
// are sized once (and memory_bytes(), feedback state included, stays within 3x the gradients).
TEST(EngineSingleRank, MemoryDoesNotGrowOver10000Steps) {
  Engine engine(single_rank(), small_plan({.codec = "topk:ratio=0.1", .feedback = "ef",
                                           .route = "allgather"}));
  std::vector<float> w = testing::gradient(1000, 1), b = testing::gradient(10, 2);
  long after_warmup = 0;
  for (int step = 0; step < 10'000; ++step) {
    engine.ready("w", w);
    engine.ready("b", b);
    engine.synchronize();
    if (step == 100) after_warmup = resident_kb();
  }
  if (kResidentMemoryMeans) {
    EXPECT_LE(resident_kb() - after_warmup, 256) << "resident memory grew (kB)";
  }
  EXPECT_LE(engine.memory_bytes(), 3 * 4 * (1000 + 10));
  EXPECT_EQ(engine.step(), 10'000u);
}

// A plan change lets the old plan's memory go, back to the system: 256 buckets of 64 kB, each
// with a 64 kB error-feedback memory, replaced by the same buckets without memory.
TEST(EngineSingleRank, APlanChangeGivesTheOldPlansMemoryBack) {
  constexpr size_t kTensors = 256, kElements = 16384;  // 16 MB of 64 kB buckets
  std::vector<TensorInfo> tensors;
  for (size_t t = 0; t < kTensors; ++t) tensors.push_back({fmt::format("t{}", t), kElements});
  DefaultPlanSettings settings;
  settings.bucket_bytes = 4 * kElements;
  settings.min_compress_elements = kElements;
  settings.compressed = {.codec = "fp16"};
  const Plan without_memory = make_default_plan(tensors, settings);
  settings.compressed = {.codec = "topk:ratio=0.01", .feedback = "ef", .route = "allgather"};
  const Plan with_memory = make_default_plan(tensors, settings);
  Engine engine(single_rank(), without_memory);
  std::vector<std::vector<float>> grads(kTensors);
  auto step = [&] {
    for (size_t t = 0; t < kTensors; ++t) {
      grads[t] = testing::gradient(kElements, t);
      engine.ready(t, grads[t]);
    }
    engine.synchronize();
  };
  engine.set_plan(with_memory);
  step();
  ASSERT_GE(engine.memory_bytes(), 4 * kTensors * kElements);  // the feedback's memories
  const long before_change = resident_kb();
  engine.set_plan(without_memory);
  step();
  const long freed = before_change - resident_kb();
  if (kResidentMemoryMeans) {
    EXPECT_GE(freed, 4 * long{kTensors * kElements} / 1024 / 2)
        << "kB given back of the 16,384 kB of memories";
  }
}

TEST(EngineSingleRank, LossScaleMustBeFiniteAndPositive) {
  Engine engine(single_rank(), small_plan());
  for (const double bad : {0.0, -2.0, std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_NE(error_text([&] { engine.set_loss_scale(bad); }).find("is not a loss scale"),
              std::string::npos)
        << bad;
  }
  engine.set_loss_scale(65536);  // a good one is taken
}

constexpr auto* engine_step = &engine_testing::step;  // one step over w and b; w's mean

// Through the engine: a NaN step leaves the state of every bucket as it was (the step counter
// still advances), and a scaled run gives the unscaled run's means times the scale.
TEST(EngineSingleRank, ANonFiniteStepIsRolledBackAndTheLossScaleIsCorrected) {
  const Option option{.codec = "randomk:ratio=0.1", .feedback = "ef", .route = "allgather"};
  Engine scaled(single_rank(), small_plan(option));
  Engine plain(single_rank(), small_plan(option));
  const double scales[] = {1024, 1024, 512, 4096};
  for (size_t t = 0; t < std::size(scales); ++t) {
    auto g = testing::gradient(1000, 70 + t);
    auto gs = g;
    for (float& x : gs) x = static_cast<float>(x * scales[t]);
    const auto a = engine_step(scaled, gs, scales[t]);
    const auto b = engine_step(plain, g, 1);
    for (size_t i = 0; i < g.size(); ++i) {
      ASSERT_NEAR(a[i] / scales[t], b[i], 1e-5) << "step " << t << " element " << i;
    }
  }
  const auto before = scaled.save_state();
  auto bad = testing::gradient(1000, 80);
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  const auto out = engine_step(scaled, bad, 4096);
  EXPECT_TRUE(std::isnan(out[5]));
  const auto after = scaled.save_state();
  EXPECT_EQ(scaled.step(), 5u);
  // Same states but for the step counter (bytes 32..39 of the engine state, state_file.cpp)
  // and the checksum that ends it.
  ASSERT_EQ(after.size(), before.size());
  EXPECT_TRUE(std::equal(after.begin(), after.begin() + 32, before.begin()));
  EXPECT_TRUE(std::equal(after.begin() + 40, after.end() - 4, before.begin() + 40));
}

// The step is kept or taken back whole: an overflow in an uncompressed bucket (which keeps no
// state) also takes back the error feedback of the compressed one, since a loss scaler skips
// the whole step.
TEST(EngineSingleRank, AnOverflowInAnyBucketTakesTheWholeStepBack) {
  Engine engine(single_rank(),
                small_plan({.codec = "topk:ratio=0.1", .feedback = "ef", .route = "allgather"}));
  engine_step(engine, testing::gradient(1000, 90), 1);
  EXPECT_TRUE(engine.last_step().finite);
  const auto before = engine.save_state();
  auto w = testing::gradient(1000, 91);
  std::vector<float> b(10, 1.0f);
  b[3] = std::numeric_limits<float>::infinity();
  engine.ready("w", w);
  engine.ready("b", b);
  engine.synchronize();
  EXPECT_FALSE(engine.last_step().finite);
  for (float x : w) ASSERT_TRUE(std::isfinite(x));  // w's own bucket was finite
  const auto after = engine.save_state();
  ASSERT_EQ(after.size(), before.size());
  EXPECT_TRUE(std::equal(after.begin() + 40, after.end() - 4, before.begin() + 40))
      << "the compressed bucket kept a step the optimizer skips";
  engine_step(engine, testing::gradient(1000, 92), 1);
  EXPECT_TRUE(engine.last_step().finite);
}

// A plan whose routes keep no state still reports a non-finite mean: the front ends skip the
// step on it (DistributedOptimizer under "none", OneBitAdam's exact steps).
TEST(EngineSingleRank, AStatelessPlanReportsANonFiniteMeanToo) {
  for (const Option& option : {Option{}, Option{.codec = "fp16"}}) {
    Engine engine(single_rank(), small_plan(option));
    engine_step(engine, testing::gradient(1000, 93), 1);
    EXPECT_TRUE(engine.last_step().finite) << option.codec;
    auto w = testing::gradient(1000, 94);
    w[7] = std::numeric_limits<float>::quiet_NaN();
    engine_step(engine, w, 1);
    EXPECT_FALSE(engine.last_step().finite) << option.codec;
    engine_step(engine, testing::gradient(1000, 95), 1);
    EXPECT_TRUE(engine.last_step().finite) << option.codec;
  }
}

// A flipped byte anywhere in a saved state (a residual's, say) is an error, and the engine keeps
// its own state: a checkpoint that changed on disk never resumes silently differently.
TEST(EngineSingleRank, AStateWithAFlippedByteIsRefused) {
  Engine engine(single_rank(), small_plan({.codec = "topk:ratio=0.1", .feedback = "ef",
                                           .route = "allgather"}));
  engine_step(engine, testing::gradient(1000, 3), 1);
  const auto state = engine.save_state();
  for (size_t at : {size_t{60}, state.size() / 2, state.size() - 9}) {
    auto flipped = state;
    flipped[at] ^= std::byte{0x10};
    const std::string message = error_text([&] { engine.load_state(flipped); });
    EXPECT_NE(message.find("checksum"), std::string::npos) << "byte " << at << ": " << message;
  }
  EXPECT_EQ(engine.save_state(), state);
}

// Found by engine_state_fuzz: a state whose codec part loads but whose feedback part is refused
// left the refusing bucket's codec with the loaded state (signum's momentum): the engine must
// keep all of its own state when it refuses one.
TEST(EngineSingleRank, ARefusedFeedbackStateLeavesTheCodecAlone) {
  const Plan plan = small_plan({.codec = "signum", .feedback = "dgc", .route = "allgather"});
  Engine stepped(single_rank(), plan);
  engine_step(stepped, testing::gradient(1000, 3), 1);
  auto state = stepped.save_state();
  // Break the feedback's magic ("GCFS"), then seal the checksum again so the parts are read.
  const std::string magic = "GCFS";
  const auto at = std::search(state.begin(), state.end(), magic.begin(), magic.end(),
                              [](std::byte a, char b) { return a == std::byte(b); });
  ASSERT_NE(at, state.end());
  *at = std::byte{'X'};
  const uint32_t crc = crc32(std::span(state).first(state.size() - 4));
  std::memcpy(state.data() + state.size() - 4, &crc, 4);

  Engine fresh(single_rank(), plan);
  const auto before = fresh.save_state();
  EXPECT_NE(error_text([&] { fresh.load_state(state); }), "no error");
  EXPECT_EQ(fresh.save_state(), before);
}

// feedback_health: per bucket, the norm of what error feedback holds (with one rank, top-k keeps
// g - sent) and of the last measured mean (sent); a step not measured leaves the mean's norm of
// the last one that was.
TEST(EngineSingleRank, FeedbackHealthIsTheResidualAndTheMeasuredMean) {
  Engine engine(single_rank(), small_plan({.codec = "topk:ratio=0.1", .feedback = "ef",
                                           .route = "allgather"}));
  EXPECT_EQ(engine.feedback_health()[0].mean_norm, 0.0);  // nothing measured yet
  const auto g = testing::gradient(1000, 11);
  engine.measure_mean_norms();
  const auto sent = engine_step(engine, g, 1);
  double residual = 0, mean = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    residual += double{g[i] - sent[i]} * (g[i] - sent[i]);
    mean += double{sent[i]} * sent[i];
  }
  const auto health = engine.feedback_health();
  ASSERT_EQ(health.size(), engine.plan().buckets.size());
  const size_t w = engine.plan().buckets[0].tensors == std::vector<size_t>{0} ? 0 : 1;
  EXPECT_NEAR(health[w].residual_norm, std::sqrt(residual), 1e-4 * std::sqrt(residual));
  EXPECT_NEAR(health[w].mean_norm, std::sqrt(mean), 1e-4 * std::sqrt(mean));
  EXPECT_EQ(health[1 - w].residual_norm, 0.0);  // b's bucket keeps nothing
  engine_step(engine, testing::gradient(1000, 12), 1);  // not measured
  EXPECT_EQ(engine.feedback_health()[w].mean_norm, health[w].mean_norm);
}

}  // namespace
}  // namespace gradcomp
