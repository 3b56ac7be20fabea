// The memory of a feedback (its float buffers) and their checkpoint format, shared by the
// feedback kinds.
//
// State format (read and written by common/state_io.h; little-endian):
//   offset size field
//   0      4    magic "GCFS"
//   4      4    version (1)
//   8      1    kind (FeedbackKind)
//   9      1    sized: 0 = no gradient seen yet (no buffers follow), 1 = sized
//   10     8    n, the gradient length (0 when not sized)
//   18     4    array count (fixed per kind and configuration)
//   22     ...  the arrays, each n float32
// load_state checks every field and the exact total length, and throws an Error naming the
// feedback and what differs.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/state_io.h"
#include "gradcomp/error.h"
#include "gradcomp/feedback.h"

namespace gradcomp::feedback {

enum class FeedbackKind : uint8_t { kNone = 1, kErrorFeedback = 2, kDgc = 3, kNesterov = 4 };

inline constexpr StateKind kState{"GCFS"};
inline constexpr uint32_t kStateVersion = 1;

// Buffers of one gradient length, sized on first use.
class Memory {
 public:
  Memory(std::string name, FeedbackKind kind) : name_(std::move(name)), kind_(kind) {}

  // Sizes the buffers (zero-filled) on the first gradient; afterwards insists on the same length.
  // Called at the start of every step: it opens the step discard_step() may take back.
  // (An initializer_list: called every step, it must not allocate.)
  void fit(size_t n, std::initializer_list<Buffer<float>*> buffers) {
    step_open_ = true;
    was_sized_ = sized_;
    if (!sized_) {
      for (auto* b : buffers) b->assign(n, 0.0f);
      n_ = n;
      sized_ = true;
      return;
    }
    if (n != n_) {
      throw Error(
          fmt::format("feedback '{}': gradient of {} elements, but its memory holds {}; "
                      "use one feedback per bucket (a bucket keeps its length)",
                      name_, n, n_));
    }
  }

  // For Feedback::discard(): checks that a step is open and closes it. When that step was the
  // first, the memory becomes unsized again, so save() writes the state it wrote before it.
  void discard_step() {
    if (!step_open_) {
      throw Error(fmt::format("feedback '{}': discard() without a step to take back; call it "
                              "once per step, after commit()",
                              name_));
    }
    step_open_ = false;
    if (!was_sized_) {
      sized_ = false;
      n_ = 0;
    }
  }

  std::vector<std::byte> save(const std::vector<const Buffer<float>*>& arrays) const {
    StateWriter out(kState, kStateVersion);
    out.put(static_cast<uint8_t>(kind_)).put(static_cast<uint8_t>(sized_));
    out.put(static_cast<uint64_t>(n_)).put(static_cast<uint32_t>(arrays.size()));
    if (sized_) {
      for (const auto* a : arrays) out.floats(*a);
    }
    return std::move(out).finish();
  }

  // Restores the arrays (all of them, or none on an error); `scratch` buffers (the spares of
  // discard(), a residual) are sized to match and zeroed, as fit() would.
  void load(std::span<const std::byte> state, const std::vector<Buffer<float>*>& arrays,
            const std::vector<Buffer<float>*>& scratch = {}) {
    StateReader in(fmt::format("feedback '{}': cannot load state", name_), state, kState);
    const auto kind = in.get<uint8_t>("the kind");
    const auto sized = in.get<uint8_t>("the sized flag");
    const auto n = in.get<uint64_t>("the length");
    const auto count = in.get<uint32_t>("the array count");
    if (kind != static_cast<uint8_t>(kind_)) {
      in.fail(fmt::format("it is the state of feedback kind {}, not of this kind ({})", kind,
                          static_cast<int>(kind_)));
    }
    if (sized > 1) in.fail(fmt::format("sized flag {} is neither 0 nor 1", sized));
    if (count != arrays.size()) {
      in.fail(fmt::format("{} arrays, this configuration keeps {}", count, arrays.size()));
    }
    // Compared by division, so that no n from a corrupted state can overflow.
    const size_t body = in.left();
    const bool fits = sized != 0 ? count != 0 && body % (4 * count) == 0 && body / (4 * count) == n
                                 : body == 0 && n == 0;
    if (!fits) in.fail(fmt::format("{} bytes of arrays for n = {} and {} arrays", body, n, count));
    for (auto* a : arrays) {
      a->assign(n, 0.0f);
      in.floats(*a, "an array");
    }
    for (auto* b : scratch) b->assign(n, 0.0f);
    sized_ = sized != 0;
    n_ = n;
    step_open_ = false;  // the loaded memory is not a step to take back
  }

 private:
  std::string name_;
  FeedbackKind kind_;
  bool sized_ = false;
  size_t n_ = 0;
  bool step_open_ = false;  // fit() ran and discard_step() did not since
  bool was_sized_ = false;  // sized_ before the last fit()
};

// The factor that brings the memory from the loss scale it was accumulated under to this
// step's (StepInfo::scale): scale / prev_scale, or 1 when either is unknown. A gradient carries
// the scale, so memory made of earlier gradients carries the earlier one.
inline double loss_scale_ratio(const StepInfo& info) {
  const bool known = info.prev_scale > 0 && info.scale > 0;
  return known ? info.scale / info.prev_scale : 1.0;
}

// Feedback::add_unsent: into += memory, elementwise. An unsized memory (never compensated) adds
// nothing; one of another length is an Error (the caller mixed up buckets).
inline void add_into(std::span<float> into, const Buffer<float>& memory, const char* name) {
  if (memory.empty()) return;
  if (memory.size() != into.size()) {
    throw Error(fmt::format("feedback '{}': add_unsent into {} elements; the memory holds {}",
                            name, into.size(), memory.size()));
  }
  for (size_t i = 0; i < into.size(); ++i) into[i] += memory[i];
}

// Bytes of float buffers, for Feedback::memory_bytes().
inline size_t buffer_bytes(const std::vector<const Buffer<float>*>& buffers) {
  size_t total = 0;
  for (const auto* b : buffers) total += b->size() * sizeof(float);
  return total;
}

}  // namespace gradcomp::feedback
