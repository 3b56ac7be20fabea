// Helpers shared by the codec and feedback tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "gradcomp/codec.h"

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

}  // namespace gradcomp::testing
