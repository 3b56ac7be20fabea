// gradcomp::torch::OneBitLamb across real processes (mpirun and the Gloo launcher): its warm-up
// steps are gradcomp::torch::LAMB's on the mean gradient, bit for bit; without compression both
// stages follow their definition (a reference in double: the trust ratios' average, the frozen
// variance with the unseen coordinates filled, the fresh variance started from it, the factor);
// under 1-bit two-way compression the ranks stay bit-identical and the compressed steps send a
// fraction of the warm-up's bytes; a checkpoint after a warm-up or a compressed step resumes
// bit-exactly; a non-finite average is skipped on every rank in either stage; bad options,
// states of other settings or of OneBitAdam (and OneBitAdam given one of ours), and wrapping
// in DistributedOptimizer are clear errors that change nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "gradcomp/error.h"
#include "gradcomp/torch/distributed_optimizer.h"
#include "gradcomp/torch/layerwise_optimizers.h"
#include "gradcomp/torch/onebit_adam.h"
#include "gradcomp/torch/onebit_lamb.h"
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

const OneBitLambParamState& state_of(const OneBitLamb& opt, const at::Tensor& p) {
  return optimizer_testing::state_of<OneBitLambParamState>(opt, p);
}

// Every tensor compressed, 1-bit codes with both sides' error feedback, a warm-up of 3 steps.
OneBitLambOptions compressed() {
  OneBitLambOptions o(0.01);
  o.weight_decay(0.05).warmup_steps(3).min_compress_elements(1).seed(3);
  return o;
}

// Rank r's gradient of parameter `p` at `step`: multiples of 2^-10 in (-1, 1), so that the sum
// of up to 4 ranks' is exact in float32 in any order and the mean is exactly this test's.
at::Tensor dyadic_gradient(const at::Tensor& p, int rank, int step, int index) {
  const at::Tensor t = at::arange(p.numel(), at::kFloat).reshape(p.sizes());
  return at::round(at::sin(t * (0.3f + 0.1f * rank) + (step + index)) * 1000.0f) / 1024.0f;
}

// Each rank its own gradients: every warm-up step is gradcomp::torch::LAMB's on their mean,
// bit for bit (parameters and moments), whatever the compression of the later steps.
TEST(OneBitLamb, WarmupStepsAreLambsOnTheMeanGradient) {
  Parameters ours = make_parameters();
  Parameters reference = copy_of(ours);
  OneBitLamb opt(ours, world(), compressed().betas({0.9, 0.99}).warmup_steps(4));
  LAMB lamb(reference.values(),
            LayerwiseOptions(0.01).betas({0.9, 0.99}).eps(1e-6).weight_decay(0.05));
  const int w = world()->size();
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE(opt.exact()) << step;
    int index = 0;
    for (auto& item : ours) {
      at::Tensor mean = at::zeros_like(item.value());
      for (int r = 0; r < w; ++r) mean += dyadic_gradient(item.value(), r, step, index);
      item.value().mutable_grad() =
          dyadic_gradient(item.value(), world()->rank(), step, index).clone();
      reference[item.key()].mutable_grad() = mean / static_cast<float>(w);
      ++index;
    }
    opt.step();
    lamb.step();
    EXPECT_EQ(bytes_of(ours), bytes_of(reference)) << "warm-up step " << step;
    EXPECT_GT(opt.last_step().bytes_sent, 0u);
  }
  for (const auto& item : ours) {
    const auto& theirs = static_cast<const LayerwiseParamState&>(
        *lamb.state().at(c10::guts::to_string(reference[item.key()].unsafeGetTensorImpl())));
    const auto& mine = state_of(opt, item.value());
    EXPECT_TRUE(at::equal(mine.exp_avg(), theirs.exp_avg())) << item.key();
    EXPECT_TRUE(at::equal(mine.exp_avg_sq(), theirs.exp_avg_sq())) << item.key();
    EXPECT_EQ(mine.step(), 4);
    EXPECT_EQ(mine.variance_updates(), 4);
    EXPECT_GE(mine.lamb_coeff(), 0.01) << item.key();  // the average of held ratios
    EXPECT_LE(mine.lamb_coeff(), 10.0) << item.key();
    EXPECT_FALSE(mine.fresh_exp_avg_sq().defined()) << item.key();
  }
  EXPECT_TRUE(opt.frozen());
  EXPECT_FALSE(opt.exact());
}

