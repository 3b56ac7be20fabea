// Layout (little-endian): "GCEN", u32 version, u64 plan hash, u64 step, f64 lr, f64 prev_lr,
// u64 bucket count, then per bucket u64 length and that many bytes of route state.
#include "engine/state_file.h"

#include <cstring>

#include <fmt/format.h>

#include "gradcomp/error.h"

namespace gradcomp {
namespace {

constexpr char kMagic[4] = {'G', 'C', 'E', 'N'};
constexpr uint32_t kVersion = 1;

// Appends raw bytes (resize + memcpy: GCC 12 warns falsely on vector::insert of bytes).
void put_bytes(std::vector<std::byte>& out, const void* data, size_t n) {
  const size_t at = out.size();
  out.resize(at + n);
  if (n > 0) std::memcpy(out.data() + at, data, n);
}

template <class T>
void put(std::vector<std::byte>& out, T value) {
  put_bytes(out, &value, sizeof(T));
}

class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <class T>
  T get(const char* what) {
    T value;
    std::memcpy(&value, take(sizeof(T), what).data(), sizeof(T));
    return value;
  }
  std::span<const std::byte> take(size_t n, const char* what) {
    if (n > bytes_.size() - at_) {
      throw Error(fmt::format("engine state is truncated: {} needs {} bytes at offset {}, only "
                              "{} are left",
                              what, n, at_, bytes_.size() - at_));
    }
    auto s = bytes_.subspan(at_, n);
    at_ += n;
    return s;
  }
  bool at_end() const { return at_ == bytes_.size(); }

 private:
  std::span<const std::byte> bytes_;
  size_t at_ = 0;
};

}  // namespace

std::vector<std::byte> write_engine_state(uint64_t plan_hash, const StepState& step,
                                          const std::vector<std::vector<std::byte>>& routes) {
  std::vector<std::byte> out;
  put_bytes(out, kMagic, sizeof(kMagic));
  put(out, kVersion);
  put(out, plan_hash);
  put(out, step.step);
  put(out, step.lr);
  put(out, step.prev_lr);
  put(out, static_cast<uint64_t>(routes.size()));
  for (const auto& r : routes) {
    put(out, static_cast<uint64_t>(r.size()));
    put_bytes(out, r.data(), r.size());
  }
  return out;
}

EngineState read_engine_state(std::span<const std::byte> bytes, uint64_t plan_hash,
                              size_t buckets) {
  Reader in(bytes);
  if (bytes.size() < 4 || std::memcmp(in.take(4, "magic").data(), kMagic, 4) != 0) {
    throw Error("engine state: not a gradcomp engine state (no GCEN magic)");
  }
  if (const auto version = in.get<uint32_t>("version"); version != kVersion) {
    throw Error(fmt::format("engine state version {} is not supported; this gradcomp reads {}",
                            version, kVersion));
  }
  if (const auto hash = in.get<uint64_t>("plan hash"); hash != plan_hash) {
    throw Error(fmt::format("engine state belongs to another plan (hash {:016x}, this engine's "
                            "plan is {:016x}); load it into an engine with the same plan",
                            hash, plan_hash));
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
  if (!in.at_end()) throw Error("engine state has trailing bytes after the last bucket");
  return state;
}

}  // namespace gradcomp
