#include "common/state_io.h"

namespace gradcomp {

StateWriter& StateWriter::bytes(std::span<const std::byte> data) {
  const size_t at = out_.size();
  out_.resize(at + data.size());
  if (!data.empty()) std::memcpy(out_.data() + at, data.data(), data.size());
  return *this;
}

}  // namespace gradcomp
