// The codecs the frame fuzzer decodes with, and the layout of a fuzz input:
//   byte 0: which codec (index into fuzz_specs(), modulo its size)
//   byte 1: bit 0 set -> re-seal the header checksum, so mutated header fields reach decoders;
//           bit 1 set -> decode as the first round of a multi-round codec
//   bytes 2..: the frame
#pragma once

#include <string>
#include <vector>

namespace gradcomp::fuzz {

inline const std::vector<std::string>& fuzz_specs() {
  static const std::vector<std::string> specs = {
      "none", "fp16", "bf16", "qsgd:levels=16", "qsgd:levels=1", "terngrad", "natural",
      "dither:levels=8", "dither:levels=5,partition=natural,norm=l2", "signsgd", "efsignsgd",
      "signum", "onebit", "topk:ratio=0.1", "randomk:ratio=0.1", "dgc:ratio=0.1",
      "threshold:tau=0.5", "powersgd:rank=2", "intq:bits=8", "intq:bits=4", "onebit:block=64"};
  return specs;
}

// Largest element count a fuzz input may ask for (bigger headers are rejected by the decoder).
inline constexpr size_t kMaxFuzzElements = size_t{1} << 16;

}  // namespace gradcomp::fuzz
