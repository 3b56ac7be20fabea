// The element types and reductions transports and codecs share: a transport adds summable
// payloads element-wise by their type, without knowing the codec that wrote them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gradcomp {

// Element type of a summable payload, so a transport can add payloads element-wise.
enum class DType : uint8_t { kNone, kF32, kF16, kBF16, kI8, kU8, kI32 };
// How the frames of one round are combined across ranks.
enum class ReduceOp : uint8_t { kSum, kMax };

size_t dtype_size(DType type);
// "f32", "f16", "bf16", "i8", "u8", "i32", or "none": for messages.
const char* dtype_name(DType type);

}  // namespace gradcomp
