// AdamW and the frozen-variance step of 1-bit Adam: one pass each, on Adam's direction.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

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
  check_adam_hyper(h, "OneBitAdam");
  const size_t n = layer.param.size();
  if (layer.exp_avg.size() != n || layer.exp_avg_sq.size() != n) {
    throw Error(
        fmt::format("OneBitAdam: a layer's parameter and moments must have one length; "
                    "got {}, {}, {}",
                    n, layer.exp_avg.size(), layer.exp_avg_sq.size()));
  }
  if (frozen_at < 1 || frozen_at >= step) {
    throw Error(
        fmt::format("OneBitAdam: the variance frozen at step {} cannot serve step {}; "
                    "allowed: 1 <= frozen_at < step",
                    frozen_at, step));
  }
  // The momentum's bias correction is this step's, the variance's that of the step it froze at.
  optim::MomentCoefficients c = optim::moment_coefficients(h, step);
  c.second_scale = optim::moment_coefficients(h, frozen_at).second_scale;
  // Adam's own step per coordinate is at most lr * max(1, (1 - b1) / sqrt(1 - b2)) (Kingma &
  // Ba, section 2.1); a frozen v has no such bound: a coordinate whose gradient was (nearly) 0
  // in the warm-up has a (nearly) zero v, and its first gradient after it would step by m / eps.
  const auto bound = static_cast<float>(std::max(1.0, (1.0 - h.beta1) / std::sqrt(1.0 - h.beta2)));
  const auto lr = static_cast<float>(h.lr);
  float* x = layer.param.data();
  const float* m = layer.exp_avg.data();
  const float* v = layer.exp_avg_sq.data();
  for_chunks(n, threads, [x, m, v, c, bound, lr](size_t begin, size_t end, size_t) {
    for (size_t k = begin; k < end; ++k) {
      const float step = std::clamp(m[k] * c.first_scale * optim::inverse_scale(v[k], c), -bound,
                                    bound);  // a NaN stays NaN
      x[k] -= lr * (step + c.weight_decay * x[k]);
    }
  });
}

}  // namespace gradcomp
