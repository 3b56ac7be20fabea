// libFuzzer target: make_codec(spec)->load_state(bytes) for the codecs that keep state must give
// a gradcomp::Error or a loaded state. A loaded state must save back to the same bytes, and an
// encode and decode of a gradient of the loaded length must then give an Error or succeed.
// Input: byte 0 picks the spec (state_specs.h), the rest is the state.
#include <memory>

#include "fuzz_input.h"
#include "gradcomp/codec.h"
#include "state_specs.h"

namespace {

using namespace gradcomp;

// The element count a loaded state is for: powersgd's n (offset 9), signum's count (offset 8).
uint64_t loaded_length(std::span<const std::byte> state, bool powersgd) {
  uint64_t n = 0;
  const size_t at = powersgd ? 9 : 8;
  if (state.size() >= at + 8) std::memcpy(&n, state.data() + at, 8);
  return n;
}

// One step on the loaded state, every round, so the loaded Q or momentum is used.
void step(Codec& codec, size_t n) {
  const Context ctx{.seed = 1, .world_size = 1};
  const std::vector<float> x(n, 0.5f);
  std::vector<float> sum(n, 0.0f);
  const auto frame = fuzz::encode_step(codec, x, ctx);
  codec.decode_accumulate(frame, sum, ctx);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const auto& specs = fuzz::codec_state_specs();
  const std::string& spec = specs[data[0] % specs.size()];
  const auto codec = make_codec(spec);
  const auto state = fuzz::as_bytes(data + 1, size - 1);
  try {
    codec->load_state(state);
  } catch (const Error&) {
    return 0;
  }
  fuzz::expect_round_trip(state, codec->save_state());
  const uint64_t n = loaded_length(state, spec.starts_with("powersgd"));
  if (n > fuzz::kMaxStepElements) return 0;
  fuzz::expect_error_or_success([&] { step(*codec, n); });
  return 0;
}
