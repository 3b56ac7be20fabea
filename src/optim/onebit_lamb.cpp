// 1-bit LAMB's compression stage: a frozen-variance Adam direction, scaled per layer by a frozen
// coefficient times a factor that follows the gradients' scale. Two passes over the layer: the
// first takes the new momentum, feeds the fresh variance and measures (norms, the largest
// denominator ratio), the second applies the step (the factor needs the whole layer first).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string_view>

#include "common/parallel.h"
#include "gradcomp/error.h"
#include "optim/adam_moments.h"

namespace gradcomp {

void check_onebit_lamb_hyper(const OneBitLambHyper& h, std::string_view optimizer) {
  const auto fail = [&](std::string_view what, double value, std::string_view allowed) {
    throw SpecError(fmt::format("{}: {} is {}; allowed: {}", optimizer, what, value, allowed));
  };
  if (!(h.coeff_beta >= 0 && h.coeff_beta < 1)) fail("coeff_beta", h.coeff_beta, "0 <= x < 1");
  if (!(std::isfinite(h.min_coeff) && h.min_coeff > 0)) {
    fail("min_coeff", h.min_coeff, "a finite number > 0");
  }
  if (!(std::isfinite(h.max_coeff) && h.max_coeff >= h.min_coeff)) {
    fail("max_coeff", h.max_coeff, "a finite number >= min_coeff");
  }
  // The factor starts at 1 at the freeze: the bounds must hold it.
  if (!(h.factor_min > 0 && h.factor_min <= 1)) fail("factor_min", h.factor_min, "0 < x <= 1");
  if (!(std::isfinite(h.factor_max) && h.factor_max >= 1)) {
    fail("factor_max", h.factor_max, "a finite number >= 1");
  }
  if (!(std::isfinite(h.factor_threshold) && h.factor_threshold >= 0)) {
    fail("factor_threshold", h.factor_threshold, "a finite number >= 0");
  }
}

namespace {

constexpr std::string_view kName = "OneBitLamb";

struct Measures {
  double param = 0;      // sum of x^2
  double direction = 0;  // sum of u^2 (the bounded Adam direction)
  double step = 0;       // sum of d^2 (u plus the weight decay)
  double ratio = 0;      // the largest frozen-to-fresh denominator ratio

