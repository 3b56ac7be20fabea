// Checkpoint bytes: fields appended in the machine's (little-endian) order, and read back with
// every length checked, so a truncated or foreign state is an Error, never an overread.
#pragma once

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradcomp/error.h"

namespace gradcomp {

// Appends raw bytes (resize + memcpy: GCC 12 warns falsely on vector::insert of bytes).
inline void put_bytes(std::vector<std::byte>& out, const void* data, size_t n) {
  const size_t at = out.size();
  out.resize(at + n);
  if (n > 0) std::memcpy(out.data() + at, data, n);
}

template <typename T>
void put(std::vector<std::byte>& out, T value) {
  put_bytes(out, &value, sizeof(T));
}

class ByteReader {
 public:
  // `context` starts every error message ("route 'topk' state", "engine state").
  ByteReader(std::string context, std::span<const std::byte> in)
      : context_(std::move(context)), in_(in) {}

  template <typename T>
  T get(const char* what) {
    T value;
    std::memcpy(&value, take(sizeof(T), what).data(), sizeof(T));
    return value;
  }
  std::span<const std::byte> take(size_t bytes, const char* what) {
    if (bytes > left()) {
      throw Error(fmt::format("{} is truncated: {} needs {} bytes, only {} are left of {}",
                              context_, what, bytes, left(), in_.size()));
    }
    const auto out = in_.subspan(at_, bytes);
    at_ += bytes;
    return out;
  }
  size_t left() const { return in_.size() - at_; }

 private:
  std::string context_;
  std::span<const std::byte> in_;
  size_t at_ = 0;
};

}  // namespace gradcomp
