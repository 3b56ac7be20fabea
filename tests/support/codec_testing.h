// Helpers shared by the codec and feedback tests.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/frame.h"

namespace gradcomp::testing {

// A reproducible gradient-like vector: normal values (scale `scale`) from a fixed seed.
std::vector<float> gradient(size_t n, uint64_t seed = 1, float scale = 1.0f);

// Encodes `input` and returns the frame (resized to its real length).
std::vector<std::byte> encode(Codec& codec, std::span<const float> input, const Context& ctx = {},
                              std::span<float> residual = {});

// decode_accumulate into a zero buffer of input's size.
std::vector<float> decode(const Codec& codec, std::span<const std::byte> frame, size_t n,
                          const Context& ctx = {});

// encode then decode.
std::vector<float> roundtrip(Codec& codec, std::span<const float> input, const Context& ctx = {});

// Runs every round of a (possibly multi-round) codec for W ranks inside one process, as an
// allreduce route would, and returns the aggregate after finalize(). inputs[r] is rank r's.
std::vector<float> aggregate_allreduce(const std::string& spec,
                                       const std::vector<std::vector<float>>& inputs,
                                       Context ctx = {});

// Lower-case hex of bytes, for golden-byte comparisons.
std::string hex(std::span<const std::byte> bytes);

// The message of the gradcomp::Error that fn throws, or "no error".
inline std::string error_text(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// Whether `text` contains `part`, showing the whole text when it does not.
inline ::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

// A copy of `frame` whose header went through `edit` (the checksum is recomputed) and whose
// payload is resized to the header's payload_bytes (zero-filled when it grows).
inline std::vector<std::byte> edited(std::vector<std::byte> frame,
                                     const std::function<void(FrameHeader&)>& edit) {
  FrameHeader h = read_frame_header(frame);
  edit(h);
  frame.resize(kFrameHeaderBytes + h.payload_bytes, std::byte{0});
  write_frame_header(h, frame);
  return frame;
}

// Decoding `frame` into n elements throws a FrameError whose message contains `needle`.
inline void expect_frame_error(const Codec& codec, const std::vector<std::byte>& frame, size_t n,
                               const std::string& needle) {
  std::vector<float> sum(n);
  try {
    codec.decode_accumulate(frame, sum, {});
    ADD_FAILURE() << "no FrameError; expected one mentioning '" << needle << "'";
  } catch (const FrameError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// The float32 `offset` bytes into a frame's payload (a scale or a norm the codec sends).
inline float payload_f32(std::span<const std::byte> frame, size_t offset) {
  float v;
  std::memcpy(&v, frame.data() + kFrameHeaderBytes + offset, sizeof v);
  return v;
}

// make_codec(spec) throws a SpecError naming the codec and every string in `needles`.
inline void expect_spec_error(const std::string& spec, const std::vector<std::string>& needles) {
  try {
    make_codec(spec);
    ADD_FAILURE() << "no SpecError for '" << spec << "'";
  } catch (const SpecError& e) {
    for (const auto& needle : needles) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
}

}  // namespace gradcomp::testing
