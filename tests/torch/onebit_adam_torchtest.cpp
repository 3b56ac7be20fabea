// gradcomp::torch::OneBitAdam across real processes (mpirun and the Gloo launcher): without
// compression it is the plain update (AdamW's, then 0/1 Adam's clamped one with v updated on
// exact steps only); under 1-bit two-way compression the ranks stay bit-identical under both
// variance policies (and "freeze" fills the variances of coordinates the warm-up never saw);
// a checkpoint after an exact or a compressed step resumes bit-exactly; a non-finite average
// is skipped on every rank, on either kind of step; each kind of step has its own trace; the
// doubling schedule; bad input, foreign states, wrapping in DistributedOptimizer and changing
// requires_grad after construction are clear errors.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "gradcomp/error.h"
#include "gradcomp/torch/distributed_optimizer.h"
#include "gradcomp/torch/layerwise_optimizers.h"
#include "gradcomp/torch/onebit_adam.h"
#include "optimizer_testing.h"
#include "support/codec_testing.h"
#include "support/mp_test.h"

namespace gradcomp::torch {
namespace {

using testing::contains;
using testing::error_text;
using testing::gather_bytes;
using testing::world;
using namespace optimizer_testing;  // NOLINT: the shared network, train, saved, load

const OneBitAdamParamState& state_of(const OneBitAdam& opt, const at::Tensor& p) {
  return optimizer_testing::state_of<OneBitAdamParamState>(opt, p);
}

// Every tensor compressed, 1-bit codes with both sides' error feedback.
OneBitAdamOptions compressed(const std::string& variance) {
  OneBitAdamOptions o(0.01);
  o.weight_decay(0.01).variance(variance).min_compress_elements(1).seed(3);
  if (variance == "freeze") {
    o.warmup_steps(3);
  } else {
    o.variance_interval(1);  // exact steps 0, 1, 3, 7, ...
  }
  return o;
}

// Every rank the same data and no compression: the update is the plain one, as
// tests/python/test_onebit_adam.py's test_doubling_updates_the_variance_on_exact_steps_only.
TEST(OneBitAdam, WithoutCompressionItIsThePlainUpdate) {
  Parameters ours = make_parameters();
  Parameters reference = copy_of(ours);
  OneBitAdam opt(ours, world(),
                 OneBitAdamOptions(0.01)
                     .betas({0.9, 0.95})
                     .eps(1e-8)
                     .weight_decay(0.05)
                     .variance("doubling")
                     .variance_interval(2)
                     .compression("none"));
  std::vector<std::pair<at::Tensor, at::Tensor>> moments;
  for (const auto& item : reference) {
    moments.emplace_back(at::zeros_like(item.value()), at::zeros_like(item.value()));
  }
  int updates = 0;
  std::vector<bool> kinds;
  for (int step = 0; step < 12; ++step) {
    kinds.push_back(opt.exact());
    updates += kinds.back() ? 1 : 0;
    opt.zero_grad();
    loss_of(ours, 0, step).backward();
    for (auto& item : reference) item.value().mutable_grad() = at::Tensor();
    loss_of(reference, 0, step).backward();
    opt.step();
    at::NoGradGuard no_grad;
    size_t i = 0;
    for (auto& item : reference) {
      at::Tensor p = item.value();
      auto& [m, v] = moments[i++];
      m.mul_(0.9).add_(p.grad(), 0.1);
      if (kinds.back()) v.mul_(0.95).addcmul_(p.grad(), p.grad(), 0.05);
      const at::Tensor m_hat = m / (1 - std::pow(0.9, step + 1));
      const at::Tensor v_hat = v / (1 - std::pow(0.95, updates));
      at::Tensor direction = m_hat / (v_hat.sqrt() + 1e-8);
      // AdamW's until a step is not exact, then clamped to max(1, (1 - b1) / sqrt(1 - b2)) = 1
      if (updates < step + 1) direction.clamp_(-1.0, 1.0);
      p.sub_(0.01 * (direction + 0.05 * p));
    }
    for (const auto& item : ours) {
      EXPECT_TRUE(at::allclose(item.value(), reference[item.key()], 1e-5, 1e-6))
          << item.key() << " at step " << step << ": largest difference "
          << (item.value() - reference[item.key()]).abs().max().item<float>();
    }
  }
  // every step for 2 exact steps, then every 2nd for 2, every 4th for 2, ...
  EXPECT_EQ(kinds, (std::vector<bool>{true, true, true, false, true, false, true, false, false,
                                      false, true, false}));
  const auto& state = state_of(opt, ours["w1"]);
  EXPECT_FALSE(opt.frozen());
  EXPECT_EQ(state.step(), 12);
  EXPECT_EQ(state.variance_updates(), 6);
  EXPECT_EQ(updates, 6);
}

// Each rank its own data, 1-bit two-way compression: every rank holds the same parameters
// after every step, under both policies; compressed steps send less than fp32; under "freeze"
// the rows the warm-up never saw take the mean of the table's other variances.
TEST(OneBitAdam, RanksAreBitIdenticalUnderOneBitCompression) {
  for (const std::string variance : {"doubling", "freeze"}) {
    Parameters p = make_parameters();
    OneBitAdam opt(p, world(), compressed(variance));
    EXPECT_EQ(opt.plan().buckets.front().option.codec, "onebit:block=256");
    size_t exact_bytes = 0;  // what an exact step sent (fp32)
    for (int step = 0; step < 8; ++step) {
      const bool exact = opt.exact();
      train(p, opt, step, 1, /*rows_from=*/5);
      expect_identical_across_ranks(p, variance + " step " + std::to_string(step));
      if (exact) {
        exact_bytes = opt.last_step().bytes_sent;
      } else {
        // 1-bit codes: a fraction of fp32's bytes even with these small tensors' headers
        EXPECT_LT(opt.last_step().bytes_sent, exact_bytes / 3) << variance << " step " << step;
      }
    }
    EXPECT_EQ(opt.frozen(), variance == "freeze");
    const at::Tensor v = state_of(opt, p["rows"]).exp_avg_sq();
    if (variance == "freeze") {
      EXPECT_GT(v.min().item<float>(), 0.0f) << "the unseen rows' variances were not filled";
      EXPECT_TRUE(state_of(opt, p["rows"]).filled());
      EXPECT_EQ(state_of(opt, p["rows"]).variance_updates(), 3);
    } else {
      EXPECT_EQ(state_of(opt, p["rows"]).variance_updates(), 4);  // steps 0, 1, 3, 7
    }
  }
}

// Saved after step 2 (the last one exact) and after step 5 (compressed) of 8, loaded into a new
// optimizer over the saved parameters: the continuation is bit-exact.
TEST(OneBitAdam, CheckpointsResumeBitExactly) {
  for (const std::string variance : {"doubling", "freeze"}) {
    Parameters p = make_parameters();
    OneBitAdam opt(p, world(), compressed(variance));
    std::vector<std::pair<int, std::pair<std::string, Parameters>>> checkpoints;
    std::vector<bool> kinds;
    for (int step = 0; step < 8; ++step) {
      kinds.push_back(opt.exact());
      train(p, opt, step, 1);
      if (step == 1 || step == 4) checkpoints.push_back({step + 1, {saved(opt), copy_of(p)}});
    }
    EXPECT_TRUE(kinds[1]) << variance;   // the first checkpoint follows an exact step,
    EXPECT_FALSE(kinds[4]) << variance;  // the second a compressed one
    for (auto& [taken, checkpoint] : checkpoints) {
      Parameters resumed = copy_of(checkpoint.second);
      OneBitAdam again(resumed, world(), compressed(variance));
      load(again, checkpoint.first);
      EXPECT_EQ(again.steps(), taken);
      train(resumed, again, taken, 8 - taken);
      EXPECT_EQ(bytes_of(resumed), bytes_of(p)) << variance << ", saved after step " << taken;
    }
    // Without the state (moments, clock, error feedback) the continuation differs.
    Parameters unloaded = copy_of(checkpoints.back().second.second);
    OneBitAdam fresh(unloaded, world(), compressed(variance));
    train(unloaded, fresh, 5, 3);
    EXPECT_NE(bytes_of(unloaded), bytes_of(p)) << variance;
  }
}

// Rank 0's `mine`, on every rank (as one file rank 0 wrote would be read by all).
std::string from_rank0(const std::string& mine) {
  uint64_t size = mine.size();
  const auto sizes = gather_bytes(std::as_bytes(std::span(&size, 1)));
  uint64_t longest = 0, first = 0;
  for (int r = 0; r < world()->size(); ++r) {
    uint64_t s_r = 0;
    std::memcpy(&s_r, sizes.data() + r * sizeof s_r, sizeof s_r);
    longest = std::max(longest, s_r);
    if (r == 0) first = s_r;
  }
  std::string padded = mine;
  padded.resize(longest);
  const auto all = gather_bytes(std::as_bytes(std::span(padded.data(), padded.size())));
  return std::string(reinterpret_cast<const char*>(all.data()), first);
}

// save_all_ranks() gathers every rank's error feedback, so the archive rank 0 writes alone
// resumes every rank bit-exactly (each takes its own part; rank 0's own save() is refused on
// the other ranks). A world of another size (the ranks split into
// groups of one) is refused, changing nothing.
TEST(OneBitAdam, ACheckpointOfEveryRankResumesEachRankFromOneFile) {
  Parameters p = make_parameters();
  OneBitAdam opt(p, world(), compressed("freeze"));
  train(p, opt, 0, 5);
  ASSERT_FALSE(opt.exact());  // error feedback holds something
  ::torch::serialize::OutputArchive archive;
  opt.save_all_ranks(archive);
  std::ostringstream out;
  archive.save_to(out);
  const std::string file = from_rank0(out.str());
  const std::string rank0_only = from_rank0(saved(opt));
  const Parameters saved_at = copy_of(p);
  train(p, opt, 5, 3);
  Parameters resumed = copy_of(saved_at);
  OneBitAdam again(resumed, world(), compressed("freeze"));
  load(again, file);
  train(resumed, again, 5, 3);
  EXPECT_EQ(bytes_of(resumed), bytes_of(p));
  Parameters wrong = copy_of(saved_at);
  OneBitAdam with_rank0s(wrong, world(), compressed("freeze"));  // a collective: every rank
  if (world()->rank() != 0) {  // rank 0's own save() is refused elsewhere, naming the rank
    EXPECT_TRUE(contains(error_text([&] { load(with_rank0s, rank0_only); }), "saved by rank 0"));
  }

  const std::shared_ptr<Transport> alone = world()->split(world()->rank(), 0);
  Parameters elsewhere = copy_of(saved_at);
  OneBitAdam other(elsewhere, alone, compressed("freeze"));
  const std::string before = saved(other);
  EXPECT_TRUE(contains(error_text([&] { load(other, file); }),
                       fmt::format("the state holds the error feedback of {} ranks; this job "
                                   "has 1",
                                   world()->size())));
  EXPECT_EQ(saved(other), before);
}

TEST(OneBitAdam, LoadRefusesAnotherPolicyOrAForeignStateChangingNothing) {
  Parameters p = make_parameters();
  OneBitAdam frozen(p, world(), compressed("freeze"));
  train(p, frozen, 0, 1);
  const std::string freeze_state = saved(frozen);

  Parameters q = make_parameters();
  OneBitAdam opt(q, world(), compressed("doubling"));
  EXPECT_TRUE(contains(error_text([&] { load(opt, freeze_state); }),
                       "the state was saved with variance='freeze', this optimizer has "
                       "'doubling'"));
  OneBitAdam other_warmup(q, world(), compressed("freeze").warmup_steps(4));
  EXPECT_TRUE(contains(error_text([&] { load(other_warmup, freeze_state); }),
                       "saved with warmup_steps=3, this optimizer has 4"));
  OneBitAdam other_interval(q, world(), compressed("doubling").variance_interval(2));
  train(q, opt, 0, 1);
  EXPECT_TRUE(contains(error_text([&] { load(other_interval, saved(opt)); }),
                       "saved with variance_interval=1, this optimizer has 2"));
  EXPECT_EQ(other_interval.steps(), 0);
  EXPECT_TRUE(other_interval.state().empty());

  LAMB lamb(q.values());
  EXPECT_TRUE(contains(error_text([&] { load(opt, saved(lamb)); }), "has no gradcomp part"));
  EXPECT_EQ(opt.steps(), 1);
}

// A NaN in rank 0's gradient makes the average non-finite: every rank skips the step (the
// parameters and moments as they were) with a warning, the clock advances, training goes on.
TEST(OneBitAdam, ANonFiniteAverageSkipsTheStepOnEveryRank) {
  Parameters p = make_parameters();
  OneBitAdam opt(p, world(), compressed("doubling"));
  train(p, opt, 0, 1);
  for (int step = 1; step < 3; ++step) {  // an exact step, then a compressed one
    EXPECT_EQ(opt.exact(), step == 1);
    const std::vector<std::byte> before = bytes_of(p);
    opt.zero_grad();
    loss_of(p, world()->rank(), step).backward();
    if (world()->rank() == 0) p["w1"].grad().view({-1})[3].fill_(std::nanf(""));
    const std::vector<std::string> warnings = warnings_of([&] { opt.step(); });
    EXPECT_FALSE(opt.last_step().finite);
    EXPECT_EQ(bytes_of(p), before) << "step " << step;
    EXPECT_EQ(opt.steps(), step + 1);
    EXPECT_EQ(state_of(opt, p["w1"]).step(), 1);
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_TRUE(contains(warnings[0], "the step is skipped on every rank"));
  }
  train(p, opt, 3, 2);
  EXPECT_TRUE(opt.last_step().finite);
  expect_identical_across_ranks(p, "after the skipped steps");
  EXPECT_EQ(state_of(opt, p["w1"]).step(), 3);
  EXPECT_EQ(state_of(opt, p["w1"]).variance_updates(), 2);  // steps 0 and 3
}

// The exact steps' engine writes its Chrome trace beside the compressed steps'.
TEST(OneBitAdam, EachKindOfStepHasItsOwnTrace) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("gradcomp_onebit_trace_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    Parameters p = make_parameters();
    OneBitAdam opt(p, world(),
                   OneBitAdamOptions().variance("doubling").variance_interval(1).compression(
                       "none").timeline(
                       (dir / "trace.json").string()));
    train(p, opt, 0, 3);  // exact, exact, compressed
  }                       // the engines write their traces when they end
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  const std::string rank = std::to_string(world()->rank());
  EXPECT_EQ(names, (std::vector<std::string>{"trace-exact.rank" + rank + ".json",
                                             "trace.rank" + rank + ".json"}));
  for (const auto& name : names) {
    std::ifstream in(dir / name);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("\"name\":\"thread_name\""), std::string::npos) << name;
  }
  fs::remove_all(dir);
}

