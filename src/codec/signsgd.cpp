// signsgd: the sign of each element, one bit (Bernstein et al., signSGD with majority vote).
// Decoded values are +1 and -1 with no scale; the aggregate of W ranks is the majority vote
// sign(sum of signs), 0 on a tie. Zero counts as +. docs/wire-format.md (signsgd) describes the frame.
//
// Payload: ceil(n/8) bytes of sign bits, LSB-first, bit = 1 when x < 0. Signs cannot carry NaN
// or Inf, so the header's non-finite flag does, and the decoder then adds NaN everywhere.
#include "codec/casts_frame.h"
#include "codec/factories.h"
#include "codec/sign_bits.h"

namespace gradcomp {
namespace {

constexpr const char* kSignsgdName = "signsgd";

class SignSgdCodec final : public Codec {
 public:
  CodecId id() const override { return CodecId::kSignSgd; }
  std::string spec() const override { return kSignsgdName; }
  CodecTraits traits() const override {
    return {.bits_per_element = 1, .unbiased = false, .aggregation = Aggregation::kMajorityVote};
  }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + sign_bits::bytes_for(n);
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    casts::check_buffers(kSignsgdName, n, out, max_frame_bytes(n), residual);
    const bool non_finite = sign_bits::pack_chunks(input, out.data() + kFrameHeaderBytes, -1.0f,
                                                   1.0f, residual, ctx.threads);
    write_frame_header({.codec_id = static_cast<uint8_t>(id()),
                        .flags = non_finite ? kFlagNonFinite : uint8_t{0},
                        .param_hash = param_hash(), .elements = n,
                        .payload_bytes = sign_bits::bytes_for(n)},
                       out);
    return max_frame_bytes(n);
  }

  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override {
    FrameHeader h;
    const auto payload = check_frame(frame, expectation(sum.size()), &h);
    casts::accumulate_unscaled_signs(kSignsgdName, h, payload, sum, ctx.threads);
  }

  void finalize(std::span<float> sum, uint32_t) const override { sign_bits::majority_vote(sum); }
};

}  // namespace

std::unique_ptr<Codec> make_signsgd(Spec&) { return std::make_unique<SignSgdCodec>(); }

}  // namespace gradcomp
