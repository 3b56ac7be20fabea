// libFuzzer target: Engine::load_state(bytes) on one-rank engines over small plans (one per
// route, engine_options.h) must give a gradcomp::Error and change nothing, or load. A state it
// loads (version 4, the one written) must save back to the same bytes, and a step must then run or fail with an
// Error. Each engine is built once (Gloo over a file store is slow to set up) and rebuilt only
// after a step broke it.
#include <map>
#include <memory>

#include "engine_options.h"
#include "fuzz_input.h"
#include "gradcomp/engine.h"
#include "single_rank.h"

namespace {

using namespace gradcomp;

std::map<size_t, std::unique_ptr<Engine>>& engines() {
  static std::map<size_t, std::unique_ptr<Engine>> all;
  return all;
}

Engine& engine(size_t index) {
  auto& e = engines()[index];
  if (!e) {
    e = std::make_unique<Engine>(testing::single_rank_transport(),
                                 fuzz::engine_plan(fuzz::engine_options()[index]),
                                 EngineOptions{.seed = fuzz::kEngineSeed});
  }
  return *e;
}

bool step(Engine& e) {
  std::vector<float> w(1000, 0.5f), b(10, 0.25f);
  try {
    e.ready("w", w);
    e.ready("b", b);
    e.synchronize();
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t index = data[0] % fuzz::engine_options().size();
  auto state = fuzz::as_bytes(data + 2, size - 2);
  if (data[1] & 1) fuzz::reseal(state);
  Engine& e = engine(index);
  const auto before = e.save_state();
  try {
    e.load_state(state);
  } catch (const Error&) {
    if (e.save_state() != before) fuzz::finding("a refused state changed the engine's state");
    return 0;
  }
  uint32_t version = 0;
  std::memcpy(&version, state.data() + 4, 4);  // loaded: at least magic and version are there
  if (version == 4) fuzz::expect_round_trip(state, e.save_state());
  if (!step(e)) engines().erase(index);  // broken engines throw from then on
  return 0;
}