  static Measures fold(Measures a, Measures b) {
    return {a.param + b.param, a.direction + b.direction, a.step + b.step,
            std::max(a.ratio, b.ratio)};
  }
};

// The two variances' corrections: the frozen one's (`frozen_at` updates) and the fresh one's,
// which continued counting from the freeze (`step` updates).
struct Scales {
  optim::MomentCoefficients frozen;
  float fresh_second_scale;
  float inverse_one_minus_beta1;
  float bound;
};

void check(const LayerSlot& layer, const OneBitLambLayer& state) {
  const size_t n = layer.param.size();
  if (layer.grad.size() != n || layer.exp_avg.size() != n || layer.exp_avg_sq.size() != n ||
      state.fresh_exp_avg_sq.size() != n) {
    throw Error(fmt::format(
        "{}: a layer's parameter, momentum, moments and fresh variance must have one length; "
        "got {}, {}, {}, {}, {}",
        kName, n, layer.grad.size(), layer.exp_avg.size(), layer.exp_avg_sq.size(),
        state.fresh_exp_avg_sq.size()));
  }
  if (!(std::isfinite(state.coeff) && state.coeff > 0) ||
      !(std::isfinite(state.factor) && state.factor > 0)) {
    throw Error(fmt::format("{}: the layer's coefficient {} and factor {} must be finite and > 0",
                            kName, state.coeff, state.factor));
  }
}

Measures update_onebit_lamb_layer(const LayerSlot& layer, std::span<float> fresh, const Scales& s,
                                  int threads) {
  float* x = layer.param.data();
  const float* momentum = layer.grad.data();
  float* m = layer.exp_avg.data();
  const float* v = layer.exp_avg_sq.data();
  float* vf = fresh.data();
  return reduce_chunks<Measures>(
      layer.param.size(), threads, Measures{},
      [x, momentum, m, v, vf, s](size_t begin, size_t end) {
        const optim::MomentCoefficients& c = s.frozen;
        SquareLanes param, direction, step;
        // A maximum per lane, as the sums: one running maximum would not vectorise.
        float ratio[kSquareLanes] = {};
        for (size_t i = begin; i < end; i += kSquareLanes) {
          const size_t len = std::min(kSquareLanes, end - i);
          for (size_t j = 0; j < len; ++j) {
            const size_t k = i + j;
            const float g = (momentum[k] - c.beta1 * m[k]) * s.inverse_one_minus_beta1;
            vf[k] = c.beta2 * vf[k] + c.one_minus_beta2 * (g * g);
            m[k] = momentum[k];
            const float frozen_denominator = std::sqrt(v[k]) * c.second_scale + c.eps;
            const float fresh_denominator = std::sqrt(vf[k]) * s.fresh_second_scale + c.eps;
            ratio[j] = std::max(ratio[j], frozen_denominator / fresh_denominator);
            // bounded_direction's arithmetic on the denominator at hand (the same bits as the
            // second pass's step, one square root fewer)
            const float inverse = 1.0f / frozen_denominator;
            const float u = std::clamp(m[k] * c.first_scale * inverse, -s.bound, s.bound);
            param.add(j, x[k]);
            direction.add(j, u);
            step.add(j, u + c.weight_decay * x[k]);
          }
        }
        return Measures{param.total(), direction.total(), step.total(),
                        *std::max_element(ratio, ratio + kSquareLanes)};
      },
      Measures::fold);
}

// The factor from the layer's measures: the largest ratio, moved towards 1 by the weight decay's
// share of the step (the variance says nothing about that part), within the bounds and within
// the threshold of the last factor (the paper's soft thresholds: one step's outlier coordinate
// must not jolt the layer).
double next_factor(const Measures& measures, double last, const OneBitLambHyper& lh) {
  double factor = measures.ratio;
  if (measures.step > 0) {
    const double share = std::min(1.0, std::sqrt(measures.direction / measures.step));
    factor = factor * share + (1.0 - share);
  }
  factor = std::clamp(factor, lh.factor_min, lh.factor_max);
  return std::clamp(factor, last * (1.0 - lh.factor_threshold), last * (1.0 + lh.factor_threshold));
}

}  // namespace

LayerStep onebit_lamb_step(const LayerSlot& layer, OneBitLambLayer& state, int64_t step,
                           int64_t frozen_at, const AdamHyper& h, const OneBitLambHyper& lh,
                           int threads) {
  check_onebit_lamb_hyper(lh, kName);
  const Scales scales{optim::counted_variance_coefficients(h, step, frozen_at, kName),
                      optim::moment_coefficients(h, step).second_scale,
                      static_cast<float>(1.0 / (1.0 - h.beta1)), optim::adam_step_bound(h)};
  check(layer, state);
  const Measures measures =
      update_onebit_lamb_layer(layer, state.fresh_exp_avg_sq, scales, threads);
  // A NaN ratio (a non-finite momentum) would pass the clamps: keep the last factor instead.
  if (std::isfinite(measures.ratio)) state.factor = next_factor(measures, state.factor, lh);

  LayerStep result;
  result.param_norm = std::sqrt(measures.param);
  result.trust_ratio = state.coeff * state.factor;
  const auto scale = static_cast<float>(h.lr * result.trust_ratio);
  const auto c = scales.frozen;
  const float bound = scales.bound;
  float* x = layer.param.data();
  const float* m = layer.exp_avg.data();
  const float* v = layer.exp_avg_sq.data();
  for_chunks(layer.param.size(), threads, [x, m, v, c, bound, scale](size_t b, size_t e, size_t) {
    for (size_t k = b; k < e; ++k) x[k] -= scale * optim::bounded_step(m[k], v[k], x[k], c, bound);
  });
  return result;
}

}  // namespace gradcomp
