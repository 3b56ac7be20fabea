#include "optim/adam_moments.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "gradcomp/error.h"

namespace gradcomp {

void check_adam_hyper(const AdamHyper& h, std::string_view optimizer) {
  const auto fail = [&](std::string_view what, double value, std::string_view allowed) {
    throw SpecError(fmt::format("{}: {} is {}; allowed: {}", optimizer, what, value, allowed));
  };
  if (!std::isfinite(h.lr) || h.lr < 0) fail("lr", h.lr, "a finite number >= 0");
  if (!(h.beta1 >= 0 && h.beta1 < 1)) fail("beta1", h.beta1, "0 <= beta1 < 1");
  if (!(h.beta2 >= 0 && h.beta2 < 1)) fail("beta2", h.beta2, "0 <= beta2 < 1");
  if (!std::isfinite(h.eps) || h.eps <= 0) fail("eps", h.eps, "a finite number > 0");
  if (!std::isfinite(h.weight_decay) || h.weight_decay < 0) {
    fail("weight_decay", h.weight_decay, "a finite number >= 0");
  }
}

namespace optim {

MomentCoefficients moment_coefficients(const AdamHyper& h, int64_t step) {
  const auto t = static_cast<double>(step);
  const double first = h.bias_correction ? 1.0 / (1.0 - std::pow(h.beta1, t)) : 1.0;
  const double second = h.bias_correction ? 1.0 / std::sqrt(1.0 - std::pow(h.beta2, t)) : 1.0;
  return {static_cast<float>(h.beta1), static_cast<float>(1.0 - h.beta1),
          static_cast<float>(h.beta2), static_cast<float>(1.0 - h.beta2),
          static_cast<float>(first),   static_cast<float>(second),
          static_cast<float>(h.eps),   static_cast<float>(h.weight_decay)};
}

MomentCoefficients counted_variance_coefficients(const AdamHyper& h, int64_t step,
                                                 int64_t variance_updates,
                                                 std::string_view optimizer) {
  check_adam_hyper(h, optimizer);
  if (variance_updates < 1 || variance_updates > step) {
    throw Error(fmt::format("{}: a variance updated {} times cannot serve step {}; allowed: 1 <= "
                            "variance updates <= step",
                            optimizer, variance_updates, step));
  }
  MomentCoefficients c = moment_coefficients(h, step);
  c.second_scale = moment_coefficients(h, variance_updates).second_scale;
  return c;
}

float adam_step_bound(const AdamHyper& h) {
  return static_cast<float>(std::max(1.0, (1.0 - h.beta1) / std::sqrt(1.0 - h.beta2)));
}

void check_layer(const LayerSlot& layer, int64_t step, std::string_view optimizer) {
  const size_t n = layer.param.size();
  if (layer.grad.size() != n || layer.exp_avg.size() != n || layer.exp_avg_sq.size() != n) {
    throw Error(fmt::format(
        "{}: a layer's parameter, gradient and moments must have one length; got {}, {}, {}, {}",
        optimizer, n, layer.grad.size(), layer.exp_avg.size(), layer.exp_avg_sq.size()));
  }
  if (step < 1) {
    throw Error(fmt::format("{}: step is {}; allowed: 1 for the first step, then 2, 3, ...",
                            optimizer, step));
  }
}

}  // namespace optim
}  // namespace gradcomp
