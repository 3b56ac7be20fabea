// Adaptive optimizer updates: LAMB and LANS, the fused kernels behind gradcomp.torch.LAMB / LANS
// and gradcomp::torch::LAMB / LANS, and the two stages of 1-bit Adam (gradcomp.torch.OneBitAdam)
// (docs/optimizers.md).
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

}  // namespace gradcomp
