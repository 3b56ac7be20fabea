// The engine's checkpoint: the step counter, the learning rates, every route's state and what a
// plan change carries, bound to the plan by its hash so a checkpoint cannot be loaded into a
// different plan.
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

// What a plan change carries for one tensor (Engine::set_plan): the memory the retired routes
// held of it, added to its next gradient.
struct CarriedMemory {
  uint64_t tensor = 0;  // index into the plan's tensors
  double scale = 0;     // the loss scale the values are in (0: unknown)
  std::vector<float> values;
};

struct EngineState {
  StepState step_state;
  std::vector<std::vector<std::byte>> routes;  // one per bucket
  std::vector<CarriedMemory> carried;          // by increasing tensor index
};

std::vector<std::byte> write_engine_state(const StateOwner& owner, const EngineState& state);
// Throws Error when the bytes are not an engine state, are truncated, or belong to another
// plan, seed, rank or world size, or carry memory of a tensor the plan does not have (by
// `tensor_elements`, the plan's tensors' sizes).
EngineState read_engine_state(std::span<const std::byte> bytes, const StateOwner& owner,
                              size_t buckets, std::span<const size_t> tensor_elements);

}  // namespace gradcomp