// 1-bit LAMB from its definition (gradcomp/optimizer.h), in double, on one set of gradients
// (every rank the same data, so the averages are that data's).
struct Reference {
  explicit Reference(const Parameters& p, int warmup, OneBitLambHyper knobs)
      : warmup(warmup), knobs(knobs) {
    for (const auto& item : p) {
      x.push_back(item.value().detach().to(at::kDouble));
      m.push_back(at::zeros_like(x.back()));
      v.push_back(at::zeros_like(x.back()));
      fresh.emplace_back();
      coeff.push_back(0);
      factor.push_back(1);
    }
  }

  void step(const std::vector<at::Tensor>& grads, int t) {  // t: 1 for the first step
    const double bound = std::max(1.0, (1 - beta1) / std::sqrt(1 - beta2));
    for (size_t i = 0; i < x.size(); ++i) {
      const at::Tensor g = grads[i].to(at::kDouble);
      if (t <= warmup) {  // LAMB, its ratio held and averaged
        m[i].mul_(beta1).add_(g, 1 - beta1);
        v[i].mul_(beta2).addcmul_(g, g, 1 - beta2);
        at::Tensor r =
            (m[i] / (1 - std::pow(beta1, t))) / ((v[i] / (1 - std::pow(beta2, t))).sqrt() + eps) +
            wd * x[i];
        const double xn = x[i].norm().item<double>();
        const double rn = r.norm().item<double>();
        const double ratio = xn > 0 && rn > 0 ? xn / rn : 1.0;
        const double held = std::min(std::max(ratio, knobs.min_coeff), knobs.max_coeff);
        coeff[i] = t == 1 ? held : knobs.coeff_beta * coeff[i] + (1 - knobs.coeff_beta) * held;
        x[i] -= lr * ratio * r;
        continue;
      }
      if (!fresh[i].defined()) {  // the unseen coordinates take the mean of the others
        const at::Tensor unseen = v[i] == 0;
        if (unseen.any().item<bool>() && !unseen.all().item<bool>()) {
          v[i].masked_fill_(unseen, v[i].masked_select(~unseen).mean().item<double>());
        }
        fresh[i] = v[i].clone();
      }
      const at::Tensor momentum = beta1 * m[i] + (1 - beta1) * g;
      const at::Tensor rebuilt = (momentum - beta1 * m[i]) / (1 - beta1);
      fresh[i].mul_(beta2).addcmul_(rebuilt, rebuilt, 1 - beta2);
      m[i] = momentum;
      const at::Tensor frozen = (v[i] / (1 - std::pow(beta2, warmup))).sqrt() + eps;
      const double ratio =
          (frozen / ((fresh[i] / (1 - std::pow(beta2, t))).sqrt() + eps)).max().item<double>();
      const at::Tensor u = ((momentum / (1 - std::pow(beta1, t))) / frozen).clamp(-bound, bound);
      const at::Tensor d = u + wd * x[i];
      const double share = std::min(1.0, (u.norm() / d.norm()).item<double>());
      const double f = std::clamp(ratio * share + 1 - share, knobs.factor_min, knobs.factor_max);
      factor[i] = std::clamp(f, factor[i] * (1 - knobs.factor_threshold),
                             factor[i] * (1 + knobs.factor_threshold));
      x[i] -= lr * coeff[i] * factor[i] * d;
    }
  }

  static constexpr double lr = 0.01, beta1 = 0.9, beta2 = 0.99, eps = 1e-6, wd = 0.05;
  int warmup;
  OneBitLambHyper knobs;
  std::vector<at::Tensor> x, m, v, fresh;
  std::vector<double> coeff, factor;
};

