// dgc: the memory of Deep Gradient Compression (Lin et al., ICLR 2018): momentum correction,
// local gradient clipping and momentum-factor masking, around any codec.
//
// compensate(g):
//   clipping (clip > 0): threshold T = clip / sqrt(world_size); with ||g||_2 (summed in double,
//     fixed order) above T and finite, g' = g * (T / ||g||) (factor rounded to float), else g' = g
//   (the threshold is in unscaled units: it is multiplied by the step's loss scale)
//   momentum correction, u = momentum buffer, v = accumulated velocity, m = momentum, and
//   k = scale / prev_scale, the loss-scale ratio (1 when unknown; exact 1 changes no bit):
//     nesterov=false:  u = fma(m k, u, g');      v = fma(k, v, u)
//     nesterov=true:   u = fma(k, u, g') * m;    v = fma(k, v, u) + g'   (the DGC reference
//                                                                           code's variant)
//   returns v, to be compressed.
// residual() is a separate buffer r: the codec writes r = v - D(C(v)).
// commit(): momentum-factor masking, u[i] = 0 wherever r[i] != v[i] (the codec sent something
//   there), then v <- r (the unsent remainder stays accumulated; a buffer swap). masking=false
//   keeps u where sent: the coordinates sent most often then keep their momentum, where the
//   paper's masking restarts it at every send (an ablation: on the Fashion-MNIST CNN masking
//   costs accuracy, docs/accuracy.md).
// compensate() writes the new u and v into spare buffers and swaps, so the old u and v stay
// there for discard() (a swap back): five buffers of n floats instead of three.
// Parameters: momentum in [0, 1) (default 0.9), clip >= 0 (default 0 = off), nesterov (false),
// masking (true; spelt out in the spec only when false, so existing specs keep their text).
// State: u and v (format in memory.h); r and the spares are scratch.
#include <cmath>

#include "feedback/factories.h"
#include "feedback/memory.h"
#include "gradcomp/spec.h"

namespace gradcomp {
namespace {

// ||x||_2 in double with 8 fixed lanes: the same value on every build and thread count.
double l2_norm(std::span<const float> x) {
  double acc[8] = {};
  size_t i = 0;
  for (; i + 8 <= x.size(); i += 8) {
    for (size_t j = 0; j < 8; ++j) acc[j] += double{x[i + j]} * x[i + j];
  }
  for (size_t j = 0; i + j < x.size(); ++j) acc[j] += double{x[i + j]} * x[i + j];
  return std::sqrt(((acc[0] + acc[4]) + (acc[2] + acc[6])) +
                   ((acc[1] + acc[5]) + (acc[3] + acc[7])));
}

class DgcFeedback final : public Feedback {
 public:
  DgcFeedback(double momentum, double clip, bool nesterov, bool masking)
      : momentum_(momentum), clip_(clip), nesterov_(nesterov), masking_(masking) {}

  std::string spec() const override {
    return fmt::format("dgc:momentum={},clip={},nesterov={}{}", format_number(momentum_),
                       format_number(clip_), nesterov_ ? "true" : "false",
                       masking_ ? "" : ",masking=false");
  }

  std::span<const float> compensate(std::span<const float> grad, const StepInfo& info) override {
    memory_.fit(grad.size(), {&u_, &v_, &r_, &u_old_, &v_old_});
    u_.swap(u_old_);  // the new u and v go into the spares; the old ones stay for discard()
    v_.swap(v_old_);
    const float factor = clip_factor(grad, info);
    const double k = feedback::loss_scale_ratio(info);
    const auto m = static_cast<float>(momentum_);
    const auto mk = static_cast<float>(momentum_ * k);
    const auto kf = static_cast<float>(k);
    const float* u0 = u_old_.data();
    const float* v0 = v_old_.data();
    float* u = u_.data();
    float* v = v_.data();
    const float* g = grad.data();
    if (nesterov_) {
      for (size_t i = 0; i < grad.size(); ++i) {
        const float gi = g[i] * factor;
        u[i] = std::fma(kf, u0[i], gi) * m;
        v[i] = std::fma(kf, v0[i], u[i]) + gi;
      }
    } else {
      for (size_t i = 0; i < grad.size(); ++i) {
        u[i] = std::fma(mk, u0[i], g[i] * factor);
        v[i] = std::fma(kf, v0[i], u[i]);
      }
    }
    pending_ = true;
    return v_;
  }

  std::span<float> residual() override { return r_; }

  // v: what was accumulated and not sent (u, the momentum, is history).
  void add_unsent(std::span<float> into) const override { feedback::add_into(into, v_, "dgc"); }

  void commit() override {
    if (!pending_) throw Error("feedback 'dgc': commit() without a compensate() before it");
    float* u = u_.data();
    const float* r = r_.data();
    const float* v = v_.data();
    if (masking_) {
      for (size_t i = 0; i < u_.size(); ++i) u[i] = r[i] != v[i] ? 0.0f : u[i];
    }
    v_.swap(r_);
    pending_ = false;
  }

  void discard() override {
    memory_.discard_step();
    u_.swap(u_old_);
    v_.swap(v_old_);
    pending_ = false;
  }

  size_t memory_bytes() const override {
    return feedback::buffer_bytes({&u_, &v_, &r_, &u_old_, &v_old_});
  }

  std::vector<std::byte> save_state() const override { return memory_.save({&u_, &v_}); }
  void load_state(std::span<const std::byte> state) override {
    memory_.load(state, {&u_, &v_}, {&r_, &u_old_, &v_old_});
    pending_ = false;
  }

 private:
  // The factor that brings ||g|| down to the local threshold; 1 when off, below it, or when
  // the norm is not finite (NaN/Inf then flows through unchanged).
  float clip_factor(std::span<const float> grad, const StepInfo& info) const {
    if (clip_ <= 0) return 1.0f;
    // The gradient carries the loss scale, so the threshold does too.
    const double scale = info.scale > 0 ? info.scale : 1.0;
    const double threshold =
        scale * clip_ / std::sqrt(static_cast<double>(std::max(info.world_size, 1u)));
    const double norm = l2_norm(grad);
    if (!std::isfinite(norm) || norm <= threshold) return 1.0f;
    return static_cast<float>(threshold / norm);
  }

  double momentum_, clip_;
  bool nesterov_, masking_;
  Buffer<float> u_, v_, r_;  // momentum, velocity, residual written by the codec
  Buffer<float> u_old_, v_old_;  // u and v before the last compensate(), for discard()
  bool pending_ = false;
  feedback::Memory memory_{"dgc", feedback::FeedbackKind::kDgc};
};

}  // namespace

std::unique_ptr<Feedback> make_dgc_feedback(Spec& spec) {
  const double momentum = spec.get_double("momentum", 0.9, 0.0, 1.0, false, true);
  const double clip = spec.get_double("clip", 0.0, 0.0, std::numeric_limits<double>::infinity());
  const bool nesterov = spec.get_bool("nesterov", false);
  const bool masking = spec.get_bool("masking", true);
  return std::make_unique<DgcFeedback>(momentum, clip, nesterov, masking);
}

}  // namespace gradcomp