TEST(OneBitAdam, DoublingScheduleAndFreezeWarmup) {
  std::vector<int64_t> exact;
  for (int64_t t = 0; t < 40; ++t) {
    if (is_exact_step(t, 1)) exact.push_back(t);
  }
  EXPECT_EQ(exact, (std::vector<int64_t>{0, 1, 3, 7, 15, 31}));
  int count = 0;
  for (int64_t t = 0; t < 400; ++t) count += is_exact_step(t, 16) ? 1 : 0;
  EXPECT_EQ(count, 74);
  for (int64_t t = 0; t < 16; ++t) EXPECT_TRUE(is_exact_step(t, 16)) << t;

  Parameters p = make_parameters();
  EXPECT_EQ(OneBitAdam(p, world(), OneBitAdamOptions()).variance(), "freeze");  // the default
  OneBitAdam doubling(p, world(), OneBitAdamOptions().variance("doubling").total_steps(1000));
  EXPECT_EQ(doubling.variance(), "doubling");
  EXPECT_EQ(doubling.variance_interval(), 16);
  EXPECT_FALSE(doubling.warmup_steps().has_value());
  EXPECT_EQ(doubling.plan().buckets.front().option.codec, "none");  // all tensors are small
  const auto freeze = OneBitAdamOptions().variance("freeze");
  EXPECT_EQ(OneBitAdam(p, world(), OneBitAdamOptions(freeze).total_steps(1000)).warmup_steps(),
            150);
  EXPECT_EQ(OneBitAdam(p, world(), OneBitAdamOptions(freeze).total_steps(3)).warmup_steps(), 1);
  EXPECT_EQ(OneBitAdam(p, world(), freeze).warmup_steps(), 1000);
}

