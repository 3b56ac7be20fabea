// nesterov: Nesterov momentum applied before compression (BytePS's momentum decorator, as in
// dist-EF-SGDM), optionally with error feedback on top.
//
//   m <- mu * m + g          (m[i] = fma(mu, m[i], g[i]))
//   p  = g + mu * m          (fma(mu, m[i], g[i]))
//   ef=true:  p = (g + mu * m) + e, and the codec writes the new e = p - D(C(p)) into
//             residual(), which aliases p.
// The optimizer must then run without its own momentum (it is applied here).
// Parameters: momentum mu in [0, 1) (default 0.9), ef (default false).
// State: m, and e when ef=true (format in state_io.h).
#include <cmath>

#include "feedback/factories.h"
#include "feedback/state_io.h"
#include "gradcomp/spec.h"

namespace gradcomp {
namespace {

class NesterovFeedback final : public Feedback {
 public:
  NesterovFeedback(double momentum, bool ef) : mu_(momentum), ef_(ef) {}

  std::string spec() const override {
    return fmt::format("nesterov:momentum={},ef={}", format_number(mu_), ef_ ? "true" : "false");
  }

  std::span<const float> compensate(std::span<const float> grad, const StepInfo&) override {
    memory_.fit(grad.size(), {&m_, &p_});
    const auto mu = static_cast<float>(mu_);
    const float* g = grad.data();
    float* m = m_.data();
    float* p = p_.data();  // holds e between steps when ef=true
    const size_t n = grad.size();
    for (size_t i = 0; i < n; ++i) m[i] = std::fma(mu, m[i], g[i]);
    if (ef_) {
      for (size_t i = 0; i < n; ++i) p[i] = std::fma(mu, m[i], g[i]) + p[i];
    } else {
      for (size_t i = 0; i < n; ++i) p[i] = std::fma(mu, m[i], g[i]);
    }
    return p_;
  }

  std::span<float> residual() override { return ef_ ? std::span<float>(p_) : std::span<float>(); }

  std::vector<std::byte> save_state() const override {
    return ef_ ? memory_.save({&m_, &p_}) : memory_.save({&m_});
  }
  void load_state(std::span<const std::byte> state) override {
    if (ef_) {
      memory_.load(state, {&m_, &p_});
    } else {
      memory_.load(state, {&m_});
      p_.assign(m_.size(), 0.0f);  // scratch only
    }
  }

 private:
  double mu_;
  bool ef_;
  std::vector<float> m_;  // momentum
  std::vector<float> p_;  // the vector to compress; e between steps when ef=true
  feedback::Memory memory_{"nesterov", feedback::FeedbackKind::kNesterov};
};

}  // namespace

std::unique_ptr<Feedback> make_nesterov_feedback(Spec& spec) {
  const double momentum = spec.get_double("momentum", 0.9, 0.0, 1.0, false, true);
  const bool ef = spec.get_bool("ef", false);
  return std::make_unique<NesterovFeedback>(momentum, ef);
}

}  // namespace gradcomp
