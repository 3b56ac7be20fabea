// dither: stochastic dithering (Horvath et al., "Natural Compression for Distributed Deep
// Learning", 2019; BytePS's "dithering" compressor). Unbiased; not summable.
//
// With scale = max |x| (norm=max) or ||x||_2 (norm=l2) and s = levels, |x| / scale in [0, 1] is
// rounded stochastically, without bias, to one of the two neighbouring points of a grid:
//   partition=linear:  {0, 1/s, 2/s, ..., 1}
//   partition=natural: {0, 2^(1-s), 2^(2-s), ..., 1/2, 1}
// and decoded = sign(x) * grid point * scale.
//
// Payload (docs/wire-format.md (dither)): float32 scale, then n codes of width ceil(log2(s + 1)) + 1
// bits, code = k << 1 | sign with k the grid index in 0..s, packed LSB-first.
#include <fmt/format.h>

#include "codec/factories.h"
#include "codec/stochastic_levels.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

using namespace levels;

enum class Partition { kLinear, kNatural };
enum class Norm { kMax, kL2 };

// The natural grid's largest s: its smallest nonzero point 2^(1-s) is then still a normal float.
constexpr int64_t kMaxNaturalLevels = 127;

// Grid point k of the natural partition with s levels, as a multiple of the scale: 0 for k = 0,
// else 2^(k-s), built from its exponent bits (1 <= k <= s <= 127 keeps it a normal float).
inline float natural_point(uint32_t k, uint32_t levels) {
  return std::bit_cast<float>(k == 0 ? 0U : (k + 127 - levels) << 23);
}

// The decoded value of index k and sign bit `sign`. Zero times a non-finite scale is NaN, so an
// input holding Inf or NaN decodes to NaN.
inline float dithered_natural_value(uint32_t k, uint32_t sign, uint32_t levels, float scale) {
  return with_sign(natural_point(k, levels) * scale, sign);
}

// What quantizing on the natural grid of one scale needs, computed once per call.
struct NaturalScale {
  uint32_t levels = 1;
  float scale = 0.0f;
  Grid grid;                  // |x| -> v = |x| / scale
  float lowest = 0.0f;        // 2^(1-s), the smallest nonzero grid point
  float below_lowest = 0.0f;  // 2^(s-1), maps [0, 2^(1-s)) onto [0, 1)

  static NaturalScale make(float scale, uint32_t levels) {
    return {levels, scale, Grid::make(scale, 1.0f), natural_point(1, levels),
            std::bit_cast<float>((levels - 1 + 127) << 23)};
  }
};

// Quantizes x[0, count) on the natural grid of `scale`: codes k << 1 | sign, and the residual
// x - decoded if kResidual (it may alias x). A non-finite scale sends index 0 (decodes to NaN).
template <bool kResidual>
void quantize_natural(const float* x, size_t count, uint32_t first_index, const CounterRng& rng,
                      const NaturalScale& grid_scale, uint32_t* codes, float* residual) {
  const uint32_t levels = grid_scale.levels;
  const float scale = grid_scale.scale;
  if (!std::isfinite(scale)) {
    for (size_t j = 0; j < count; ++j) {
      codes[j] = 0;
      if constexpr (kResidual) residual[j] = x[j] - dithered_natural_value(0, 0, levels, scale);
    }
    return;
  }
  const Grid grid = grid_scale.grid;
  const float lowest = grid_scale.lowest, below_lowest = grid_scale.below_lowest;
#pragma omp simd
  for (size_t j = 0; j < count; ++j) {
    const float xj = x[j];  // read before the residual (which may alias x) is written
    const uint32_t sign = sign_bit(xj);
    const uint32_t random = rng.bits(first_index + static_cast<uint32_t>(j));
    const float v = grid.units(std::fabs(xj));
    // v in [2^e, 2^(e+1)) with e >= 1-s: index e + s, up with probability (v - 2^e) / 2^e.
    const uint32_t v_bits = std::bit_cast<uint32_t>(v);
    const uint32_t upper =
        std::min(round_to_power_of_two(v_bits, random, 0xffU) + levels - 127, levels);
    // v < 2^(1-s): between 0 and 2^(1-s), up with probability v / 2^(1-s).
    const float u = static_cast<float>(random >> 8) * 0x1.0p-24f;
    const uint32_t lower = u < v * below_lowest ? 1U : 0U;
    // A mask rather than ?:, which GCC turns into a branch that stops vectorisation here.
    const uint32_t take_upper = 0U - static_cast<uint32_t>(v >= lowest);
    const uint32_t k = (upper & take_upper) | (lower & ~take_upper);
    codes[j] = k << 1 | sign;
    if constexpr (kResidual) residual[j] = xj - dithered_natural_value(k, sign, levels, scale);
  }
}

class DitherCodec final : public Codec {
 public:
  DitherCodec(uint32_t levels, Partition partition, Norm norm)
      : levels_(levels), partition_(partition), norm_(norm), width_(level_bits(levels) + 1) {}

  CodecId id() const override { return CodecId::kDither; }
  std::string spec() const override {
    return fmt::format("dither:levels={},partition={},norm={}", levels_,
                       partition_ == Partition::kLinear ? "linear" : "natural",
                       norm_ == Norm::kMax ? "max" : "l2");
  }
  CodecTraits traits() const override { return {.bits_per_element = static_cast<double>(width_)}; }
  size_t max_frame_bytes(size_t n) const override { return kFrameHeaderBytes + payload_bytes(n); }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override;
  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override;

