// nesterov: Nesterov momentum applied before compression (BytePS's momentum decorator, as in
// dist-EF-SGDM), optionally with error feedback on top.
//
//   m <- mu * k * m + g      (m[i] = fma(mu k, m[i], g[i]))
//   p  = g + mu * m          (fma(mu, m[i], g[i]))
//   ef=true:  p = (g + mu * m) + k * e (fma(k, e[i], fma(mu, m[i], g[i]))), and the codec
//             writes the new e = p - D(C(p)) into residual(), which aliases p.
// k = scale / prev_scale is the loss-scale ratio (1 when unknown; an exact 1 changes no bit).
// The new m (and e) are written into spare buffers that are then swapped in, so the old ones
// stay for discard() (a swap back, no pass over the data).
// The optimizer must then run without its own momentum (it is applied here).
// Parameters: momentum mu in [0, 1) (default 0.9), ef (default false).
// State: m, and e when ef=true (format in memory.h); the spares are not state.
#include <cmath>

#include "feedback/factories.h"
#include "feedback/memory.h"
#include "gradcomp/spec.h"

namespace gradcomp {
namespace {

class NesterovFeedback final : public Feedback {
 public:
  NesterovFeedback(double momentum, bool ef) : mu_(momentum), ef_(ef) {}

  std::string spec() const override {
    return fmt::format("nesterov:momentum={},ef={}", format_number(mu_), ef_ ? "true" : "false");
  }

  std::span<const float> compensate(std::span<const float> grad, const StepInfo& info) override {
    if (ef_) {
      memory_.fit(grad.size(), {&m_, &p_, &m_old_, &e_old_});
    } else {
      memory_.fit(grad.size(), {&m_, &p_, &m_old_});
    }
    m_.swap(m_old_);  // the new m goes into the spare; the old one stays for discard()
    const double k = feedback::loss_scale_ratio(info);
    const auto mu = static_cast<float>(mu_);
    const auto muk = static_cast<float>(mu_ * k);
    const float* g = grad.data();
    const float* m0 = m_old_.data();
    float* m = m_.data();
    const size_t n = grad.size();
    for (size_t i = 0; i < n; ++i) m[i] = std::fma(muk, m0[i], g[i]);
    if (ef_) {
      p_.swap(e_old_);  // likewise e, which p_ held between steps
      const auto kf = static_cast<float>(k);
      const float* e = e_old_.data();
      float* p = p_.data();
      for (size_t i = 0; i < n; ++i) p[i] = std::fma(kf, e[i], std::fma(mu, m[i], g[i]));
    } else {
      float* p = p_.data();
      for (size_t i = 0; i < n; ++i) p[i] = std::fma(mu, m[i], g[i]);
    }
    return p_;
  }

  std::span<float> residual() override { return ef_ ? std::span<float>(p_) : std::span<float>(); }

  // e (held in p_ between steps) when ef=true; m is history.
  void add_unsent(std::span<float> into) const override {
    if (ef_) feedback::add_into(into, p_, "nesterov");
  }

  void discard() override {
    memory_.discard_step();
    m_.swap(m_old_);
    if (ef_) p_.swap(e_old_);
  }

  size_t memory_bytes() const override {
    return feedback::buffer_bytes({&m_, &p_, &m_old_, &e_old_});
  }

  std::vector<std::byte> save_state() const override {
    return ef_ ? memory_.save({&m_, &p_}) : memory_.save({&m_});
  }
  void load_state(std::span<const std::byte> state) override {
    if (ef_) {
      memory_.load(state, {&m_, &p_}, {&m_old_, &e_old_});
    } else {
      memory_.load(state, {&m_}, {&p_, &m_old_});  // p_ is scratch only
    }
  }

 private:
  double mu_;
  bool ef_;
  Buffer<float> m_;  // momentum
  Buffer<float> p_;  // the vector to compress; e between steps when ef=true
  Buffer<float> m_old_, e_old_;  // m and e before the last compensate(), for discard()
  feedback::Memory memory_{"nesterov", feedback::FeedbackKind::kNesterov};
};

}  // namespace

std::unique_ptr<Feedback> make_nesterov_feedback(Spec& spec) {
  const double momentum = spec.get_double("momentum", 0.9, 0.0, 1.0, false, true);
  const bool ef = spec.get_bool("ef", false);
  return std::make_unique<NesterovFeedback>(momentum, ef);
}

}  // namespace gradcomp
