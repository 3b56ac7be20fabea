// Test helpers for the cast and sign codecs (fp16, bf16, signsgd, efsignsgd, signum, onebit):
// frame surgery with a valid header checksum, and error-message checks.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"

namespace gradcomp::testing {

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
