// natural: natural compression (Horvath et al., "Natural Compression for Distributed Deep
// Learning", 2019). Each element is rounded stochastically to one of the two powers of two
// around it, keeping its sign; no scale. Unbiased; not summable.
//
//   2^e <= |x| < 2^(e+1):  decoded = sign(x) * 2^(e+1) with probability (|x| - 2^e) / 2^e,
//                                    sign(x) * 2^e     otherwise
//
// Subnormals round the same way between 0 and 2^-126; |x| >= 2^127 rounds down to 2^127 (2^128
// is not a float); zero, Inf and NaN are kept.
//
// Payload (docs/wire-format.md (natural)): n 9-bit codes packed LSB-first, code = sign << 8 | exponent,
// where exponent is a float32 biased exponent: the decoded value has the bits code << 23
// (0 = zero, 1..254 = +-2^(e-127), 255 = +-Inf), except code 0x100 ("-0"), which means NaN.
// Every code is valid.
#include <fmt/format.h>

#include "codec/factories.h"
#include "codec/stochastic_levels.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

using namespace levels;

constexpr unsigned kNaturalBits = 9;
constexpr uint32_t kNanCode = 0x100;
constexpr uint32_t kNanBits = 0x7fc00000U;
constexpr uint32_t kMaxFiniteExponent = 254;

inline float natural_value(uint32_t code) {
  return std::bit_cast<float>(code == kNanCode ? kNanBits : code << 23);
}

// The code of x, rounding with the random bits `random`.
inline uint32_t natural_code(float x, uint32_t random) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t abs_bits = bits & 0x7fffffffU;
  const uint32_t rounded = round_to_power_of_two(abs_bits, random, kMaxFiniteExponent);
  const uint32_t sign = rounded == 0 ? 0 : bits >> 31;  // zero is always +0 (-0 means NaN)
  const uint32_t special = abs_bits == 0x7f800000U ? bits >> 23 : kNanCode;  // Inf : NaN
  // Selects rather than branches, so the loop vectorises.
  return (abs_bits >> 23) == 0xff ? special : sign << 8 | rounded;
}

class NaturalCodec final : public Codec {
 public:
  CodecId id() const override { return CodecId::kNatural; }
  std::string spec() const override { return "natural"; }
  CodecTraits traits() const override { return {.bits_per_element = kNaturalBits}; }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + packed_bytes(n, kNaturalBits);
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override;
  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override;
};

template <bool kResidual>
void round_naturally(const float* x, size_t count, uint32_t first_index, const CounterRng& rng,
                     uint32_t* codes, float* residual) {
#pragma omp simd
  for (size_t j = 0; j < count; ++j) {
    const float xj = x[j];  // read before the residual (which may alias x) is written
    const uint32_t code = natural_code(xj, rng.bits(first_index + static_cast<uint32_t>(j)));
    codes[j] = code;
    if constexpr (kResidual) residual[j] = xj - natural_value(code);
  }
}

size_t NaturalCodec::encode(std::span<const float> input, std::span<std::byte> out,
                            const Context& ctx, std::span<float> residual) {
  const size_t n = input.size();
  if (out.size() < max_frame_bytes(n)) throw Error("natural: output buffer too small");
  if (!residual.empty() && residual.size() != n) {
    throw Error(fmt::format("natural: residual has {} elements, input {}", residual.size(), n));
  }
  const ElementRng rng(ctx, n);
  const float* x = input.data();
  float* res = residual.empty() ? nullptr : residual.data();
  std::byte* payload = out.data() + kFrameHeaderBytes;
  pack_codes<kNaturalBits>(n, ctx.threads, payload, [&](size_t i, size_t count, uint32_t* codes) {
    const auto index = static_cast<uint32_t>(i);
    if (res) {
      round_naturally<true>(x + i, count, index, rng.at(i), codes, res + i);
    } else {
      round_naturally<false>(x + i, count, index, rng.at(i), codes, nullptr);
    }
  });
  // The payload carries Inf and NaN itself, so kFlagNonFinite is not needed.
  const FrameHeader h{.codec_id = static_cast<uint8_t>(id()),
                      .param_hash = param_hash(),
                      .elements = n,
                      .payload_bytes = packed_bytes(n, kNaturalBits)};
  write_frame_header(h, out);
  return kFrameHeaderBytes + h.payload_bytes;
}

void NaturalCodec::decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                                     const Context& ctx) const {
  FrameHeader header;
  const auto payload = check_frame(frame, expectation(sum.size()), &header);
  check_plain_header(header, "natural", /*summable=*/false);
  const size_t n = sum.size();
  if (payload.size() != packed_bytes(n, kNaturalBits)) {
    throw FrameError(
        fmt::format("natural: payload is {} bytes; expected {} for {} elements "
                    "(9-bit codes)",
                    payload.size(), packed_bytes(n, kNaturalBits), n));
  }
  check_padding(payload.data(), n, kNaturalBits, "natural");
  float* out = sum.data();
  unpack_codes<kNaturalBits>(payload.data(), n, ctx.threads,
                             [&](size_t i, size_t count, const uint32_t* codes) {
                               float* s = out + i;
#pragma omp simd
                               for (size_t j = 0; j < count; ++j) s[j] += natural_value(codes[j]);
                             });
}

}  // namespace

std::unique_ptr<Codec> make_natural(Spec&) { return std::make_unique<NaturalCodec>(); }

}  // namespace gradcomp
