// A codec whose one decoder serves both of Codec's decode calls. Derived implements
//   template <bool kAdd> void decode(frame, sum, ctx) const;
// which adds each decoded value into `sum` (kAdd: decode_accumulate) or stores 0 + value
// without reading `sum` (decode_into: no fill first), and befriends this class.
#pragma once

#include "gradcomp/codec.h"

namespace gradcomp {

template <class Derived>
class OneDecoderCodec : public Codec {
 public:
  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const final {
    static_cast<const Derived&>(*this).template decode<true>(frame, sum, ctx);
  }
  void decode_into(std::span<const std::byte> frame, std::span<float> out,
                   const Context& ctx) const final {
    static_cast<const Derived&>(*this).template decode<false>(frame, out, ctx);
  }
};

}  // namespace gradcomp
