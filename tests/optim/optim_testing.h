// What the LAMB and LANS tests share: a layer with its own storage, filled from a seed, and a
// straightforward double-precision statement of the two updates to compare the kernels with.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gradcomp/optimizer.h"

namespace gradcomp::testing {

struct Layer {
  std::vector<float> param, grad, exp_avg, exp_avg_sq;

  explicit Layer(size_t n) : param(n), grad(n), exp_avg(n), exp_avg_sq(n) {}
  LayerSlot slot() { return {param, grad, exp_avg, exp_avg_sq}; }

  // Parameters around `scale`, a new gradient per call.
  void fill_param(uint32_t seed, float scale = 1.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, scale);
    for (float& x : param) x = normal(rng);
  }
  void fill_grad(uint32_t seed, float scale = 1e-3f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, scale);
    for (float& g : grad) g = normal(rng);
  }
};

// Largest |a - b| relative to the largest |b|.
inline double relative_gap(const std::vector<float>& a, const std::vector<double>& b) {
  double gap = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    gap = std::max(gap, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return gap / scale;
}

inline double norm(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}

inline double ratio(double param_norm, double step_norm) {
  return param_norm > 0 && step_norm > 0 ? param_norm / step_norm : 1.0;
}

// The reference: the papers' update, every quantity a vector of doubles.
struct Reference {
  std::vector<double> param, exp_avg, exp_avg_sq;

  explicit Reference(const Layer& layer)
      : param(layer.param.begin(), layer.param.end()),
        exp_avg(layer.exp_avg.begin(), layer.exp_avg.end()),
        exp_avg_sq(layer.exp_avg_sq.begin(), layer.exp_avg_sq.end()) {}

  // LANS when lans, else LAMB.
  void step(const std::vector<float>& grad_in, int64_t t, const AdamHyper& h, bool lans,
            bool normalize_grad) {
    const size_t n = param.size();
    std::vector<double> g(grad_in.begin(), grad_in.end());
    if (lans && normalize_grad) {
      const double gn = norm(g);
      for (double& x : g) x = gn > 0 ? x / gn : 0.0;
    }
    const double c1 = h.bias_correction ? 1 - std::pow(h.beta1, double(t)) : 1;
    const double c2 = h.bias_correction ? 1 - std::pow(h.beta2, double(t)) : 1;
    std::vector<double> r(n), c(n);
    for (size_t i = 0; i < n; ++i) {
      exp_avg[i] = h.beta1 * exp_avg[i] + (1 - h.beta1) * g[i];
      exp_avg_sq[i] = h.beta2 * exp_avg_sq[i] + (1 - h.beta2) * g[i] * g[i];
      const double denom = std::sqrt(exp_avg_sq[i] / c2) + h.eps;
      r[i] = exp_avg[i] / c1 / denom + h.weight_decay * param[i];
      c[i] = g[i] / denom + h.weight_decay * param[i];
    }
    const double pn = norm(param);
    const double rr = ratio(pn, norm(r));
    const double cr = ratio(pn, norm(c));
    for (size_t i = 0; i < n; ++i) {
      param[i] -= lans ? h.lr * (h.beta1 * rr * r[i] + (1 - h.beta1) * cr * c[i])
                       : h.lr * rr * r[i];
    }
  }
};

}  // namespace gradcomp::testing
