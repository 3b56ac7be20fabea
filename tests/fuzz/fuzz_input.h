// What the reader fuzz targets share: turning libFuzzer's bytes into the reader's input, and
// the one rule every target asserts. A reader given untrusted bytes either succeeds or throws
// gradcomp::Error; anything else (another exception type, a crash, a leak, UB) is a finding.
// Targets therefore catch only gradcomp::Error: any other exception escapes
// LLVMFuzzerTestOneInput, and libFuzzer reports it as a crash (an uncaught exception aborts).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"

namespace gradcomp::fuzz {

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Copied by range, never memcpy: for an empty input data may be null.
inline std::vector<std::byte> as_bytes(const uint8_t* data, size_t size) {
  const auto* b = reinterpret_cast<const std::byte*>(data);
  return {b, b + size};
}

// Runs `read`; a gradcomp::Error is the expected answer to malformed input.
template <class F>
void expect_error_or_success(F&& read) {
  try {
    read();
  } catch (const Error&) {
  }
}

// A property of the reader that did not hold: abort, so libFuzzer saves the input.
[[noreturn]] inline void finding(const char* what) {
  std::fprintf(stderr, "fuzz finding: %s\n", what);
  std::abort();
}

// A loaded state must save back to the very bytes it was loaded from: the formats are
// canonical (fixed layout, exact length), so a difference means the reader accepted something
// it did not store, or stored something it did not read.
inline void expect_round_trip(std::span<const std::byte> loaded, const std::vector<std::byte>& saved) {
  if (!std::equal(loaded.begin(), loaded.end(), saved.begin(), saved.end())) {
    finding("save_state() after load_state(bytes) does not give the same bytes back");
  }
}

// One whole step of `codec` on `x` on a single rank: every earlier round encoded and absorbed,
// then the last round's frame, which is returned (seeds, and stepping on a loaded state).
inline std::vector<std::byte> encode_step(Codec& codec, std::span<const float> x, const Context& ctx) {
  for (int r = 0; r + 1 < codec.traits().rounds; ++r) {
    std::vector<std::byte> f(codec.max_round_bytes(r, x.size()));
    f.resize(codec.encode_round(r, x, f, ctx));
    codec.absorb_round(r, f, ctx);
  }
  std::vector<std::byte> frame(codec.max_frame_bytes(x.size()));
  frame.resize(codec.encode(x, frame, ctx));
  return frame;
}

}  // namespace gradcomp::fuzz