// No compression and every rank the same data: the warm-up averages the held trust ratios, the
// variance freezes (its unseen rows filled), and the compression stage steps by the frozen
// coefficient times the factor the fresh variance gives, as the definition says.
TEST(OneBitLamb, WithoutCompressionBothStagesFollowTheDefinition) {
  Parameters ours = make_parameters();
  // The layers' trust ratios here are 0.21-0.48: both bounds hold some of them.
  const OneBitLambHyper knobs{.coeff_beta = 0.8,
                              .max_coeff = 0.4,
                              .min_coeff = 0.22,
                              .factor_max = 3.0,
                              .factor_min = 0.6,
                              .factor_threshold = 0.05};
  OneBitLamb opt(ours, world(),
                 OneBitLambOptions(Reference::lr)
                     .betas({Reference::beta1, Reference::beta2})
                     .eps(Reference::eps)
                     .weight_decay(Reference::wd)
                     .warmup_steps(3)
                     .compression("none")
                     .coeff_beta(knobs.coeff_beta)
                     .max_coeff(knobs.max_coeff)
                     .min_coeff(knobs.min_coeff)
                     .factor_max(knobs.factor_max)
                     .factor_min(knobs.factor_min)
                     .factor_threshold(knobs.factor_threshold));
  Reference reference(ours, 3, knobs);
  at::Tensor frozen;
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    loss_of(ours, 0, step, /*rows_from=*/5).backward();
    std::vector<at::Tensor> grads;
    for (const auto& item : ours) grads.push_back(item.value().grad().clone());
    opt.step();
    reference.step(grads, step + 1);
    size_t i = 0;
    for (const auto& item : ours) {
      const at::Tensor expected = reference.x[i++].to(at::kFloat);
      EXPECT_TRUE(at::allclose(item.value(), expected, 1e-5, 1e-6))
          << item.key() << " at step " << step << ": largest difference "
          << (item.value() - expected).abs().max().item<float>();
    }
    if (step == 3) frozen = state_of(opt, ours["rows"]).exp_avg_sq().clone();
  }
  size_t i = 0;
  for (const auto& item : ours) {
    const auto& state = state_of(opt, item.value());
    EXPECT_NEAR(state.lamb_coeff(), reference.coeff[i], 1e-6 * reference.coeff[i]) << item.key();
    EXPECT_NEAR(state.lamb_factor(), reference.factor[i], 1e-5 * reference.factor[i]) << item.key();
    EXPECT_EQ(state.step(), 10);
    EXPECT_EQ(state.variance_updates(), 3);
    ++i;
  }
  // The factor moved (else the fresh variance would be untested) within its bounds.
  EXPECT_NE(state_of(opt, ours["w1"]).lamb_factor(), 1.0);
  const auto& rows = state_of(opt, ours["rows"]);
  EXPECT_GT(rows.exp_avg_sq().min().item<float>(), 0.0f) << "the unseen rows were not filled";
  EXPECT_TRUE(at::equal(rows.exp_avg_sq(), frozen)) << "v changed after its first fill";
  EXPECT_TRUE(rows.fresh_exp_avg_sq().defined());
  EXPECT_FALSE(at::equal(rows.fresh_exp_avg_sq(), rows.exp_avg_sq()));
}

