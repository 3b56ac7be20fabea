// ef: error feedback (Seide et al. 2014; Karimireddy et al. 2019), with the learning-rate
// correction of dist-EF-SGDM (Zheng et al. 2019; BytePS "corrected_ef").
//
//   p = g + alpha * e,  alpha = decay * lr ratio * loss-scale ratio, where
//     lr ratio = prev_lr / lr when lr_correction and both are known, else 1
//     loss-scale ratio = scale / prev_scale when both are known, else 1
//   e <- p - D(C(p))    (written by the codec into residual(), in place)
// alpha is computed in double and rounded to float; p[i] = fma(alpha, e[i], g[i]): element by
// element, so the gradient may come in parts (Feedback::in_parts), each written as it arrives.
// Two buffers: compensate() reads e from one and writes p into the other, then swaps them, so
// residual() aliases the vector to compress and the codec overwrites it with the new e, while
// the spare still holds the old e for discard() (a swap back, no pass over the data).
// Parameters: decay in [0, 1] (default 1), lr_correction (default false).
// State: the buffer e (format in memory.h); the spare is not state.
#include <cmath>

#include "feedback/factories.h"
#include "feedback/memory.h"
#include "gradcomp/error.h"
#include "gradcomp/spec.h"

namespace gradcomp {
namespace {

class ErrorFeedback final : public Feedback {
 public:
  ErrorFeedback(double decay, bool lr_correction) : decay_(decay), lr_correction_(lr_correction) {}

  std::string spec() const override {
    return fmt::format("ef:decay={},lr_correction={}", format_number(decay_),
                       lr_correction_ ? "true" : "false");
  }

  std::span<const float> compensate(std::span<const float> grad, const StepInfo& info) override {
    begin_parts(grad.size(), info);
    compensate_part(0, grad);
    return end_parts();
  }

  bool in_parts() const override { return true; }
  void begin_parts(size_t n, const StepInfo& info) override {
    memory_.fit(n, {&e_, &spare_});
    alpha_ = static_cast<float>(alpha_for(info));
  }
  void compensate_part(size_t offset, std::span<const float> part) override {
    if (offset > e_.size() || part.size() > e_.size() - offset) {
      throw Error(fmt::format("ef: part [{}, {}) of a gradient of {} elements", offset,
                              offset + part.size(), e_.size()));
    }
    const float* e = e_.data() + offset;
    float* p = spare_.data() + offset;
    const float* g = part.data();
    for (size_t i = 0; i < part.size(); ++i) p[i] = std::fma(alpha_, e[i], g[i]);
  }
  std::span<const float> end_parts() override {
    e_.swap(spare_);  // e_ holds p, which the codec turns into the new e; spare_ the old e
    return e_;
  }

  std::span<float> residual() override { return e_; }

  void add_unsent(std::span<float> into) const override { feedback::add_into(into, e_, "ef"); }

  void discard() override {
    memory_.discard_step();
    e_.swap(spare_);
  }

  size_t memory_bytes() const override { return feedback::buffer_bytes({&e_, &spare_}); }

  std::vector<std::byte> save_state() const override { return memory_.save({&e_}); }
  void load_state(std::span<const std::byte> state) override {
    memory_.load(state, {&e_}, {&spare_});
  }

 private:
  double alpha_for(const StepInfo& info) const {
    const bool rescale = lr_correction_ && info.prev_lr > 0 && info.lr > 0;
    return decay_ * (rescale ? info.prev_lr / info.lr : 1.0) * feedback::loss_scale_ratio(info);
  }

  double decay_;
  bool lr_correction_;
  float alpha_ = 1;  // this step's factor on e (begin_parts)
  Buffer<float> e_;      // e between steps; p between compensate() and the codec's encode
  Buffer<float> spare_;  // the e before the last compensate(), for discard()
  feedback::Memory memory_{"ef", feedback::FeedbackKind::kErrorFeedback};
};

}  // namespace

std::unique_ptr<Feedback> make_error_feedback(Spec& spec) {
  const double decay = spec.get_double("decay", 1.0, 0.0, 1.0);
  const bool lr_correction = spec.get_bool("lr_correction", false);
  return std::make_unique<ErrorFeedback>(decay, lr_correction);
}

}  // namespace gradcomp
