#include "gradcomp/dtype.h"

namespace gradcomp {

size_t dtype_size(DType type) {
  switch (type) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kI8:
    case DType::kU8:
      return 1;
    case DType::kNone:
      break;
  }
  return 0;
}

const char* dtype_name(DType type) {
  switch (type) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kI8:
      return "i8";
    case DType::kU8:
      return "u8";
    case DType::kI32:
      return "i32";
    case DType::kNone:
      break;
  }
  return "none";
}

}  // namespace gradcomp
