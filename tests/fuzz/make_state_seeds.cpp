// Writes the seed corpora of the reader targets (committed under tests/fuzz/corpus/<target>/;
// rerun after a state or plan format changes): states saved by real objects after a step, for
// every spec the targets fuzz, and plans from the default planner. The JSON documents people
// write (profiles, clusters, codec costs) are copied from profiles/ and docs instead.
// Usage: state_fuzz_seeds DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine_options.h"
#include "fuzz_input.h"
#include "gradcomp/codec.h"
#include "gradcomp/engine.h"
#include "gradcomp/feedback.h"
#include "single_rank.h"
#include "state_specs.h"

namespace {

using namespace gradcomp;
namespace fs = std::filesystem;

// One seed: the prefix bytes the target reads first (fuzz_input.h layouts), then the payload.
void write(const fs::path& path, std::vector<char> prefix, const std::vector<std::byte>& body) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out.write(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  out.write(reinterpret_cast<const char*>(body.data()), static_cast<std::streamsize>(body.size()));
}

std::vector<std::byte> text_bytes(const std::string& s) {
  const auto* b = reinterpret_cast<const std::byte*>(s.data());
  return {b, b + s.size()};
}

void feedback_seeds(const fs::path& dir) {
  const auto& specs = fuzz::feedback_specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    auto fb = make_feedback(specs[i]);
    const auto p = static_cast<char>(i);
    write(dir / (std::to_string(i) + "_fresh"), {p}, fb->save_state());
    const std::vector<float> g{0.5f, -1.0f, 2.0f, 0.0f, 3.5f};
    (void)fb->compensate(g, {.step = 0, .lr = 0.1, .world_size = 4});
    fb->commit();
    write(dir / (std::to_string(i) + "_sized"), {p}, fb->save_state());
  }
}

void codec_seeds(const fs::path& dir) {
  const auto& specs = fuzz::codec_state_specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    for (size_t n : {0, 7, 64}) {
      auto codec = make_codec(specs[i]);
      const std::vector<float> x(n, 0.75f);
      std::vector<float> sum(n);
      const Context ctx{.seed = 1};
      const auto frame = fuzz::encode_step(*codec, x, ctx);
      codec->decode_accumulate(frame, sum, ctx);
      write(dir / (std::to_string(i) + "_" + std::to_string(n)), {static_cast<char>(i)},
            codec->save_state());
    }
  }
}

void engine_seeds(const fs::path& dir) {
  const auto& options = fuzz::engine_options();
  for (size_t i = 0; i < options.size(); ++i) {
    Engine engine(testing::single_rank_transport(), fuzz::engine_plan(options[i]),
                  EngineOptions{.seed = fuzz::kEngineSeed});
    write(dir / (std::to_string(i) + "_fresh"), {static_cast<char>(i), 1}, engine.save_state());
    std::vector<float> w(1000, 0.5f), b(10, 0.25f);
    engine.ready("w", w);
    engine.ready("b", b);
    engine.synchronize();
    write(dir / (std::to_string(i) + "_step1"), {static_cast<char>(i), 1}, engine.save_state());
    // A state carrying memory into plan i: a step under another plan, then a plan change.
    Engine before(testing::single_rank_transport(),
                  fuzz::engine_plan(options[(i + 1) % options.size()]),
                  EngineOptions{.seed = fuzz::kEngineSeed});
    before.ready("w", w);
    before.ready("b", b);
    before.synchronize();
    before.set_plan(fuzz::engine_plan(options[i]));
    write(dir / (std::to_string(i) + "_carried"), {static_cast<char>(i), 1}, before.save_state());
  }
}

void plan_seeds(const fs::path& dir) {
  const auto& options = fuzz::engine_options();
  for (size_t i = 0; i < options.size(); ++i) {
    write(dir / std::to_string(i), {}, text_bytes(fuzz::engine_plan(options[i]).to_json().dump(1)));
  }
  write(dir / "caller", {}, text_bytes(fuzz::engine_plan({.codec = "dgc:ratio=0.1",
      .feedback = "dgc:momentum=0.5,clip=1", .route = "allgather",
      .encode_on = EncodeOn::kCaller}).to_json().dump()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path dir = argv[1];
  feedback_seeds(dir / "feedback_state_fuzz");
  codec_seeds(dir / "codec_state_fuzz");
  engine_seeds(dir / "engine_state_fuzz");
  plan_seeds(dir / "plan_fuzz");
  return 0;
}
