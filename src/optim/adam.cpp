// AdamW and the frozen-variance step of 1-bit Adam: one pass each, on Adam's direction.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string_view>

#include "common/parallel.h"
#include "gradcomp/error.h"
#include "optim/adam_moments.h"

namespace gradcomp {

void adamw_step(const LayerSlot& layer, int64_t step, const AdamHyper& h, int threads) {
  check_adam_hyper(h, "AdamW");
  optim::check_layer(layer, step, "AdamW");
  const auto c = optim::moment_coefficients(h, step);
  const auto lr = static_cast<float>(h.lr);
  float* x = layer.param.data();
  const float* g = layer.grad.data();
  float* m = layer.exp_avg.data();
  float* v = layer.exp_avg_sq.data();
  // The pointers by value: read through a reference capture, they would be reloaded after
  // every store (the stores might alias them), and the loop would not vectorise.
  for_chunks(layer.param.size(), threads, [x, g, m, v, c, lr](size_t begin, size_t end, size_t) {
    for (size_t k = begin; k < end; ++k) {
      optim::update_moments(g[k], m[k], v[k], c);
      x[k] -= lr * optim::adam_direction(m[k], v[k], x[k], c);
    }
  });
}


void frozen_adam_step(const LayerSlot& layer, int64_t step, int64_t frozen_at, const AdamHyper& h,
                      int threads) {
  const auto c = optim::counted_variance_coefficients(h, step, frozen_at, "OneBitAdam");
  const size_t n = layer.param.size();
  if (layer.exp_avg.size() != n || layer.exp_avg_sq.size() != n) {
    throw Error(
        fmt::format("OneBitAdam: a layer's parameter and moments must have one length; "
                    "got {}, {}, {}",
                    n, layer.exp_avg.size(), layer.exp_avg_sq.size()));
  }
  const float bound = optim::adam_step_bound(h);
  const auto lr = static_cast<float>(h.lr);
  float* x = layer.param.data();
  const float* m = layer.exp_avg.data();
  const float* v = layer.exp_avg_sq.data();
  for_chunks(n, threads, [x, m, v, c, bound, lr](size_t begin, size_t end, size_t) {
    for (size_t k = begin; k < end; ++k) x[k] -= lr * optim::bounded_step(m[k], v[k], x[k], c, bound);
  });
}

void zero_one_adam_step(const LayerSlot& layer, int64_t step, int64_t variance_updates,
                        bool update_variance, const AdamHyper& h, int threads) {
  const auto c = optim::counted_variance_coefficients(h, step, variance_updates, "OneBitAdam");
  optim::check_layer(layer, step, "OneBitAdam");
  const float bound = optim::adam_step_bound(h);
  const auto lr = static_cast<float>(h.lr);
  float* x = layer.param.data();
  const float* g = layer.grad.data();
  float* m = layer.exp_avg.data();
  float* v = layer.exp_avg_sq.data();
  // Two loops rather than a branch per element, so that each vectorises.
  if (update_variance) {
    for_chunks(layer.param.size(), threads, [x, g, m, v, c, bound, lr](size_t b, size_t e, size_t) {
      for (size_t k = b; k < e; ++k) {
        optim::update_moments(g[k], m[k], v[k], c);
        x[k] -= lr * optim::bounded_step(m[k], v[k], x[k], c, bound);
      }
    });
    return;
  }
  for_chunks(layer.param.size(), threads, [x, g, m, v, c, bound, lr](size_t b, size_t e, size_t) {
    for (size_t k = b; k < e; ++k) {
      m[k] = c.beta1 * m[k] + c.one_minus_beta1 * g[k];
      x[k] -= lr * optim::bounded_step(m[k], v[k], x[k], c, bound);
    }
  });
}

}  // namespace gradcomp
