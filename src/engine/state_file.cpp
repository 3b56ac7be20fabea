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

#include "common/byte_io.h"
#include "gradcomp/error.h"
#include "gradcomp/frame.h"

namespace gradcomp {
namespace {

constexpr char kMagic[4] = {'G', 'C', 'E', 'N'};
constexpr uint32_t kVersion = 4;
constexpr uint32_t kVersionWithoutCarried = 3;
constexpr uint32_t kVersionWithoutChecksum = 2;

}  // namespace

std::vector<std::byte> write_engine_state(const StateOwner& owner, const EngineState& state) {
  const StepState& step = state.step_state;
  std::vector<std::byte> out;
  put_bytes(out, kMagic, sizeof(kMagic));
  put(out, kVersion);
  put(out, owner.plan_hash);
  put(out, owner.seed);
  put(out, owner.rank);
  put(out, owner.world_size);
  put(out, step.step);
  put(out, step.lr);
  put(out, step.prev_lr);
  put(out, static_cast<uint64_t>(state.routes.size()));
  for (const auto& r : state.routes) {
    put(out, static_cast<uint64_t>(r.size()));
    put_bytes(out, r.data(), r.size());
  }
  put(out, static_cast<uint64_t>(state.carried.size()));
  for (const CarriedMemory& c : state.carried) {
    put(out, c.tensor);
    put(out, c.scale);
    put(out, static_cast<uint64_t>(c.values.size()));
    put_bytes(out, c.values.data(), c.values.size() * sizeof(float));
  }
  put(out, crc32(out));
  return out;
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

std::vector<CarriedMemory> read_carried(ByteReader& in, std::span<const size_t> tensor_elements) {
  std::vector<CarriedMemory> carried;
  const auto count = in.get<uint64_t>("carried count");
  for (uint64_t i = 0; i < count; ++i) {
    CarriedMemory c;
    c.tensor = in.get<uint64_t>("carried tensor");
    if (c.tensor >= tensor_elements.size() ||
        (!carried.empty() && c.tensor <= carried.back().tensor)) {
      throw Error(fmt::format("engine state carries memory of tensor {}: not a tensor of the "
                              "plan ({} tensors) in increasing order", c.tensor,
                              tensor_elements.size()));
    }
    c.scale = in.get<double>("carried scale");
    if (!(c.scale >= 0) || !std::isfinite(c.scale)) {
      throw Error(fmt::format("engine state: the carried memory of tensor {} has loss scale {}; "
                              "a scale is finite and at least 0", c.tensor, c.scale));
    }
    const auto n = in.get<uint64_t>("carried element count");
    if (n != tensor_elements[c.tensor]) {
      throw Error(fmt::format("engine state carries {} elements for tensor {}, which has {}", n,
                              c.tensor, tensor_elements[c.tensor]));
    }
    const auto values = in.take(n * sizeof(float), "carried values");
    c.values.resize(n);
    std::memcpy(c.values.data(), values.data(), values.size());
    carried.push_back(std::move(c));
  }
  return carried;
}

}  // namespace

EngineState read_engine_state(std::span<const std::byte> bytes, const StateOwner& owner,
                              size_t buckets, std::span<const size_t> tensor_elements) {
  ByteReader in("engine state", bytes);
  if (bytes.size() < 4 || std::memcmp(in.take(4, "magic").data(), kMagic, 4) != 0) {
    throw Error("engine state: not a gradcomp engine state (no GCEN magic)");
  }
  const auto version = in.get<uint32_t>("version");
  if (version < kVersionWithoutChecksum || version > kVersion) {
    throw Error(fmt::format("engine state version {} is not supported; this gradcomp reads {} "
                            "to {}", version, kVersionWithoutChecksum, kVersion));
  }
  if (version >= kVersionWithoutCarried) {
    in = ByteReader("engine state", checked_body(bytes));
    in.take(8, "magic and version");
  }
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
    throw Error(fmt::format("engine state was saved by rank {} of {}; this is rank {} of {}: "
                            "every rank loads the state it saved itself (for one file that "
                            "every rank resumes from, save the state of every rank: in Python "
                            "state_dict(all_ranks=True), called on every rank)",
                            rank, world, owner.rank, owner.world_size));
  }
  EngineState state;
  state.step_state.step = in.get<uint64_t>("step");
  state.step_state.lr = in.get<double>("lr");
  state.step_state.prev_lr = in.get<double>("prev_lr");
  const auto count = in.get<uint64_t>("bucket count");
  if (count != buckets) {
    throw Error(fmt::format("engine state has {} buckets; the plan has {}", count, buckets));
  }
  for (size_t b = 0; b < count; ++b) {
    const auto n = in.get<uint64_t>("route state length");
    auto s = in.take(n, "route state");
    state.routes.emplace_back(s.begin(), s.end());
  }
  if (version == kVersion) state.carried = read_carried(in, tensor_elements);
  if (in.left() != 0) throw Error("engine state has trailing bytes after the last bucket");
  return state;
}

}  // namespace gradcomp