// Each rank its own data, 1-bit two-way compression: every rank holds the same parameters
// after every step; the compressed steps send a fraction of the warm-up's bytes.
TEST(OneBitLamb, RanksAreBitIdenticalAndBytesDropAfterTheWarmup) {
  Parameters p = make_parameters();
  OneBitLamb opt(p, world(), compressed());
  EXPECT_EQ(opt.plan().buckets.front().option.codec, "onebit:block=256");
  std::vector<bool> kinds;
  size_t exact_bytes = 0;  // what a warm-up step sent (fp32)
  for (int step = 0; step < 8; ++step) {
    kinds.push_back(opt.exact());
    train(p, opt, step, 1, /*rows_from=*/5);
    expect_identical_across_ranks(p, "step " + std::to_string(step));
    if (kinds.back()) {
      exact_bytes = opt.last_step().bytes_sent;
      EXPECT_GT(exact_bytes, 0u);
    } else {
      // 1-bit codes: a fraction of fp32's bytes even with these small tensors' headers
      EXPECT_LT(opt.last_step().bytes_sent, exact_bytes / 3) << "step " << step;
    }
  }
  EXPECT_EQ(kinds, (std::vector<bool>{true, true, true, false, false, false, false, false}));
  EXPECT_TRUE(opt.frozen());
  const auto& rows = state_of(opt, p["rows"]);
  EXPECT_GT(rows.exp_avg_sq().min().item<float>(), 0.0f) << "the unseen rows were not filled";
  EXPECT_EQ(rows.variance_updates(), 3);
  for (const auto& item : p) {
    const auto& state = state_of(opt, item.value());
    // the same coefficient and factor on every rank (they scale every step)
    const double mine[2] = {state.lamb_coeff(), state.lamb_factor()};
    const auto all = gather_bytes(std::as_bytes(std::span<const double>(mine)));
    for (int r = 0; r < world()->size(); ++r) {
      EXPECT_EQ(std::memcmp(mine, all.data() + r * sizeof(mine), sizeof(mine)), 0) << item.key();
    }
  }
}

// Saved after step 1 (a warm-up step), step 3 (the first compressed step) and step 5 of 8,
// loaded into a new optimizer over the saved parameters: the continuation is bit-exact.
TEST(OneBitLamb, CheckpointsResumeBitExactly) {
  Parameters p = make_parameters();
  OneBitLamb opt(p, world(), compressed());
  std::vector<std::pair<int, std::pair<std::string, Parameters>>> checkpoints;
  std::vector<bool> kinds;
  for (int step = 0; step < 8; ++step) {
    kinds.push_back(opt.exact());
    train(p, opt, step, 1, /*rows_from=*/4);
    if (step == 1 || step == 3 || step == 5) {
      checkpoints.push_back({step + 1, {saved(opt), copy_of(p)}});
    }
  }
  EXPECT_TRUE(kinds[1]);   // the first checkpoint follows a warm-up step,
  EXPECT_FALSE(kinds[3]);  // the others compressed ones
  EXPECT_FALSE(kinds[5]);
  for (auto& [taken, checkpoint] : checkpoints) {
    Parameters resumed = copy_of(checkpoint.second);
    OneBitLamb again(resumed, world(), compressed());
    load(again, checkpoint.first);
    EXPECT_EQ(again.steps(), taken);
    EXPECT_EQ(again.exact(), taken < 3);
    train(resumed, again, taken, 8 - taken, /*rows_from=*/4);
    EXPECT_EQ(bytes_of(resumed), bytes_of(p)) << "saved after step " << taken;
  }
  // Without the state (moments, coefficients, factors, clock, error feedback) it differs.
  Parameters unloaded = copy_of(checkpoints.back().second.second);
  OneBitLamb fresh(unloaded, world(), compressed());
  train(unloaded, fresh, 6, 2, /*rows_from=*/4);
  EXPECT_NE(bytes_of(unloaded), bytes_of(p));
}

