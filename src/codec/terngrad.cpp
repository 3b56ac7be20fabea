// terngrad: TernGrad (Wen et al., NeurIPS 2017), stochastic ternarization scaled by max |x|.
// Unbiased; not summable (each rank has its own scale).
//
//   t_i = sign(x_i) * Bernoulli(|x_i| / scale),  scale = max_i |x_i|
//   decoded_i = t_i * scale
//
// Payload (docs/wire-format.md (terngrad)): float32 scale, then n 2-bit codes packed LSB-first:
// 0 = 0, 1 = +scale, 2 = -scale; code 3 is invalid and rejected.
#include <fmt/format.h>

#include "codec/factories.h"
#include "codec/stochastic_levels.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

using namespace levels;

constexpr unsigned kTernBits = 2;
constexpr uint32_t kTopCode = 2;

// The wire code of a ternary value with magnitude `level` (0 or 1) and sign bit `sign`.
inline uint32_t ternary_code(uint32_t level, uint32_t sign) { return level << sign; }

class TernGradCodec final : public Codec {
 public:
  CodecId id() const override { return CodecId::kTernGrad; }
  std::string spec() const override { return "terngrad"; }
  CodecTraits traits() const override { return {.bits_per_element = kTernBits}; }
  size_t max_frame_bytes(size_t n) const override { return kFrameHeaderBytes + payload_bytes(n); }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override;
  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override;

 private:
  static size_t payload_bytes(size_t n) { return 4 + packed_bytes(n, kTernBits); }
};

// Ternarizes x[0, count): codes, and the residual if kResidual.
template <bool kResidual>
void ternarize(const float* x, size_t count, uint32_t first_index, const CounterRng& rng,
               float scale, const Grid& grid, uint32_t* codes, float* residual) {
  if (!std::isfinite(scale)) {  // Inf/NaN inside: send zeros, which decode to 0 * scale = NaN
    for (size_t j = 0; j < count; ++j) {
      codes[j] = 0;
      if constexpr (kResidual) residual[j] = x[j] - linear_value(0, 0, scale);
    }
    return;
  }
#pragma omp simd
  for (size_t j = 0; j < count; ++j) {
    const float xj = x[j];  // read before the residual (which may alias x) is written
    const uint32_t sign = sign_bit(xj);
    const uint32_t level = stochastic_round(grid.units(std::fabs(xj)),
                                            rng.bits(first_index + static_cast<uint32_t>(j)), 1);
    codes[j] = ternary_code(level, sign);
    if constexpr (kResidual) residual[j] = xj - linear_value(level, sign, scale);
  }
}

size_t TernGradCodec::encode(std::span<const float> input, std::span<std::byte> out,
                             const Context& ctx, std::span<float> residual) {
  const size_t n = input.size();
  if (out.size() < max_frame_bytes(n)) throw Error("terngrad: output buffer too small");
  if (!residual.empty() && residual.size() != n) {
    throw Error(fmt::format("terngrad: residual has {} elements, input {}", residual.size(), n));
  }
  const float scale = max_abs(input, ctx.threads);
  std::byte* payload = out.data() + kFrameHeaderBytes;
  store_f32(payload, scale);

  const Grid grid = Grid::make(scale, 1.0f);  // |x| -> |x| / scale
  const ElementRng rng(ctx, n);
  const float* x = input.data();
  float* res = residual.empty() ? nullptr : residual.data();
  pack_codes<kTernBits>(n, ctx.threads, payload + 4, [&](size_t i, size_t count, uint32_t* codes) {
    const auto index = static_cast<uint32_t>(i);
    if (res) {
      ternarize<true>(x + i, count, index, rng.at(i), scale, grid, codes, res + i);
    } else {
      ternarize<false>(x + i, count, index, rng.at(i), scale, grid, codes, nullptr);
    }
  });

  const FrameHeader h{.codec_id = static_cast<uint8_t>(id()),
                      .flags = std::isfinite(scale) ? uint8_t{0} : kFlagNonFinite,
                      .param_hash = param_hash(),
                      .elements = n,
                      .payload_bytes = payload_bytes(n)};
  write_frame_header(h, out);
  return kFrameHeaderBytes + h.payload_bytes;
}

void TernGradCodec::decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                                      const Context& ctx) const {
  FrameHeader header;
  const auto payload = check_frame(frame, expectation(sum.size()), &header);
  check_plain_header(header, "terngrad", /*summable=*/false);
  const size_t n = sum.size();
  const float scale = read_scale_and_codes("terngrad", payload, n, kTernBits);
  const std::byte* codes_in = payload.data() + 4;
  if (max_code<kTernBits>(codes_in, n, ctx.threads) > kTopCode) {
    throw FrameError("terngrad: a code is 3; allowed: 0 (zero), 1 (+scale), 2 (-scale)");
  }
  float* out = sum.data();
  unpack_codes<kTernBits>(codes_in, n, ctx.threads,
                          [&](size_t i, size_t count, const uint32_t* codes) {
                            float* s = out + i;
#pragma omp simd
                            for (size_t j = 0; j < count; ++j) {
                              const uint32_t sign = codes[j] >> 1;           // code 2
                              const uint32_t level = (codes[j] | sign) & 1;  // codes 1 and 2
                              s[j] += linear_value(level, sign, scale);
                            }
                          });
}

}  // namespace

std::unique_ptr<Codec> make_terngrad(Spec&) { return std::make_unique<TernGradCodec>(); }

}  // namespace gradcomp
