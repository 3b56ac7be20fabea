// libFuzzer target: make_feedback(spec)->load_state(bytes) for every feedback kind must give a
// gradcomp::Error or a loaded memory. A loaded memory must save back to the same bytes, and a
// step on it (compensate, commit) taken back by discard() must leave those bytes again.
// Input: byte 0 picks the spec (state_specs.h), the rest is the state.
#include <memory>

#include "fuzz_input.h"
#include "gradcomp/feedback.h"
#include "state_specs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradcomp;
  if (size < 1) return 0;
  const auto& specs = fuzz::feedback_specs();
  // A fresh feedback per input: the reader is what a restarted job runs on its new objects.
  const auto feedback = make_feedback(specs[data[0] % specs.size()]);
  const auto state = fuzz::as_bytes(data + 1, size - 1);
  try {
    feedback->load_state(state);
  } catch (const Error&) {
    return 0;
  }
  fuzz::expect_round_trip(state, feedback->save_state());
  // The gradient length the memory holds: the header's n when sized (feedback/memory.h, offset 10).
  uint64_t n = 0;
  if (state.size() >= 18 && state[9] == std::byte{1}) std::memcpy(&n, state.data() + 10, 8);
  if (n > fuzz::kMaxStepElements) return 0;
  const std::vector<float> grad(n, 0.25f);
  const StepInfo info{.step = 1, .lr = 0.1, .prev_lr = 0.05, .world_size = 4, .scale = 2, .prev_scale = 1};
  fuzz::expect_error_or_success([&] {
    (void)feedback->compensate(grad, info);
    feedback->commit();
    feedback->discard();
    fuzz::expect_round_trip(state, feedback->save_state());
  });
  return 0;
}