// Each refusal leaves the optimizer as it was: its next steps are its twin's, bit for bit.
TEST(OneBitLamb, LoadRefusesOtherSettingsAndOtherOptimizersChangingNothing) {
  Parameters p = make_parameters();
  OneBitLamb source(p, world(), compressed());
  train(p, source, 0, 4);  // into the compression stage
  const std::string state = saved(source);

  Parameters q = make_parameters();
  Parameters twin_parameters = make_parameters();
  OneBitLamb opt(q, world(), compressed());
  OneBitLamb twin(twin_parameters, world(), compressed());
  train(q, opt, 0, 2);
  train(twin_parameters, twin, 0, 2);

  auto refused = [&](const std::string& bytes) { return error_text([&] { load(opt, bytes); }); };
  OneBitLamb other_warmup(make_parameters(), world(), compressed().warmup_steps(4));
  EXPECT_TRUE(contains(refused(saved(other_warmup)),
                       "OneBitLamb::load: the state was saved with warmup_steps=4, this "
                       "optimizer has 3"));
  OneBitLamb other_knob(make_parameters(), world(), compressed().coeff_beta(0.8));
  EXPECT_TRUE(contains(refused(saved(other_knob)),
                       "the state was saved with coeff_beta=0.8, this optimizer has 0.9"));
  OneBitLamb other_factor(make_parameters(), world(), compressed().factor_threshold(0.2));
  EXPECT_TRUE(contains(refused(saved(other_factor)),
                       "the state was saved with factor_threshold=0.2, this optimizer has 0.1"));
  OneBitAdam adam(make_parameters(), world(), OneBitAdamOptions().warmup_steps(3));
  EXPECT_TRUE(contains(refused(saved(adam)),
                       "OneBitLamb::load: the state was saved by OneBitAdam, not by a "
                       "OneBitLamb"));
  LAMB lamb(q.values());
  EXPECT_TRUE(contains(refused(saved(lamb)), "has no gradcomp part of version 2"));
  // A state whose fresh variance does not fit its parameter: refused after the engine state
  // (the source's error feedback after a compressed step) was loaded, which is then put back.
  auto& w1 = static_cast<OneBitLambParamState&>(
      *source.state().at(c10::guts::to_string(p["w1"].unsafeGetTensorImpl())));
  w1.fresh_exp_avg_sq(at::zeros({3}));
  EXPECT_TRUE(contains(refused(saved(source)),
                       "OneBitLamb::load: the state does not fit parameter 'w1' of shape [16, 8]"));
  w1.fresh_exp_avg_sq(w1.exp_avg_sq().clone()).lamb_factor(-1.0);
  EXPECT_TRUE(contains(refused(saved(source)), "the state does not fit parameter 'w1'"));
  EXPECT_EQ(opt.steps(), 2);

  train(q, opt, 2, 4);
  train(twin_parameters, twin, 2, 4);
  EXPECT_EQ(bytes_of(q), bytes_of(twin_parameters)) << "a refused load changed the optimizer";

  // And the other way round: OneBitAdam refuses a OneBitLamb's state.
  EXPECT_TRUE(contains(error_text([&] { load(adam, state); }),
                       "OneBitAdam::load: the state was saved by OneBitLamb, not by a "
                       "OneBitAdam"));
  EXPECT_EQ(adam.steps(), 0);
  EXPECT_TRUE(adam.state().empty());
}

