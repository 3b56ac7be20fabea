// The memory of a feedback (its float buffers) and their checkpoint format, shared by the
// feedback kinds.
//
// State format, little-endian (x86 and the other targets are little-endian; fields are copied
// with memcpy):
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
#include "gradcomp/error.h"
#include "gradcomp/feedback.h"

namespace gradcomp::feedback {

enum class FeedbackKind : uint8_t { kNone = 1, kErrorFeedback = 2, kDgc = 3, kNesterov = 4 };

inline constexpr uint32_t kStateMagic = 0x53464347;  // "GCFS"
inline constexpr uint32_t kStateVersion = 1;
inline constexpr size_t kStateHeaderBytes = 22;

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
    size_t total = kStateHeaderBytes;
    for (const auto* a : arrays) total += sized_ ? 4 * a->size() : 0;
    std::vector<std::byte> out(total);
    const auto kind = static_cast<uint8_t>(kind_);
    const uint8_t sized = sized_ ? 1 : 0;
    const uint64_t n = n_;
    const auto count = static_cast<uint32_t>(arrays.size());
    std::memcpy(out.data(), &kStateMagic, 4);
    std::memcpy(out.data() + 4, &kStateVersion, 4);
    std::memcpy(out.data() + 8, &kind, 1);
    std::memcpy(out.data() + 9, &sized, 1);
    std::memcpy(out.data() + 10, &n, 8);
    std::memcpy(out.data() + 18, &count, 4);
    if (!sized_) return out;
    std::byte* p = out.data() + kStateHeaderBytes;
    for (const auto* a : arrays) {
      if (!a->empty()) std::memcpy(p, a->data(), 4 * a->size());
      p += 4 * a->size();
    }
    return out;
  }

  // Restores the arrays (all of them, or none on an error); `scratch` buffers (the spares of
  // discard(), a residual) are sized to match and zeroed, as fit() would.
  void load(std::span<const std::byte> state, const std::vector<Buffer<float>*>& arrays,
            const std::vector<Buffer<float>*>& scratch = {}) {
    const Header h = read_header(state);
    check_header(h, arrays.size());
    const size_t body = state.size() - kStateHeaderBytes;
    // Compared by division, so that no n from a corrupted state can overflow.
    const bool fits = h.sized ? h.count != 0 && body % (4 * h.count) == 0 &&
                                    body / (4 * h.count) == h.n
                              : body == 0 && h.n == 0;
    if (!fits) fail(fmt::format("{} bytes of arrays for n = {} and {} arrays", body, h.n, h.count));
    const std::byte* p = state.data() + kStateHeaderBytes;
    for (auto* a : arrays) {
      a->assign(h.n, 0.0f);
      if (h.n > 0) std::memcpy(a->data(), p, 4 * h.n);
      p += 4 * h.n;
    }
    for (auto* b : scratch) b->assign(h.n, 0.0f);
    sized_ = h.sized;
    n_ = h.n;
    step_open_ = false;  // the loaded memory is not a step to take back
  }

 private:
  struct Header {
    uint32_t magic, version, count;
    uint8_t kind, sized;
    uint64_t n;
  };

  Header read_header(std::span<const std::byte> state) const {
    if (state.size() < kStateHeaderBytes) {
      fail(fmt::format("{} bytes, the header needs {}", state.size(), kStateHeaderBytes));
    }
    Header h;
    std::memcpy(&h.magic, state.data(), 4);
    std::memcpy(&h.version, state.data() + 4, 4);
    std::memcpy(&h.kind, state.data() + 8, 1);
    std::memcpy(&h.sized, state.data() + 9, 1);
    std::memcpy(&h.n, state.data() + 10, 8);
    std::memcpy(&h.count, state.data() + 18, 4);
    return h;
  }

  void check_header(const Header& h, size_t arrays) const {
    if (h.magic != kStateMagic) {
      fail(fmt::format("magic 0x{:08x}, expected 0x{:08x} (\"GCFS\")", h.magic, kStateMagic));
    }
    if (h.version != kStateVersion) {
      fail(fmt::format("version {}, this build reads version {}", h.version, kStateVersion));
    }
    if (h.kind != static_cast<uint8_t>(kind_)) {
      fail(fmt::format("it is the state of feedback kind {}, not of this kind ({})", h.kind,
                       static_cast<int>(kind_)));
    }
    if (h.sized > 1) fail(fmt::format("sized flag {} is neither 0 nor 1", h.sized));
    if (h.count != arrays) {
      fail(fmt::format("{} arrays, this configuration keeps {}", h.count, arrays));
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(fmt::format("feedback '{}': cannot load state: {}", name_, what));
  }

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