 private:
  size_t payload_bytes(size_t n) const { return 4 + packed_bytes(n, width_); }

  // Packs the codes quantizer(x, count, first_index, rng, grid, codes, residual) writes.
  template <typename Quantizer, typename GridScale>
  void quantize_all(std::span<const float> input, std::span<float> residual, const Context& ctx,
                    const GridScale& grid, std::byte* codes_out, Quantizer quantizer) const {
    const ElementRng rng(ctx, input.size());
    const float* x = input.data();
    float* res = residual.empty() ? nullptr : residual.data();
    auto quantize_group = [&](size_t i, size_t count, uint32_t* codes) {
      quantizer(x + i, count, static_cast<uint32_t>(i), rng.at(i), grid, codes,
                res ? res + i : nullptr);
    };
    with_width(width_, [&](auto bits) {
      pack_codes<decltype(bits)::value>(input.size(), ctx.threads, codes_out, quantize_group);
    });
  }

  uint32_t levels_;
  Partition partition_;
  Norm norm_;
  unsigned width_;  // bits per code
};

size_t DitherCodec::encode(std::span<const float> input, std::span<std::byte> out,
                           const Context& ctx, std::span<float> residual) {
  const size_t n = input.size();
  if (out.size() < max_frame_bytes(n)) throw Error("dither: output buffer too small");
  if (!residual.empty() && residual.size() != n) {
    throw Error(fmt::format("dither: residual has {} elements, input {}", residual.size(), n));
  }
  const float scale =
      norm_ == Norm::kMax ? max_abs(input, ctx.threads) : l2_norm(input.data(), 0, n, ctx.threads);
  std::byte* payload = out.data() + kFrameHeaderBytes;
  store_f32(payload, scale);

  // Each kernel is instantiated with and without the residual, so neither loop tests for it.
  auto kernel = [&](auto linear_kernel, auto natural_kernel) {
    if (partition_ == Partition::kLinear) {
      quantize_all(input, residual, ctx, LinearScale::make(scale, levels_), payload + 4,
                   linear_kernel);
    } else {
      quantize_all(input, residual, ctx, NaturalScale::make(scale, levels_), payload + 4,
                   natural_kernel);
    }
  };
  if (residual.empty()) {
    kernel(quantize_linear<false>, quantize_natural<false>);
  } else {
    kernel(quantize_linear<true>, quantize_natural<true>);
  }

  const FrameHeader h{.codec_id = static_cast<uint8_t>(id()),
                      .flags = std::isfinite(scale) ? uint8_t{0} : kFlagNonFinite,
                      .param_hash = param_hash(),
                      .elements = n,
                      .payload_bytes = payload_bytes(n)};
  write_frame_header(h, out);
  return kFrameHeaderBytes + h.payload_bytes;
}

void DitherCodec::decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                                    const Context& ctx) const {
  FrameHeader header;
  const auto payload = check_frame(frame, expectation(sum.size()), &header);
  check_plain_header(header, "dither", /*summable=*/false);
  const size_t n = sum.size();
  const float scale = read_scale_and_codes("dither", payload, n, width_);
  const std::byte* codes_in = payload.data() + 4;
  float* out = sum.data();
  const uint32_t levels = levels_;
  const float step = scale / static_cast<float>(levels);
  auto add_linear_group = [&](size_t i, size_t count, const uint32_t* codes) {
    add_linear(codes, count, step, out + i);
  };
  auto add_natural_group = [&](size_t i, size_t count, const uint32_t* codes) {
    float* s = out + i;
#pragma omp simd
    for (size_t j = 0; j < count; ++j) {
      s[j] += dithered_natural_value(codes[j] >> 1, codes[j] & 1, levels, scale);
    }
  };
  with_width(width_, [&](auto bits) {
    constexpr unsigned B = decltype(bits)::value;
    check_levels<B>(codes_in, n, ctx.threads, levels_, "dither");
    if (partition_ == Partition::kLinear) {
      unpack_codes<B>(codes_in, n, ctx.threads, add_linear_group);
    } else {
      unpack_codes<B>(codes_in, n, ctx.threads, add_natural_group);
    }
  });
}

}  // namespace

std::unique_ptr<Codec> make_dither(Spec& spec) {
  const std::string partition = spec.get_choice("partition", "linear", {"linear", "natural"});
  const std::string norm = spec.get_choice("norm", "max", {"max", "l2"});
  const bool natural = partition == "natural";
  // Defaults after BytePS's experiments: linear 5-bit (s = 15) and natural 3-bit (s = 3), sign
  // included.
  const int64_t levels = spec.get_int("levels", natural ? 3 : 15, 1, int64_t{1} << 15);
  if (natural && levels > kMaxNaturalLevels) {
    spec.fail(
        fmt::format("parameter 'levels' = {} is out of range for partition=natural; "
                    "allowed: an integer in [1, {}]",
                    levels, kMaxNaturalLevels));
  }
  return std::make_unique<DitherCodec>(static_cast<uint32_t>(levels),
                                       natural ? Partition::kNatural : Partition::kLinear,
                                       norm == "max" ? Norm::kMax : Norm::kL2);
}

}  // namespace gradcomp
