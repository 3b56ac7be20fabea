// LANS: LAMB's momentum direction r and the current gradient's own direction c, each scaled by
// its trust ratio, blended beta1 : (1 - beta1) (Nesterov's look-ahead written for Adam). The
// gradient is first scaled to unit norm per layer (normalize_grad), which makes the step
// independent of the gradient's scale, and so of a codec's scaling error.
#include <algorithm>
#include <cmath>

#include "common/parallel.h"
#include "optim/adam_moments.h"

namespace gradcomp {
namespace {

struct Norms {
  double param = 0;     // sum of x^2
  double momentum = 0;  // sum of r^2
  double gradient = 0;  // sum of c^2
};

Norms add(Norms a, Norms b) {
  return {a.param + b.param, a.momentum + b.momentum, a.gradient + b.gradient};
}

// 1 / ||g|| (0 for an all-zero gradient, which stays zero).
float inverse_grad_norm(std::span<const float> g, int threads) {
  const double sum = reduce_chunks<double>(
      g.size(), threads, 0.0, [&](size_t b, size_t e) { return sum_squares(g.data() + b, e - b); },
      [](double a, double b) { return a + b; });
  return sum > 0 ? static_cast<float>(1.0 / std::sqrt(sum)) : 0.0f;
}

// The gradient direction of one coordinate: g' / (sqrt(v^) + eps) + wd x.
float gradient_direction(float g, float v, float x, const optim::MomentCoefficients& c) {
  return g * optim::inverse_scale(v, c) + c.weight_decay * x;
}

Norms update_lans_layer(const LayerSlot& layer, float grad_scale,
                        const optim::MomentCoefficients& c, int threads) {
  float* x = layer.param.data();
  const float* g = layer.grad.data();
  float* m = layer.exp_avg.data();
  float* v = layer.exp_avg_sq.data();
  return reduce_chunks<Norms>(
      layer.param.size(), threads, Norms{},
      [x, g, m, v, c, grad_scale](size_t begin, size_t end) {
        SquareLanes param, momentum, gradient;
        for (size_t i = begin; i < end; i += kSquareLanes) {
          const size_t len = std::min(kSquareLanes, end - i);
          for (size_t j = 0; j < len; ++j) {
            const size_t k = i + j;
            const float gk = g[k] * grad_scale;
            optim::update_moments(gk, m[k], v[k], c);
            param.add(j, x[k]);
            momentum.add(j, optim::adam_direction(m[k], v[k], x[k], c));
            gradient.add(j, gradient_direction(gk, v[k], x[k], c));
          }
        }
        return Norms{param.total(), momentum.total(), gradient.total()};
      },
      add);
}

}  // namespace

LayerStep lans_step(const LayerSlot& layer, int64_t step, const AdamHyper& h, bool normalize_grad,
                    int threads) {
  check_adam_hyper(h, "LANS");
  optim::check_layer(layer, step, "LANS");
  const auto c = optim::moment_coefficients(h, step);
  const float grad_scale = normalize_grad ? inverse_grad_norm(layer.grad, threads) : 1.0f;
  const Norms norms = update_lans_layer(layer, grad_scale, c, threads);

  LayerStep result;
  result.param_norm = std::sqrt(norms.param);
  result.trust_ratio = optim::trust_ratio(result.param_norm, std::sqrt(norms.momentum));
  result.grad_trust = optim::trust_ratio(result.param_norm, std::sqrt(norms.gradient));
  const auto momentum_scale = static_cast<float>(h.lr * h.beta1 * result.trust_ratio);
  const auto gradient_scale = static_cast<float>(h.lr * (1.0 - h.beta1) * result.grad_trust);
  float* x = layer.param.data();
  const float* g = layer.grad.data();
  const float* m = layer.exp_avg.data();
  const float* v = layer.exp_avg_sq.data();
  for_chunks(layer.param.size(), threads, [=](size_t begin, size_t end, size_t) {
    for (size_t k = begin; k < end; ++k) {
      const float r = optim::adam_direction(m[k], v[k], x[k], c);
      const float d = gradient_direction(g[k] * grad_scale, v[k], x[k], c);
      x[k] -= momentum_scale * r + gradient_scale * d;
    }
  });
  return result;
}

}  // namespace gradcomp
