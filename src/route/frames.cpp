#include "route/frames.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "common/state_io.h"
#include "common/half.h"
#include "gradcomp/error.h"

namespace gradcomp::route {
namespace {

constexpr StateKind kState{"GCRS"};
constexpr uint32_t kStateVersion = 1;

}  // namespace

StepKeeper::StepKeeper(std::vector<Feedback*> feedbacks, std::vector<Codec*> codecs)
    : feedbacks_(std::move(feedbacks)), codecs_(std::move(codecs)) {
  stateful_ = std::any_of(feedbacks_.begin(), feedbacks_.end(),
                          [](const Feedback* f) { return f->has_memory(); }) ||
              std::any_of(codecs_.begin(), codecs_.end(),
                          [](const Codec* c) { return c->traits().stateful; });
}

StepInfo StepKeeper::info(const StepState& step, uint32_t world) const {
  return {.step = step.step,
          .lr = step.lr,
          .prev_lr = kept_ ? kept_lr_ : step.prev_lr,
          .world_size = world,
          .scale = step.scale,
          .prev_scale = kept_ ? kept_scale_ : step.prev_scale};
}

void StepKeeper::settle(bool keep, const StepState& step) {
  if (!stateful_) return;
  if (keep) {
    kept_ = true;
    kept_lr_ = step.lr;
    kept_scale_ = step.scale;
    return;
  }
  for (Feedback* f : feedbacks_) f->discard();
  for (Codec* c : codecs_) c->discard();
}

void encode_half(std::span<const float> x, std::span<uint16_t> out, const Phases& p) {
  p.run("encode", [&] {
    for (size_t i = 0; i < x.size(); ++i) out[i] = float_to_half(x[i]);
  });
}

bool all_finite(std::span<const float> x) {
  // The largest magnitude as bits: NaN and Inf have an all-ones exponent, so they are the
  // only values at or above +Inf's bits. A max reduction vectorises.
  uint32_t largest = 0;
  for (const float v : x) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    largest = std::max(largest, bits & 0x7fffffffu);
  }
  return largest < 0x7f800000u;
}

namespace {

// Per-lane maxima and sums, so that the loop vectorises. Summing squares costs about as much
// again as the check alone (timed by hand on 16M floats), so it is a template switch.
template <bool kScale, bool kWrite, bool kSquares>
Scan mean_pass(const float* sum, float* mean, size_t n, float factor) {
  constexpr size_t kLanes = 16;
  uint32_t largest[kLanes] = {};
  float squares[kLanes] = {};
  const auto one = [&](size_t i, size_t lane) {
    float v = sum[i];
    if constexpr (kScale) v = (0.0f + v) * factor;
    if constexpr (kWrite) mean[i] = v;
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    largest[lane] = std::max(largest[lane], bits & 0x7fffffffu);
    if constexpr (kSquares) squares[lane] += v * v;
  };
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) one(i + j, j);
  }
  for (size_t j = 0; i + j < n; ++j) one(i + j, j);
  uint32_t top = 0;
  double total = 0;
  for (size_t j = 0; j < kLanes; ++j) {
    top = std::max(top, largest[j]);
    total += squares[j];
  }
  return {top < 0x7f800000u, total};
}

template <bool kScale, bool kWrite>
Scan mean_pass(const float* sum, float* mean, size_t n, float factor, bool squares) {
  return squares ? mean_pass<kScale, kWrite, true>(sum, mean, n, factor)
                 : mean_pass<kScale, kWrite, false>(sum, mean, n, factor);
}

}  // namespace

Scan scan(std::span<const float> x) {
  return mean_pass<false, false, true>(x.data(), nullptr, x.size(), 1.0f);
}

Scan write_mean(std::span<const float> sum, std::span<float> mean, float factor, bool squares) {
  if (sum.size() != mean.size()) {
    throw Error(fmt::format("write_mean: a sum of {} elements into a mean of {}", sum.size(),
                            mean.size()));
  }
  const bool in_place = sum.data() == mean.data();
  if (factor != 1.0f) return mean_pass<true, true>(sum.data(), mean.data(), sum.size(), factor, squares);
  if (in_place) return mean_pass<false, false>(sum.data(), nullptr, sum.size(), 1.0f, squares);
  return mean_pass<false, true>(sum.data(), mean.data(), sum.size(), 1.0f, squares);
}

void apply_factor(std::span<float> x, float factor) {
  if (factor == 1.0f) return;
  for (float& v : x) v = (0.0f + v) * factor;
}

size_t checked_size(uint64_t size, size_t max_bytes, int peer, const char* what) {
  if (size > max_bytes) {
    throw FrameError(fmt::format("{} from rank {} is {} bytes, more than the {} bytes the codec "
                                 "can write: the ranks disagree on the bucket or the codec",
                                 what, peer, size, max_bytes));
  }
  return static_cast<size_t>(size);
}

size_t checked_fixed_size(const Codec& codec, size_t bytes, size_t max_bytes) {
  if (bytes != max_bytes) {
    throw Error(fmt::format("codec '{}' declares a fixed frame size but encoded {} bytes where "
                            "max_frame_bytes is {}; peers would read a wrong frame",
                            codec.spec(), bytes, max_bytes));
  }
  return bytes;
}

void check_length(const char* route, size_t bucket, const char* what, size_t size, size_t n) {
  if (size != n) {
    throw Error(fmt::format("route '{}', bucket {}: {} of {} elements; the bucket has {}", route,
                            bucket, what, size, n));
  }
}

std::vector<std::byte> save_parts(std::string_view route, const StateShape& shape,
                                  const std::vector<std::vector<std::byte>>& parts) {
  StateWriter out(kState, kStateVersion);
  out.put(fnv1a32(route)).put(static_cast<uint64_t>(shape.elements)).put(shape.world);
  out.put(static_cast<uint32_t>(parts.size()));
  for (const auto& part : parts) out.blob(part);
  return std::move(out).finish();
}

std::vector<std::span<const std::byte>> load_parts(std::string_view route,
                                                   std::span<const std::byte> state,
                                                   const StateShape& shape,
                                                   size_t expected_parts, bool at_least) {
  StateReader in(fmt::format("route '{}' state", route), state, kState);
  if (in.get<uint32_t>("the route") != fnv1a32(route)) in.fail("saved by a different route");
  const auto elements = in.get<uint64_t>("the element count");
  const auto world = in.get<uint32_t>("the world size");
  if (elements != shape.elements || world != shape.world) {
    in.fail(fmt::format("saved for a bucket of {} elements over {} ranks; this bucket has {} "
                        "elements over {} ranks",
                        elements, world, shape.elements, shape.world));
  }
  const auto count = in.get<uint32_t>("the part count");
  if (count != expected_parts && !(at_least && count > expected_parts)) {
    in.fail(fmt::format("{} parts, this route keeps {} (codec and feedback states): saved with "
                        "a different option or world size",
                        count, expected_parts));
  }
  std::vector<std::span<const std::byte>> parts;
  for (uint32_t i = 0; i < count; ++i) parts.push_back(in.blob("a part"));
  in.expect_end("the last part");
  return parts;
}

}  // namespace gradcomp::route
