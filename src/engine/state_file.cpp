// Layout (little-endian): "GCEN", u32 version, u64 plan hash, u64 seed, u32 rank, u32 world
// size, u64 step, f64 lr, f64 prev_lr, u64 bucket count, then per bucket u64 length and that
// many bytes of route state; version 4 then has u64 carried count and per carried tensor u64
// tensor index, f64 scale, u64 element count and the float32 values (what a plan change
// carries); versions 3 and 4 end with the CRC-32 of everything before it, so a flipped byte of
// a residual is an error, not a silently different run. Versions 2 (no checksum) and 3 (nothing
// carried) still load.
#include "engine/state_file.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "common/state_io.h"
#include "gradcomp/error.h"
#include "gradcomp/frame.h"

namespace gradcomp {
namespace {

constexpr uint32_t kVersion = 4;
constexpr uint32_t kVersionWithoutCarried = 3;
constexpr uint32_t kVersionWithoutChecksum = 2;
constexpr StateKind kState{"GCEN", kVersionWithoutChecksum, kVersion};

}  // namespace

std::vector<std::byte> write_engine_state(const StateOwner& owner, const EngineState& state) {
  const StepState& step = state.step_state;
  StateWriter out(kState, kVersion);
  out.put(owner.plan_hash).put(owner.seed).put(owner.rank).put(owner.world_size);
  out.put(step.step).put(step.lr).put(step.prev_lr);
  out.put(static_cast<uint64_t>(state.routes.size()));
  for (const auto& r : state.routes) out.blob(r);
  out.put(static_cast<uint64_t>(state.carried.size()));
  for (const CarriedMemory& c : state.carried) {
    out.put(c.tensor).put(c.scale).put(static_cast<uint64_t>(c.values.size())).floats(c.values);
  }
  out.put(crc32(out.written()));
  return std::move(out).finish();
}

namespace {

// The bytes before the checksum of a version-3 state, after checking it.
std::span<const std::byte> checked_body(std::span<const std::byte> bytes) {
  if (bytes.size() < 12) throw Error("engine state: truncated (shorter than its header)");
  const auto body = bytes.first(bytes.size() - 4);
  uint32_t stored;
  std::memcpy(&stored, bytes.data() + body.size(), sizeof stored);
  if (stored != crc32(body)) {
    throw Error("engine state: checksum mismatch: the state was changed or truncated after it "
                "was saved (load the file this rank saved, unaltered)");
  }
  return body;
}

std::vector<CarriedMemory> read_carried(StateReader& in, std::span<const size_t> tensor_elements) {
  std::vector<CarriedMemory> carried;
  const auto count = in.get<uint64_t>("carried count");
  for (uint64_t i = 0; i < count; ++i) {
    CarriedMemory c;
    c.tensor = in.get<uint64_t>("carried tensor");
    if (c.tensor >= tensor_elements.size() ||
        (!carried.empty() && c.tensor <= carried.back().tensor)) {
      in.fail(fmt::format("it carries memory of tensor {}: not a tensor of the plan ({} "
                          "tensors) in increasing order",
                          c.tensor, tensor_elements.size()));
    }
    c.scale = in.get<double>("carried scale");
    if (!(c.scale >= 0) || !std::isfinite(c.scale)) {
      in.fail(fmt::format("the carried memory of tensor {} has loss scale {}; a scale is finite "
                          "and at least 0",
                          c.tensor, c.scale));
    }
    const auto n = in.get<uint64_t>("carried element count");
    if (n != tensor_elements[c.tensor]) {
      in.fail(fmt::format("it carries {} elements for tensor {}, which has {}", n, c.tensor,
                          tensor_elements[c.tensor]));
    }
    c.values.resize(n);
    in.floats(c.values, "carried values");
    carried.push_back(std::move(c));
  }
  return carried;
}

}  // namespace

EngineState read_engine_state(std::span<const std::byte> bytes, const StateOwner& owner,
                              size_t buckets, std::span<const size_t> tensor_elements) {
  // Versions from 3 on end with the checksum of every byte before it: checked first, so a
  // flipped byte reads as what it is, not as whatever field it landed in.
  const uint32_t version = StateReader("engine state", bytes, kState).version();
  StateReader in("engine state",
                 version >= kVersionWithoutCarried ? checked_body(bytes) : bytes, kState);
  if (const auto hash = in.get<uint64_t>("plan hash"); hash != owner.plan_hash) {
    throw Error(fmt::format("engine state belongs to another plan (hash {:016x}, this engine's "
                            "plan is {:016x}); load it into an engine with the same plan",
                            hash, owner.plan_hash));
  }
  if (const auto seed = in.get<uint64_t>("seed"); seed != owner.seed) {
    throw Error(fmt::format("engine state was saved with seed {}; this engine's seed is {} (the "
                            "codecs' randomness would not continue exactly)",
                            seed, owner.seed));
  }
  const auto rank = in.get<uint32_t>("rank");
  const auto world = in.get<uint32_t>("world size");
  if (rank != owner.rank || world != owner.world_size) {
    throw Error(fmt::format(
        "engine state was saved by rank {} of {}; this is rank {} of {}: "
        "every rank loads the state it saved itself (for one file that "
        "every rank resumes from, save the state of every rank: in Python "
        "state_dict(all_ranks=True), called on every rank){}",
        rank, world, owner.rank, owner.world_size,
        world == owner.world_size ? ""
                                  : "; to go on with another number of ranks, resume without "
                                    "the compression state (it starts afresh)"));
  }
  EngineState state;
  state.step_state.step = in.get<uint64_t>("step");
  state.step_state.lr = in.get<double>("lr");
  state.step_state.prev_lr = in.get<double>("prev_lr");
  const auto count = in.get<uint64_t>("bucket count");
  if (count != buckets) {
    in.fail(fmt::format("it has {} buckets; the plan has {}", count, buckets));
  }
  for (size_t b = 0; b < count; ++b) {
    const auto s = in.blob("a route state");
    state.routes.emplace_back(s.begin(), s.end());
  }
  if (version == kVersion) state.carried = read_carried(in, tensor_elements);
  in.expect_end(version == kVersion ? "the carried memory" : "the last bucket");
  return state;
}

}  // namespace gradcomp
