// What the optimizers' kernels share: Adam's moment update with bias correction, the
// per-coordinate direction m^ / (sqrt(v^) + eps), the layer's trust ratio. Their norms are
// fixed-order sums of squares (common/square_sums.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/square_sums.h"
#include "gradcomp/optimizer.h"

namespace gradcomp::optim {

// The step's constants, in float as the per-element arithmetic is.
struct MomentCoefficients {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float first_scale;   // 1 / (1 - beta1^t), or 1 without bias correction
  float second_scale;  // 1 / sqrt(1 - beta2^t), or 1
  float eps, weight_decay;
};

MomentCoefficients moment_coefficients(const AdamHyper& h, int64_t step);

// Checks the slot's spans have one length and step >= 1; throws Error naming `optimizer`.
void check_layer(const LayerSlot& layer, int64_t step, std::string_view optimizer);

// m and v take the gradient g (in place).
inline void update_moments(float g, float& m, float& v, const MomentCoefficients& c) {
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * (g * g);
}

// 1 / (sqrt(v^) + eps): the per-coordinate scale Adam divides a direction by.
inline float inverse_scale(float v, const MomentCoefficients& c) {
  return 1.0f / (std::sqrt(v) * c.second_scale + c.eps);
}

// Adam's direction for one coordinate, with the decoupled weight decay: m^ / (sqrt(v^) + eps)
// + wd x. Both passes of a step call this, so the step applied is the one whose norm was taken.
inline float adam_direction(float m, float v, float x, const MomentCoefficients& c) {
  return m * c.first_scale * inverse_scale(v, c) + c.weight_decay * x;
}

// The coefficients of a step whose variance has had `variance_updates` updates (it is not
// updated every step: 1-bit Adam's, 1-bit LAMB's): the momentum's bias correction is this
// step's, the variance's that of its own count. Checks h, and 1 <= variance_updates <= step;
// throws naming `optimizer`.
MomentCoefficients counted_variance_coefficients(const AdamHyper& h, int64_t step,
                                                 int64_t variance_updates,
                                                 std::string_view optimizer);

// Adam's own step per coordinate is at most lr * max(1, (1 - b1) / sqrt(1 - b2)) (Kingma & Ba,
// section 2.1); a variance that is not updated every step has no such bound: a coordinate whose
// gradient was (nearly) 0 at its updates has a (nearly) zero v, and its next gradient would
// step by m / eps.
float adam_step_bound(const AdamHyper& h);

// Adam's direction of a coordinate whose moments are final, within +-bound.
inline float bounded_direction(float m, float v, const MomentCoefficients& c, float bound) {
  return std::clamp(m * c.first_scale * inverse_scale(v, c), -bound, bound);
}

// The bounded direction plus the weight decay: the step of a frozen-variance update.
inline float bounded_step(float m, float v, float x, const MomentCoefficients& c, float bound) {
  return bounded_direction(m, v, c, bound) + c.weight_decay * x;  // a NaN stays NaN
}

// ||x|| / ||u||, or 1 when either is 0 (a new zero-initialised layer, or no step to scale).
inline double trust_ratio(double param_norm, double step_norm) {
  return param_norm > 0 && step_norm > 0 ? param_norm / step_norm : 1.0;
}

}  // namespace gradcomp::optim