// requires_grad changed after construction (fine-tuning): a parameter left out then, with a
// gradient now, would never be updated; one frozen since, without a gradient, would keep moving
// by its momentum. Each step is refused naming it, before anything moves.
TEST(OneBitAdam, ChangingRequiresGradAfterConstructionIsRefused) {
  const int rank = world()->rank();
  const auto refused = [](OneBitAdam& opt, const Parameters& p, const std::string& expected) {
    const auto before = bytes_of(p);
    try {
      opt.step();
      ADD_FAILURE() << "step() took it";
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), expected)) << e.what();
    }
    EXPECT_EQ(bytes_of(p), before) << "step() moved the parameters";
  };
  Parameters p = make_parameters();
  p["w1"].requires_grad_(false);
  OneBitAdam unfrozen(p, world(), compressed("freeze"));
  train(p, unfrozen, 0, 1);  // w1 has no gradient yet
  p["w1"].requires_grad_(true);
  unfrozen.zero_grad();
  loss_of(p, rank, 1).backward();
  refused(unfrozen, p, "parameter 'w1' has a gradient, but it required none");

  Parameters q = make_parameters();
  OneBitAdam frozen(q, world(), compressed("freeze"));
  train(q, frozen, 0, 1);
  q["b2"].requires_grad_(false);
  frozen.zero_grad();
  q["b2"].mutable_grad() = at::Tensor();  // as zero_grad(set_to_none) leaves it
  loss_of(q, rank, 1).backward();
  refused(frozen, q, "parameter 'b2' requires no gradient now");
}