// A NaN in rank 0's gradient makes the average non-finite: every rank skips the step (the
// parameters, moments and coefficients as they were) with a warning, in either stage.
TEST(OneBitLamb, ANonFiniteAverageSkipsTheStepOnEveryRank) {
  Parameters p = make_parameters();
  OneBitLamb opt(p, world(), compressed());
  train(p, opt, 0, 1);
  for (int step = 1; step < 5; step += 3) {  // a warm-up step, then a compressed one
    EXPECT_EQ(opt.exact(), step == 1);
    const std::vector<std::byte> before = bytes_of(p);
    const double coeff = state_of(opt, p["w1"]).lamb_coeff();
    const double factor = state_of(opt, p["w1"]).lamb_factor();
    const int64_t taken = state_of(opt, p["w1"]).step();
    opt.zero_grad();
    loss_of(p, world()->rank(), step).backward();
    if (world()->rank() == 0) p["w1"].grad().view({-1})[3].fill_(std::nanf(""));
    const std::vector<std::string> warnings = warnings_of([&] { opt.step(); });
    EXPECT_FALSE(opt.last_step().finite);
    EXPECT_EQ(bytes_of(p), before) << "step " << step;
    EXPECT_EQ(opt.steps(), step + 1);
    EXPECT_EQ(state_of(opt, p["w1"]).step(), taken);
    EXPECT_EQ(state_of(opt, p["w1"]).lamb_coeff(), coeff);
    EXPECT_EQ(state_of(opt, p["w1"]).lamb_factor(), factor);
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_TRUE(contains(warnings[0], "OneBitLamb: this step's average is not finite"));
    EXPECT_TRUE(contains(warnings[0], "the step is skipped on every rank"));
    if (step == 1) train(p, opt, 2, 2);  // the last warm-up step, the first compressed one
  }
  train(p, opt, 5, 2);
  EXPECT_TRUE(opt.last_step().finite);
  expect_identical_across_ranks(p, "after the skipped steps");
  EXPECT_EQ(state_of(opt, p["w1"]).step(), 5);              // steps 0, 2, 3, 5, 6
  EXPECT_EQ(state_of(opt, p["w1"]).variance_updates(), 2);  // steps 0 and 2

  // Every warm-up step skipped: no variance learned, so the first compressed step is an exact
  // step of every parameter's own, as a warm-up step on that data would have been; then
  // compressed steps.
  Parameters q = make_parameters();
  Parameters twin_parameters = copy_of(q);
  OneBitLamb skipped(q, world(), compressed().warmup_steps(1));
  OneBitLamb twin(twin_parameters, world(), compressed().warmup_steps(1));
  skipped.zero_grad();
  loss_of(q, world()->rank(), 0).backward();
  if (world()->rank() == 0) q["b1"].grad().view({-1})[0].fill_(INFINITY);
  warnings_of([&] { skipped.step(); });  // skipped, with its warning
  EXPECT_FALSE(skipped.exact());
  train(q, skipped, 1, 1);
  train(twin_parameters, twin, 1, 1);  // its warm-up step, on the same data
  for (const auto& item : q) {
    EXPECT_TRUE(at::allclose(item.value(), twin_parameters[item.key()], 0, 1e-6)) << item.key();
    EXPECT_EQ(state_of(skipped, item.value()).variance_updates(), 1) << item.key();
  }
  train(q, skipped, 2, 2);
  EXPECT_TRUE(skipped.last_step().finite);
  expect_identical_across_ranks(q, "after every warm-up step was skipped");
}

TEST(OneBitLamb, DefaultsAndWarmup) {
  const OneBitLambOptions o;
  EXPECT_EQ(o.lr(), 1e-3);
  EXPECT_EQ(o.betas(), std::make_tuple(0.9, 0.999));
  EXPECT_EQ(o.eps(), 1e-6);
  EXPECT_EQ(o.weight_decay(), 0.01);
  EXPECT_TRUE(o.bias_correction());
  EXPECT_EQ(o.compression(), "onebit:block=256|ef|twoway");
  const OneBitLambHyper h = o.lamb_hyper();
  EXPECT_EQ(h.coeff_beta, 0.9);
  EXPECT_EQ(h.max_coeff, 10.0);
  EXPECT_EQ(h.min_coeff, 0.01);
  EXPECT_EQ(h.factor_max, 4.0);
  EXPECT_EQ(h.factor_min, 0.5);
  EXPECT_EQ(h.factor_threshold, 0.1);
  EXPECT_EQ(OneBitAdamOptions().eps(), 1e-8);  // OneBitAdam keeps its own defaults
  EXPECT_EQ(OneBitAdamOptions().weight_decay(), 0.0);

  Parameters p = make_parameters();
  EXPECT_EQ(OneBitLamb(p, world()).warmup_steps(), 1000);
  EXPECT_EQ(OneBitLamb(p, world(), OneBitLambOptions().total_steps(1000)).warmup_steps(), 150);
  EXPECT_EQ(OneBitLamb(p, world(), OneBitLambOptions().total_steps(3)).warmup_steps(), 1);
  OneBitLamb opt(p, world(), OneBitLambOptions().warmup_steps(7).total_steps(1000));
  EXPECT_EQ(opt.warmup_steps(), 7);
  EXPECT_EQ(opt.name(), "OneBitLamb");
  EXPECT_EQ(opt.plan().buckets.front().option.codec, "none");  // all tensors are small
}

