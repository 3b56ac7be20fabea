// Checkpoint bytes: one reader and one writer for every state gradcomp saves (feedback
// memories "GCFS", PowerSGD "PSGS", Signum "SGNM", routes "GCRS", the engine's file "GCEN").
// Each state starts with four characters naming its kind and a u32 version; its fields follow
// in the machine's (little-endian) order. The reader checks the kind, the version and every
// length, so a truncated, foreign or newer state is an Error that says what was wrong, never
// an overread. The layout of each kind is documented where it is written.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradcomp/error.h"

namespace gradcomp {

static_assert(std::endian::native == std::endian::little, "states are little-endian");

// The four characters that open a state of one kind ("GCEN"), and the range of its versions
// this build reads.
struct StateKind {
  const char* magic;  // exactly 4 characters
  uint32_t oldest = 1;
  uint32_t newest = 1;
};

class StateWriter {
 public:
  // Opens the state: the kind's magic and `version`.
  StateWriter(const StateKind& kind, uint32_t version) {
    bytes(std::as_bytes(std::span(kind.magic, 4)));
    put(version);
  }

  template <typename T>
  StateWriter& put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    return bytes(std::as_bytes(std::span(&value, 1)));
  }
  // Appends raw bytes (out of line: inlined into put() with a constant size, GCC 12 warns
  // falsely on the vector's growth).
  StateWriter& bytes(std::span<const std::byte> data);
  StateWriter& floats(std::span<const float> values) { return bytes(std::as_bytes(values)); }
  // A u64 length, then the bytes (a nested state: a route's codec and feedback parts).
  StateWriter& blob(std::span<const std::byte> data) {
    put(static_cast<uint64_t>(data.size()));
    return bytes(data);
  }

  std::span<const std::byte> written() const { return out_; }
  std::vector<std::byte> finish() && { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

class StateReader {
 public:
  // Reads and checks the magic and the version. `context` starts every message ("engine
  // state", "feedback 'ef': cannot load state").
  StateReader(std::string context, std::span<const std::byte> in, const StateKind& kind)
      : context_(std::move(context)), in_(in) {
    const std::string_view expected(kind.magic, 4);
    if (in_.size() < 4 || std::memcmp(in_.data(), kind.magic, 4) != 0) {
      fail(fmt::format("not a \"{}\" state: its magic is {}", expected, shown_magic()));
    }
    at_ = 4;
    version_ = get<uint32_t>("the version");
    if (version_ < kind.oldest || version_ > kind.newest) {
      fail(kind.oldest == kind.newest
               ? fmt::format("version {} is not supported; this build reads version {}",
                             version_, kind.newest)
               : fmt::format("version {} is not supported; this build reads versions {} to {}",
                             version_, kind.oldest, kind.newest));
    }
  }

  uint32_t version() const { return version_; }

  template <typename T>
  T get(const char* what) {
    static_assert(std::is_trivially_copyable_v<T>);
    T value;
    std::memcpy(&value, take(sizeof(T), what).data(), sizeof(T));
    return value;
  }
  std::span<const std::byte> take(size_t bytes, const char* what) {
    if (bytes > left()) {
      fail(fmt::format("truncated: {} needs {} bytes, only {} are left of {}", what, bytes,
                       left(), in_.size()));
    }
    const auto out = in_.subspan(at_, bytes);
    at_ += bytes;
    return out;
  }
  // Fills `out` (its size is what the caller expects; check counts before calling).
  void floats(std::span<float> out, const char* what) {
    const auto in = take(out.size_bytes(), what);
    if (!in.empty()) std::memcpy(out.data(), in.data(), in.size());
  }
  // A u64 length, then that many bytes (StateWriter::blob).
  std::span<const std::byte> blob(const char* what) {
    const auto bytes = get<uint64_t>(what);
    return take(bytes, what);
  }

  size_t left() const { return in_.size() - at_; }
  // Error unless every byte was read.
  void expect_end(const char* after) const {
    if (left() != 0) fail(fmt::format("{} bytes after {}", left(), after));
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(fmt::format("{}: {}", context_, what));
  }

 private:
  std::string shown_magic() const {
    std::string shown;
    for (size_t i = 0; i < std::min<size_t>(4, in_.size()); ++i) {
      const auto c = std::to_integer<unsigned char>(in_[i]);
      shown += (c >= 0x20 && c < 0x7f) ? std::string(1, static_cast<char>(c))
                                       : fmt::format("\\x{:02x}", c);
    }
    return in_.size() < 4 ? fmt::format("\"{}\" (only {} bytes)", shown, in_.size())
                          : fmt::format("\"{}\"", shown);
  }

  std::string context_;
  std::span<const std::byte> in_;
  size_t at_ = 0;
  uint32_t version_ = 0;
};

}  // namespace gradcomp
