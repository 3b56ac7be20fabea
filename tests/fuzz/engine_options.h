// The engines whose state reader engine_state_fuzz fuzzes, and the layout of its input:
//   byte 0: which engine (index into engine_options(), modulo its size)
//   byte 1: bit 0 set -> re-seal the trailing CRC-32 over the fuzzed bytes, so mutations reach
//           the parser behind the checksum (state_file.cpp) and the routes' readers
//   bytes 2..: the state
// Shared by the target and the seed generator, so a seed is saved by the engine it is for.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "gradcomp/frame.h"
#include "gradcomp/plan.h"

namespace gradcomp::fuzz {

// One option per route, with stateful codecs and every feedback kind among them.
inline const std::vector<Option>& engine_options() {
  static const std::vector<Option> options = {
      {},
      {.codec = "topk:ratio=0.1", .feedback = "ef", .route = "allgather"},
      {.codec = "powersgd:rank=2", .feedback = "ef", .route = "allreduce"},
      {.codec = "signum", .feedback = "dgc", .route = "allgather"},
      {.codec = "qsgd:levels=16", .feedback = "nesterov", .route = "twoway:server_feedback=ef"},
      {.codec = "fp16", .feedback = "ef", .route = "hierarchical:inner=allreduce,intra=fp16"}};
  return options;
}

// Two buckets: one compressed with `option`, one small uncompressed (as engine_test's plan).
inline Plan engine_plan(const Option& option) {
  DefaultPlanSettings settings;
  settings.min_compress_elements = 100;
  settings.compressed = option;
  return make_default_plan({{"w", 1000}, {"b", 10}}, settings);
}

inline constexpr uint64_t kEngineSeed = 7;

// Writes the CRC-32 of everything before the last 4 bytes into them (state_file.cpp's trailer).
inline void reseal(std::vector<std::byte>& state) {
  if (state.size() < 4) return;
  const uint32_t crc = crc32(std::span(state).first(state.size() - 4));
  std::memcpy(state.data() + state.size() - 4, &crc, 4);
}

}  // namespace gradcomp::fuzz