TEST(OneBitLamb, BadInputIsAClearError) {
  Parameters p = make_parameters();
  auto refusal = [&](const OneBitLambOptions& options) {
    return error_text([&] { OneBitLamb opt(p, world(), options); });
  };
  auto refused_by_spec = [&](const OneBitLambOptions& options) {
    try {
      OneBitLamb opt(p, world(), options);
    } catch (const SpecError&) {
      return true;
    } catch (...) {
    }
    return false;
  };
  const std::vector<std::pair<OneBitLambOptions, std::string>> cases = {
      {OneBitLambOptions().warmup_steps(0), "OneBitLamb: warmup_steps is 0; allowed: an int >= 1"},
      {OneBitLambOptions().total_steps(0), "OneBitLamb: total_steps is 0; allowed: an int >= 1"},
      {OneBitLambOptions().coeff_beta(1.0), "OneBitLamb: coeff_beta is 1; allowed: 0 <= x < 1"},
      {OneBitLambOptions().min_coeff(0.0),
       "OneBitLamb: min_coeff is 0; allowed: a finite number > 0"},
      {OneBitLambOptions().max_coeff(0.001),
       "OneBitLamb: max_coeff is 0.001; allowed: a finite number >= min_coeff"},
      {OneBitLambOptions().factor_min(2.0), "OneBitLamb: factor_min is 2; allowed: 0 < x <= 1"},
      {OneBitLambOptions().factor_max(0.5),
       "OneBitLamb: factor_max is 0.5; allowed: a finite number >= 1"},
      {OneBitLambOptions().factor_threshold(-0.1),
       "OneBitLamb: factor_threshold is -0.1; allowed: a finite number >= 0"},
      {OneBitLambOptions(-1.0), "OneBitLamb: lr"},
      {OneBitLambOptions().eps(0.0), "OneBitLamb: eps"},
      {OneBitLambOptions().betas({0.9, 1.0}), "OneBitLamb: beta2"},
      {OneBitLambOptions().compression("onebit|ef|twoway|start=5"),
       "OneBitLamb: compression 'onebit|ef|twoway|start=5' has its own start=; which steps are "
       "exact is the warm-up's (warmup_steps)"},
      {OneBitLambOptions().compression("nosuchcodec"), "nosuchcodec"},
      {OneBitLambOptions().codec_threads(0),
       "OneBitLamb: codec_threads is 0; allowed: an integer in [1, 1024]"},
      {OneBitLambOptions().bucket_bytes(0),
       "OneBitLamb: bucket_bytes is 0; allowed: an integer in"},
  };
  for (const auto& [options, message] : cases) {
    EXPECT_TRUE(contains(refusal(options), message));
    EXPECT_TRUE(refused_by_spec(options)) << message << ": not a SpecError";
  }

  expect_refuses_wide_parameters_and_wrapping<OneBitLamb>("OneBitLamb");
}

// "late", used by no rank in the warm-up (steps 0-2) nor at the first compressed step, then
// by rank 0 alone: without find_unused_parameters its exact steps averaged zeros, so its
// variance holds only zeros. It steps exactly on its own until it learns one: at step 3 by
// weight decay alone (LAMB's trust ratio makes that lr times the weights), not by the clamp of
// m / eps that its trust ratio scaled to a step of about 0.28 here before.
TEST(OneBitLamb, AParameterNoRankUsedInTheWarmupLearnsItsVariance) {
  Parameters p = make_parameters();
  p.insert("late", at::full({8}, 0.5f).requires_grad_());
  OneBitLamb opt(p, world(), compressed());
  const int rank = world()->rank();
  for (int step = 0; step < 7; ++step) {
    const at::Tensor before = p["late"].detach().clone();
    opt.zero_grad();
    at::Tensor loss = loss_of(p, rank, step);
    if (rank == 0 && step >= 4) loss = loss + (p["late"] * at::arange(8, at::kFloat)).sum();
    loss.backward();
    opt.step();
    const double moved = (p["late"] - before).abs().max().item<double>();
    if (step < 4) {
      EXPECT_LE(moved, 0.01 * 0.5 * 1.01) << step;  // lr times the weights at most
    }
    EXPECT_EQ(state_of(opt, p["late"]).exp_avg_sq().any().item<bool>(), step >= 4) << step;
  }
  expect_identical_across_ranks(p, "a parameter first used after the warm-up, no option");
}

}  // namespace
}  // namespace gradcomp::torch
