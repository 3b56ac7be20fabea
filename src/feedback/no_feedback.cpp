// none: no memory. compensate() returns the gradient itself, there is no residual, the state is
// empty, and discard() has nothing to do.
#include <fmt/format.h>

#include "feedback/factories.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

class NoFeedback final : public Feedback {
 public:
  std::string spec() const override { return "none"; }
  std::span<const float> compensate(std::span<const float> grad, const StepInfo&) override {
    return grad;
  }
  std::span<float> residual() override { return {}; }
  void add_unsent(std::span<float>) const override {}  // nothing held
  void discard() override {}  // nothing to take back
  bool has_memory() const override { return false; }
  size_t memory_bytes() const override { return 0; }
  std::vector<std::byte> save_state() const override { return {}; }
  void load_state(std::span<const std::byte> state) override {
    if (!state.empty()) {
      throw Error(fmt::format("feedback 'none': keeps no state, but a state of {} bytes was given",
                              state.size()));
    }
  }
};

}  // namespace

std::unique_ptr<Feedback> make_no_feedback(Spec&) { return std::make_unique<NoFeedback>(); }

}  // namespace gradcomp