// find_unused_parameters: a parameter no rank has a gradient for ("side") keeps its value and
// step count through exact and compressed steps, the others train alike on every rank; without
// the option it moves (weight decay on a zero gradient). One first used after the warm-up
// learns its variance in an exact step of its own. Ranks that differ on the option are refused.
TEST(OneBitAdam, FindUnusedParametersLeavesAParameterNoRankUsed) {
  for (const bool find_unused : {true, false}) {
    Parameters p = make_parameters();
    p.insert("side", at::ones({8}).requires_grad_());
    OneBitAdam opt(p, world(), compressed("freeze").find_unused_parameters(find_unused));
    const at::Tensor before = p["side"].detach().clone();
    train(p, opt, 0, 8);
    expect_identical_across_ranks(p, find_unused ? "find_unused" : "plain");
    EXPECT_EQ(at::equal(p["side"], before), find_unused) << find_unused;
    EXPECT_EQ(state_of(opt, p["side"]).step(), find_unused ? 0 : 8);
    EXPECT_EQ(state_of(opt, p["w1"]).step(), 8);
  }
  // "late", used by rank 0 alone from step 4 on (the warm-up is steps 0-2): its variance
  // unlearned, it takes an exact step of its own on its first use, AdamW's first step on the
  // mean gradient (rank 0's over the world size), then compressed steps, alike on every rank.
  Parameters p = make_parameters();
  p.insert("late", at::full({8}, 0.5f).requires_grad_());
  OneBitAdam opt(p, world(), compressed("freeze").find_unused_parameters(true));
  const int rank = world()->rank();
  at::Tensor expected;
  for (int step = 0; step < 7; ++step) {
    opt.zero_grad();
    at::Tensor loss = loss_of(p, rank, step);
    if (rank == 0 && step >= 4) loss = loss + (p["late"] * at::arange(8, at::kFloat)).sum();
    loss.backward();
    if (step == 4) {  // AdamW's first step: m^ = g, v^ = g^2, so w -= lr (g / (|g| + eps) + wd w)
      const at::Tensor g = at::arange(8, at::kFloat) / static_cast<double>(world()->size());
      const at::Tensor w = p["late"].detach();
      expected = w - 0.01 * (g / (g.abs() + 1e-8) + 0.01 * w);
    }
    opt.step();
    if (step == 4) {
      EXPECT_TRUE(at::allclose(p["late"], expected, 0, 1e-7)) << p["late"] << expected;
      EXPECT_EQ(state_of(opt, p["late"]).variance_updates(), 1);
    }
  }
  expect_identical_across_ranks(p, "a parameter first used after the warm-up");
  EXPECT_EQ(state_of(opt, p["late"]).step(), 3);  // steps 4, 5, 6
  EXPECT_EQ(state_of(opt, p["late"]).variance_updates(), 1);
  EXPECT_TRUE(at::isfinite(p["late"]).all().item<bool>());

  // Without find_unused_parameters "late" took its exact steps on zeros: its variance holds
  // only zeros (variance_updates does not show it). It steps exactly on its own, on a mean of
  // 0 while no rank uses it (weight decay alone, as in the warm-up), then as AdamW does on the
  // same history (zeros, then the mean gradient), not by a compressed step's m / eps.
  Parameters plain = make_parameters();
  plain.insert("late", at::full({8}, 0.5f).requires_grad_());
  OneBitAdam without(plain, world(), compressed("freeze"));
  at::Tensor twin = plain["late"].detach().clone().requires_grad_();
  ::torch::optim::AdamW adamw({twin}, ::torch::optim::AdamWOptions(0.01).weight_decay(0.01));
  for (int step = 0; step < 7; ++step) {
    without.zero_grad();
    at::Tensor loss = loss_of(plain, rank, step);
    if (rank == 0 && step >= 4) loss = loss + (plain["late"] * at::arange(8, at::kFloat)).sum();
    loss.backward();
    without.step();
    if (step > 4) continue;
    twin.mutable_grad() = step < 4
                              ? at::zeros({8})
                              : at::arange(8, at::kFloat) / static_cast<double>(world()->size());
    adamw.step();
    EXPECT_TRUE(at::allclose(plain["late"], twin, 0, 1e-7)) << step << plain["late"] << twin;
  }
  expect_identical_across_ranks(plain, "a parameter first used after the warm-up, no option");
  EXPECT_TRUE(state_of(without, plain["late"]).exp_avg_sq().any().item<bool>());
  EXPECT_TRUE(at::isfinite(plain["late"]).all().item<bool>());

  Parameters q = make_parameters();
  try {
    OneBitAdam mixed(q, world(), compressed("freeze").find_unused_parameters(world()->rank() == 0));
    ADD_FAILURE() << "ranks with different find_unused_parameters were accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "the ranks use different find_unused_parameters")) << e.what();
  }
}

