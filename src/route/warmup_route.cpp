// warmup: Option::start_step. Before that engine step the bucket travels uncompressed (the
// route "none" over allreduce: a plain allreduce of the bucket, the exact float32 mean); from
// it on, the option's own route runs. The step number is the engine's counter, the same on
// every rank, so every rank switches at the same step.
// The option's route is built at once (its collectives-free constructor sizes only frame
// buffers), but its codec and feedback see nothing before start_step: their memory stays
// unsized and their state empty, and settle() does not reach them, so a warm-up step can
// neither fill nor roll back a memory it never touched. The state saved is the option's
// route's, so the checkpoint format is the same with or without warm-up.
#include <utility>

#include "route/routes.h"

namespace gradcomp::route {
namespace {

class WarmupRoute final : public Route {
 public:
  WarmupRoute(std::unique_ptr<Route> plain, std::unique_ptr<Route> main, uint64_t start_step)
      : plain_(std::move(plain)), main_(std::move(main)), start_step_(start_step) {}

  bool takes_parts(const StepState& step) const override { return at(step).takes_parts(step); }
  void take_part(size_t offset, std::span<const float> part, const StepState& step) override {
    at(step).take_part(offset, part, step);
  }
  void encode(std::span<float> bucket, const StepState& step, const Phases& p) override {
    last_ = &at(step);
    last_->encode(bucket, step, p);
  }
  void exchange(const StepState& step, const Phases& p) override { at(step).exchange(step, p); }
  void decode(std::span<float> out, const StepState& step, const Phases& p) override {
    at(step).decode(out, step, p);
  }
  float decode_unscaled(std::span<float> out, const StepState& step, const Phases& p) override {
    return at(step).decode_unscaled(out, step, p);
  }

  bool stateful() const override { return main_->stateful(); }
  void settle(bool keep, const StepState& step) override {
    if (step.step >= start_step_) main_->settle(keep, step);
  }
  // The plain route holds nothing; the option's route nothing before start_step.
  double carry(std::span<float> into) const override { return main_->carry(into); }
  size_t bytes_sent() const override { return last_->bytes_sent(); }
  size_t memory_bytes() const override { return plain_->memory_bytes() + main_->memory_bytes(); }
  std::vector<std::byte> save_state() const override { return main_->save_state(); }
  void load_state(std::span<const std::byte> state) override { main_->load_state(state); }

 private:
  // Every stage of a step asks with that step's number, so all three pick the same route.
  Route& at(const StepState& step) const {
    return step.step < start_step_ ? *plain_ : *main_;
  }

  std::unique_ptr<Route> plain_;  // codec none, feedback none, allreduce
  std::unique_ptr<Route> main_;   // the option's route
  uint64_t start_step_;
  Route* last_ = plain_.get();  // the route of the last step encoded (bytes_sent)
};

}  // namespace

std::unique_ptr<Route> make_warmup_route(std::unique_ptr<Route> plain, std::unique_ptr<Route> main,
                                         uint64_t start_step) {
  return std::make_unique<WarmupRoute>(std::move(plain), std::move(main), start_step);
}

}  // namespace gradcomp::route
