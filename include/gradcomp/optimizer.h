// Adaptive optimizer updates: LAMB and LANS, the fused kernels behind gradcomp.torch.LAMB / LANS
// and gradcomp::torch::LAMB / LANS, the two stages of 1-bit Adam (gradcomp.torch.OneBitAdam)
// and 1-bit LAMB's compression stage (gradcomp.torch.OneBitLamb) (docs/optimizers.md).
//
// Both keep Adam's moments per coordinate and scale each layer's (each parameter tensor's) step
// by a trust ratio ||x|| / ||step||, so every layer moves by about lr times its own norm
// whatever the scale of its gradient: what lets large batches (and gradients whose scale a
// codec changed) train at one learning rate. The update is a pure function of the parameter,
// the gradient, the moments and the step number: ranks that hold the same values and apply
// the same averaged gradient stay bit-identical, on any thread count.
//
// The kernels take plain float spans of one tensor; a device implementation (a CUDA kernel)
// would implement the same functions over device memory.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace gradcomp {

// Adam's hyper-parameters, shared by LAMB and LANS. weight_decay is decoupled (AdamW's): it is
// added to the step before the trust ratio, as in the LAMB paper.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-6;
  double weight_decay = 0.01;
  bool bias_correction = true;  // divide the moments by 1 - beta^t
};

// One layer: its parameter (updated in place), its gradient, and its moments (updated in
// place, zero before the first step). Every span has the same length.
struct LayerSlot {
  std::span<float> param;
  std::span<const float> grad;
  std::span<float> exp_avg;     // m, the first moment
  std::span<float> exp_avg_sq;  // v, the second moment
};

// What a step did to the layer, for logs and tests.
struct LayerStep {
  double param_norm = 0;    // ||x|| before the step
  double trust_ratio = 1;   // LAMB: ||x|| / ||r||; LANS: that of the momentum direction
  double grad_trust = 1;    // LANS: that of the gradient direction (1 for LAMB)
};

// Throws SpecError naming `optimizer` and the parameter when h is out of range: lr and
// weight_decay finite and >= 0, 0 <= beta < 1, eps finite and > 0.
void check_adam_hyper(const AdamHyper& h, std::string_view optimizer);

// LAMB (You et al. 2019), step number `step` (1 for the first):
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  r = m^ / (sqrt(v^) + eps) + wd x
//   x -= lr * (||x|| / ||r||) * r        (the ratio is 1 when either norm is 0)
// `threads` parallelises over fixed chunks; the result does not depend on it.
LayerStep lamb_step(const LayerSlot& layer, int64_t step, const AdamHyper& h, int threads = 1);

// LANS (Zheng et al. 2020), LAMB with a Nesterov-style blend of the momentum direction and the
// current gradient's, each with its own trust ratio:
//   g' = g / ||g|| when normalize_grad (the layer's gradient to unit norm), else g
//   m, v as LAMB's from g';  r = m^ / (sqrt(v^) + eps) + wd x;  c = g' / (sqrt(v^) + eps) + wd x
//   x -= lr * (b1 * (||x|| / ||r||) * r + (1 - b1) * (||x|| / ||c||) * c)
LayerStep lans_step(const LayerSlot& layer, int64_t step, const AdamHyper& h,
                    bool normalize_grad = true, int threads = 1);

// AdamW (Loshchilov & Hutter), one pass: m, v as LAMB's; x -= lr * (m^ / (sqrt(v^) + eps) + wd x).
// 1-bit Adam's warm-up stage.
void adamw_step(const LayerSlot& layer, int64_t step, const AdamHyper& h, int threads = 1);

// 1-bit Adam's compression stage (Tang et al. 2021): the variance was frozen after step
// `frozen_at` (v = layer.exp_avg_sq as it was then, bias-corrected as at that step) and
// layer.exp_avg already holds this step's momentum (averaged over the ranks), so only x moves:
//   x -= lr * (clamp(m^ / (sqrt(v / (1 - b2^frozen_at)) + eps), +-B) + wd x),
//   m^ = m / (1 - b1^step),  B = max(1, (1 - b1) / sqrt(1 - b2)),
// B being the bound on Adam's own step per coordinate (Kingma & Ba, section 2.1): a coordinate
// whose v froze (nearly) zero would otherwise step by m / eps.
// frozen_at is the variance's number of updates: the step it froze at, or (0/1 Adam's policy)
// how many exact steps have updated it so far. layer.grad is not read (it may be empty).
// Throws Error unless 1 <= frozen_at <= step.
void frozen_adam_step(const LayerSlot& layer, int64_t step, int64_t frozen_at, const AdamHyper& h,
                      int threads = 1);