TEST(OneBitAdam, BadInputIsAClearError) {
  Parameters p = make_parameters();
  auto refusal = [&](const OneBitAdamOptions& options) {
    return error_text([&] { OneBitAdam opt(p, world(), options); });
  };
  EXPECT_TRUE(contains(refusal(OneBitAdamOptions().variance("sometimes")),
                       "variance is 'sometimes'; allowed: 'freeze', 'doubling'"));
  EXPECT_TRUE(contains(refusal(OneBitAdamOptions().variance_interval(0)),
                       "variance_interval is 0; allowed: an int >= 1"));
  EXPECT_TRUE(contains(refusal(OneBitAdamOptions().variance("doubling").warmup_steps(10)),
                       "warmup_steps applies to variance=\"freeze\""));
  EXPECT_TRUE(contains(refusal(OneBitAdamOptions().variance("freeze").warmup_steps(0)),
                       "warmup_steps is 0; allowed: an int >= 1"));
  EXPECT_TRUE(contains(refusal(OneBitAdamOptions().variance("freeze").total_steps(0)),
                       "total_steps is 0; allowed: an int >= 1"));
  EXPECT_TRUE(contains(refusal(OneBitAdamOptions().compression("onebit|ef|twoway|start=5")),
                       "has its own start="));
  EXPECT_TRUE(contains(refusal(OneBitAdamOptions().compression("nosuchcodec")), "nosuchcodec"));
  EXPECT_TRUE(contains(refusal(OneBitAdamOptions().codec_threads(0)),
                       "codec_threads is 0; allowed: an integer in [1, 1024]"));
  EXPECT_THROW(OneBitAdam(p, world(), OneBitAdamOptions(-1.0)), SpecError);
  EXPECT_THROW(OneBitAdam(p, world(), OneBitAdamOptions().betas({0.9, 1.0})), SpecError);

  expect_refuses_wide_parameters_and_wrapping<OneBitAdam>("OneBitAdam");
}

}  // namespace
}  // namespace gradcomp::torch
