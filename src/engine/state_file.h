// The engine's checkpoint: the step counter, the learning rates, and every route's state, bound
// to the plan by its hash so a checkpoint cannot be loaded into a different plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "route/route.h"

namespace gradcomp {

// What a checkpoint belongs to: it resumes exactly only in the same place.
struct StateOwner {
  uint64_t plan_hash = 0;
  uint64_t seed = 0;
  uint32_t rank = 0;
  uint32_t world_size = 1;
};

struct EngineState {
  StepState step_state;
  std::vector<std::vector<std::byte>> routes;  // one per bucket
};

std::vector<std::byte> write_engine_state(const StateOwner& owner, const StepState& step,
                                          const std::vector<std::vector<std::byte>>& routes);
// Throws Error when the bytes are not an engine state, are truncated, or belong to another
// plan, seed, rank or world size.
EngineState read_engine_state(std::span<const std::byte> bytes, const StateOwner& owner,
                              size_t buckets);

}  // namespace gradcomp
