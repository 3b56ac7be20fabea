// LAMB: Adam's direction plus decoupled weight decay, scaled per layer by ||x|| / ||r||.
// Two passes over the layer: the first updates the moments and takes both norms, the second
// applies the step (the trust ratio needs the whole layer's ||r|| before any coordinate moves).
#include <algorithm>
#include <cmath>

#include "common/parallel.h"
#include "optim/adam_moments.h"

namespace gradcomp {
namespace {

struct Norms {
  double param = 0;  // sum of x^2
  double step = 0;   // sum of r^2
};

Norms update_lamb_layer(const LayerSlot& layer, const optim::MomentCoefficients& c, int threads) {
  float* x = layer.param.data();
  const float* g = layer.grad.data();
  float* m = layer.exp_avg.data();
  float* v = layer.exp_avg_sq.data();
  return reduce_chunks<Norms>(
      layer.param.size(), threads, Norms{},
      [x, g, m, v, c](size_t begin, size_t end) {
        SquareLanes param, step;
        for (size_t i = begin; i < end; i += kSquareLanes) {
          const size_t len = std::min(kSquareLanes, end - i);
          for (size_t j = 0; j < len; ++j) {
            const size_t k = i + j;
            optim::update_moments(g[k], m[k], v[k], c);
            param.add(j, x[k]);
            step.add(j, optim::adam_direction(m[k], v[k], x[k], c));
          }
        }
        return Norms{param.total(), step.total()};
      },
      [](Norms a, Norms b) {
        return Norms{a.param + b.param, a.step + b.step};
      });
}

}  // namespace

LayerStep lamb_step(const LayerSlot& layer, int64_t step, const AdamHyper& h, int threads) {
  check_adam_hyper(h, "LAMB");
  optim::check_layer(layer, step, "LAMB");
  const auto c = optim::moment_coefficients(h, step);
  const Norms norms = update_lamb_layer(layer, c, threads);

  LayerStep result;
  result.param_norm = std::sqrt(norms.param);
  result.trust_ratio = optim::trust_ratio(result.param_norm, std::sqrt(norms.step));
  const auto scale = static_cast<float>(h.lr * result.trust_ratio);
  float* x = layer.param.data();
  const float* m = layer.exp_avg.data();
  const float* v = layer.exp_avg_sq.data();
  for_chunks(layer.param.size(), threads, [x, m, v, c, scale](size_t begin, size_t end, size_t) {
    for (size_t k = begin; k < end; ++k) x[k] -= scale * optim::adam_direction(m[k], v[k], x[k], c);
  });
  return result;
}

}  // namespace gradcomp