// 0/1 Adam's step (Lu et al. 2022): the variance is updated only on the steps whose gradient was
// averaged exactly (update_variance), at intervals that grow, and is corrected by its own number
// of updates; the momentum takes every step's averaged gradient g (compressed on the others):
//   m = b1 m + (1 - b1) g;  if update_variance: v = b2 v + (1 - b2) g^2
//   x -= lr * (clamp(m^ / (sqrt(v / (1 - b2^k)) + eps), +-B) + wd x)
// with m^, B as frozen_adam_step's and k = variance_updates, this step's update included.
// Throws Error unless 1 <= variance_updates <= step.
void zero_one_adam_step(const LayerSlot& layer, int64_t step, int64_t variance_updates,
                        bool update_variance, const AdamHyper& h, int threads = 1);

// 1-bit LAMB's compression stage (Li et al. 2021): LAMB whose variance froze after a warm-up of
// exact steps, whose momentum is exchanged in 1-bit codes, and whose per-layer coefficient (the
// trust ratio, which a compressed momentum's noisy norm would make noisy) froze too: at the
// average of the warm-up's ratios, then scaled by a factor that follows how far the gradients'
// scale has moved since. The gradient is reconstructed from two consecutive averaged momenta,
// g~ = (m_t - b1 m_{t-1}) / (1 - b1), and feeds a fresh variance v' (v at the freeze to begin
// with); the factor is the largest ratio over the layer of the frozen to the fresh
// denominator (how much larger a step live Adam would take), held within soft bounds.
struct OneBitLambHyper {
  double coeff_beta = 0.9;         // warm-up: the trust ratios' moving-average decay
  double max_coeff = 10.0;         // the frozen coefficient's bounds
  double min_coeff = 0.01;
  double factor_max = 4.0;         // the factor's bounds
  double factor_min = 0.5;
  double factor_threshold = 0.1;   // the factor changes by at most this share per step
};

// Throws SpecError naming `optimizer` when h is out of range: 0 <= coeff_beta < 1,
// 0 < min_coeff <= max_coeff, 0 < factor_min <= 1 <= factor_max, factor_threshold >= 0, all
// finite.
void check_onebit_lamb_hyper(const OneBitLambHyper& h, std::string_view optimizer);

// What a layer carries through the compression stage besides its moments.
struct OneBitLambLayer {
  double coeff = 1;                   // the frozen coefficient (the warm-up's average ratio)
  double factor = 1;                  // the last step's factor; 1 at the freeze
  std::span<float> fresh_exp_avg_sq;  // v', as long as the layer
};

// One compression-stage step. layer.grad holds this step's averaged momentum m_t; layer.exp_avg
// holds the last step's (m_{t-1}) and takes m_t; layer.exp_avg_sq is v as it froze after
// `frozen_at` updates. With u = clamp(m^ / (sqrt(v^) + eps), +-B) (m^, B as in
// frozen_adam_step) and d = u + wd x:
//   v' = b2 v' + (1 - b2) g~^2                       (corrected as of `step` updates)
//   f = max_k (sqrt(v^_k) + eps) / (sqrt(v'^_k) + eps), moved towards 1 by the share of the
//       step that is weight decay (f = f r + 1 - r, r = min(1, ||u|| / ||d||)), then within
//       [factor_min, factor_max] and within factor_threshold of the last factor
//   x -= lr * coeff * f * d
// Updates state.factor; returns the layer's norm and the coefficient applied (coeff * f) as
// the trust ratio. Throws Error unless 1 <= frozen_at <= step, the spans have one length and
// coeff and factor are finite and > 0.
LayerStep onebit_lamb_step(const LayerSlot& layer, OneBitLambLayer& state, int64_t step,
                           int64_t frozen_at, const AdamHyper& h, const OneBitLambHyper& lh,
                           int threads = 1);

}  // namespace gradcomp
