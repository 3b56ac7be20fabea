// intq: integer quantization with a scale shared by all ranks, so that an integer allreduce
// adds the codes directly (in the spirit of IntSGD and THC's uniform quantizer).
//
//   round 0: each rank sends max|x| (one float32; +Inf when x holds NaN or Inf), reduced with
//            kMax; absorb_round(0) keeps the shared max M.
//   round 1: q = floor(127 / W) for bits=8, floor(15 / (2 W)) for bits=4, so the sum of W codes
//            cannot overflow; scale = M / q, inv = q / M (if q / M overflows float: inv = 2^127,
//            scale = 2^-127). Each element is rounded stochastically and without bias:
//              c = floor(clamp(fma(x, inv, 128 + u), 128 - q, 128 + q)) - 128,
//            u = (h + 1/2) / 2^15 from 15 bits of CounterRng(seed, bucket, step, rank,
//            stream = element >> 32); elements 2j and 2j+1 share the draw bits(j).
//            decode adds c * scale (one fma) per element; finalize divides by W.
//
// Payload of the last round (summable: kI8 for bits=8, kU8 for bits=4), then one trailer byte:
//   bits=8: n int8 codes c, then the int8 q.
//   bits=4: ceil(n / 2) bytes, element 2j in the low nibble of byte j and 2j+1 in the high one,
//           each holding c + q in [0, 2q] (offset so a byte-wise sum never carries between
//           nibbles: 2 q W <= 15); an odd n leaves the last high nibble 0. Then the uint8 q.
// The trailer sums to summands * q, so a reduced frame tells its decoder the offset to remove
// and is checked against the header's summands. Header aux = float bits of scale. If the input
// holds NaN or Inf the frame carries kFlagNonFinite, zero codes and aux 0, and decodes to NaN
// in every element: the bad step must reach every rank. docs/wire-format.md (intq) has the details.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "codec/factories.h"
#include "codec/one_decoder_codec.h"
#include "common/parallel.h"
#include "gradcomp/error.h"
#include "gradcomp/random.h"

namespace gradcomp {
namespace {

constexpr uint32_t kAbsMask = 0x7fffffffU;
constexpr uint32_t kInfBits = 0x7f800000U;

// The encoding of one step, fixed once the shared max is known.
struct Grid {
  float q = 0;      // largest code magnitude
  float inv = 0;    // encode multiplier, ~ q / max
  float scale = 0;  // decode multiplier, ~ max / q
  float max = 0;    // shared max|x|
};

Grid make_grid(float max, uint32_t q) {
  Grid g{.q = static_cast<float>(q), .max = max};
  if (max > 0) {
    g.inv = g.q / max;
    g.scale = max / g.q;
    if (!std::isfinite(g.inv)) {  // max is tiny: any power-of-two pair with inv*scale=1 works
      g.inv = 0x1.0p127f;
      g.scale = 0x1.0p-127f;
    }
  }
  return g;
}

// Element i's rounding stream: streams split the index space into 2^32-element blocks.
CounterRng chunk_rng(const Context& ctx, size_t begin) {
  return CounterRng(ctx.seed, ctx.bucket, ctx.step, ctx.rank, static_cast<uint32_t>(begin >> 32));
}

// One element's code plus 128, in [128 - q, 128 + q]: the integer part of
//   clamp(fma(x, inv, 128 + u), 128 - q, 128 + q),  u = (h + 1/2) / 2^15,
// with 15 random bits h: u is uniform in (0, 1) and centred, so E[code] = x * inv up to
// 2^-16 of a step, and 128 + u is exact in float (24 bits), so one fma both scales and
// dithers. The bias of 128 keeps the clamped value positive, where truncation is floor; and
// clamping before the conversion keeps it defined: a NaN clamps to 128 - q (the caller flags
// the frame).
inline int32_t biased_code(float x, const Grid& g, uint32_t h) {
  const float u =
      std::fma(static_cast<float>(static_cast<int32_t>(h)), 0x1.0p-15f, 128.0f + 0x1.0p-16f);
  const float t = std::min(128.0f + g.q, std::max(128.0f - g.q, std::fma(x, g.inv, u)));
  return static_cast<int32_t>(t);
}

// max(a, |x| as bits): the bit patterns of |x| order like the values, and every NaN sorts
// above +Inf, so one integer max per element tracks whether x stayed inside [-max, max].
inline uint32_t max_abs_bits(uint32_t a, float x) {
  return std::max(a, std::bit_cast<uint32_t>(x) & kAbsMask);
}

enum class Residual { kNone, kSeparate, kInPlace };

// Quantizes count elements (stream indices first .., first even). Elements 2j and 2j+1 share
// the draw bits(first / 2 + j): bits 0..14 round element 2j, bits 16..30 element 2j+1.
// Codes go to out as bytes (int8: out[i] = c) or nibbles (int4: out[j] = (c0 + q) |
// (c1 + q) << 4, an odd last element alone in the low nibble). The residual x - c * scale
// goes to res (kSeparate), or over x itself (kInPlace: x is not used, res holds the input).
// Returns the largest |x| as bits (above max's bits: the grid did not cover the input).
// Not inlined, and the grid and generator by value: the restrict promises then hold and byte
// stores cannot alias the parameters, so the loop vectorizes.
template <Residual kMode, bool kNibbles, typename Out>
[[gnu::noinline]] uint32_t quantize_pairs(const float* __restrict x, float* __restrict res,
                                          Out* __restrict out, size_t count, size_t first,
                                          const Grid g, const CounterRng rng) {
  const float* src = kMode == Residual::kInPlace ? res : x;
  const auto base = static_cast<uint32_t>(first >> 1);
  const int32_t unbias = kNibbles ? 128 - static_cast<int32_t>(g.q) : 128;  // code + offset
  const size_t pairs = count / 2;
  uint32_t seen = 0;
  uint32_t counter = base;  // a 32-bit induction of its own keeps the hash in 32-bit lanes
  for (size_t j = 0; j < pairs; ++j, ++counter) {
    const uint32_t draw = rng.bits(counter);
    const float x0 = src[2 * j], x1 = src[2 * j + 1];
    const int32_t b0 = biased_code(x0, g, draw & 0x7fff);
    const int32_t b1 = biased_code(x1, g, (draw >> 16) & 0x7fff);
    seen = max_abs_bits(max_abs_bits(seen, x0), x1);
    if constexpr (kNibbles) {
      out[j] = static_cast<Out>((b0 - unbias) | ((b1 - unbias) << 4));
    } else {
      out[2 * j] = static_cast<Out>(b0 - unbias);
      out[2 * j + 1] = static_cast<Out>(b1 - unbias);
    }
    if constexpr (kMode != Residual::kNone) {
      res[2 * j] = std::fma(-static_cast<float>(b0 - 128), g.scale, x0);
      res[2 * j + 1] = std::fma(-static_cast<float>(b1 - 128), g.scale, x1);
    }
  }
  if (count % 2 != 0) {  // the odd last element of the bucket
    const float x0 = src[count - 1];
    const int32_t b0 = biased_code(x0, g, rng.bits(base + static_cast<uint32_t>(pairs)) & 0x7fff);
    seen = max_abs_bits(seen, x0);
    out[kNibbles ? pairs : count - 1] = static_cast<Out>(b0 - unbias);
    if constexpr (kMode != Residual::kNone) {
      res[count - 1] = std::fma(-static_cast<float>(b0 - 128), g.scale, x0);
    }
  }
  return seen;
}

// Picks the kernel for the residual: none, separate, or in place over the input.
template <bool kNibbles, typename Out>
uint32_t quantize_span(const float* x, float* res, Out* out, size_t count, size_t first,
                       const Grid& g, const CounterRng& rng) {
  if (res == nullptr) {
    return quantize_pairs<Residual::kNone, kNibbles>(x, nullptr, out, count, first, g, rng);
  }
  if (res == x) {
    return quantize_pairs<Residual::kInPlace, kNibbles>(nullptr, res, out, count, first, g, rng);
  }
  return quantize_pairs<Residual::kSeparate, kNibbles>(x, res, out, count, first, g, rng);
}

// Without kAdd each element is 0 + its value (decode_into: `sum` is not read).
template <bool kAdd>
[[gnu::noinline]] void decode_i8(const int8_t* __restrict codes, float* __restrict sum,
                                 size_t count, float scale) {
  for (size_t i = 0; i < count; ++i) {
    sum[i] = std::fma(static_cast<float>(codes[i]), scale, kAdd ? sum[i] : 0.0f);
  }
}

// count elements from byte 0 of `bytes`; offset = summands * q, the sum of the code offsets.
template <bool kAdd>
[[gnu::noinline]] void decode_i4(const uint8_t* __restrict bytes, float* __restrict sum,
                                 size_t count, float scale, float offset) {
  const auto base = [&](size_t i) { return kAdd ? sum[i] : 0.0f; };
  for (size_t j = 0; j < count / 2; ++j) {
    const uint32_t v = bytes[j];
    sum[2 * j] = std::fma(static_cast<float>(v & 15U) - offset, scale, base(2 * j));
    sum[2 * j + 1] = std::fma(static_cast<float>(v >> 4) - offset, scale, base(2 * j + 1));
  }
  if (count % 2 != 0) {
    const size_t last = count - 1;
    sum[last] = std::fma(static_cast<float>(bytes[last / 2] & 15U) - offset, scale, base(last));
  }
}

// The residual must be empty, the input itself (in place), or a separate array of the same
// length: a partial overlap would be overwritten before it is read.
void check_intq_residual(const char* codec, std::span<const float> input,
                         std::span<float> residual) {
  if (residual.empty()) return;
  if (residual.size() != input.size()) {
    throw Error(fmt::format("codec '{}': residual has {} elements, the input {}", codec,
                            residual.size(), input.size()));
  }
  const float* r = residual.data();
  const float* x = input.data();
  if (r != x && r < x + input.size() && x < r + residual.size()) {
    throw Error(
        fmt::format("codec '{}': the residual partly overlaps the input; it must be the "
                    "input itself or a separate array",
                    codec));
  }
}

class IntQCodec final : public OneDecoderCodec<IntQCodec> {
 public:
  explicit IntQCodec(unsigned bits) : bits_(bits) {}

  CodecId id() const override { return CodecId::kIntQ; }
  std::string spec() const override { return fmt::format("intq:bits={}", bits_); }
  CodecTraits traits() const override {
    return {.summable = true,
            .payload_type = bits_ == 8 ? DType::kI8 : DType::kU8,
            .shardable = false,
            .rounds = 2,
            .bits_per_element = static_cast<double>(bits_)};
  }
  size_t max_frame_bytes(size_t n) const override { return kFrameHeaderBytes + code_bytes(n) + 1; }
  ReduceOp round_op(int round) const override {
    check_round(round, 0, "round_op");
    return ReduceOp::kMax;
  }
  size_t max_round_bytes(int round, size_t) const override {
    check_round(round, 0, "max_round_bytes");
    return kFrameHeaderBytes + 4;
  }

  size_t encode_round(int round, std::span<const float> input, std::span<std::byte> out,
                      const Context& ctx) override;
  void absorb_round(int round, std::span<const std::byte> reduced, const Context& ctx) override;
  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override;

 private:
  friend class OneDecoderCodec<IntQCodec>;
  template <bool kAdd>  // OneDecoderCodec
  void decode(std::span<const std::byte> frame, std::span<float> sum, const Context& ctx) const;
  size_t code_bytes(size_t n) const { return bits_ == 8 ? n : (n + 1) / 2; }
  uint32_t max_code(uint32_t world) const;
  void check_round(int round, int last, const char* what) const;
  void check_out(std::span<std::byte> out, size_t need) const;
  uint32_t quantize_all(std::span<const float> input, std::byte* payload, std::span<float> residual,
                        const Grid& g, const Context& ctx) const;
  void encode_non_finite(size_t n, std::byte* payload, std::span<float> residual) const;
  float checked_scale(const FrameHeader& h, std::span<const std::byte> payload) const;

  unsigned bits_;
  float shared_max_ = 0;
  uint64_t shared_n_ = 0;
  bool has_max_ = false;
};

void IntQCodec::check_round(int round, int last, const char* what) const {
  if (round < 0 || round > last) {
    throw Error(fmt::format("codec 'intq': {} of round {}; rounds before the last are 0 .. {}",
                            what, round, last));
  }
}

void IntQCodec::check_out(std::span<std::byte> out, size_t need) const {
  if (out.size() < need) {
    throw Error(fmt::format("codec 'intq': output buffer of {} bytes cannot hold a {}-byte frame",
                            out.size(), need));
  }
}

// q for W ranks; throws when not even q = 1 keeps the sum of W codes inside the field.
uint32_t IntQCodec::max_code(uint32_t world) const {
  const uint32_t limit = bits_ == 8 ? 127 : 7;  // largest W with q >= 1
  if (world == 0 || world > limit) {
    throw Error(fmt::format(
        "codec 'intq': bits={} supports a world size of 1 .. {} (the sum of W codes in [-q, q] "
        "must fit {}, with q >= 1), but world_size = {}{}",
        bits_, limit, bits_ == 8 ? "an int8: q W <= 127" : "a 4-bit field: 2 q W <= 15", world,
        bits_ == 4 ? "; use bits=8 for up to 127 ranks" : ""));
  }
  return bits_ == 8 ? 127 / world : 15 / (2 * world);
}

// Round 0: max|x| as a float, computed on the bit patterns: |x| bits order like the values,
// every NaN sorts above +Inf, and an integer max is exact in any order.
size_t IntQCodec::encode_round(int round, std::span<const float> input, std::span<std::byte> out,
                               const Context& ctx) {
  check_round(round, 0, "encode_round");
  max_code(ctx.world_size);  // fail early on a world too large for the width
  const size_t size = kFrameHeaderBytes + 4;
  check_out(out, size);
  const uint32_t max_bits = reduce_chunks<uint32_t>(
      input.size(), ctx.threads, 0U,
      [&](size_t b, size_t e) {
        uint32_t m = 0;
        for (size_t i = b; i < e; ++i) m = max_abs_bits(m, input[i]);
        return m;
      },
      [](uint32_t a, uint32_t b) { return std::max(a, b); });
  // +Inf for any NaN: a float kMax reduction would drop a NaN depending on operand order.
  const float max = std::bit_cast<float>(std::min(max_bits, kInfBits));
  std::memcpy(out.data() + kFrameHeaderBytes, &max, 4);
  write_frame_header({.codec_id = static_cast<uint8_t>(id()),
                      .round = 0,
                      .param_hash = param_hash(),
                      .elements = input.size(),
                      .payload_bytes = 4},
                     out);
  return size;
}

void IntQCodec::absorb_round(int round, std::span<const std::byte> reduced, const Context&) {
  check_round(round, 1, "absorb_round");
  if (round == 1) return;  // nothing to keep from the last round
  const FrameHeader peek = read_frame_header(reduced);
  FrameHeader h;
  const auto payload = check_frame(reduced, expectation(peek.elements, 0), &h);
  // Round 0 carries a NaN or Inf as +Inf in its payload: no flag, and aux 0.
  check_plain_header(h, "intq", /*summable=*/true, /*allowed_flags=*/0);
  if (payload.size() != 4) {
    throw FrameError(
        fmt::format("codec 'intq': round-0 payload is {} bytes, expected one "
                    "float32 (4 bytes)",
                    payload.size()));
  }
  float max;
  std::memcpy(&max, payload.data(), 4);
  if (std::signbit(max)) {
    throw FrameError(fmt::format("codec 'intq': round-0 max|x| = {} is negative", max));
  }
  shared_max_ = std::isnan(max) ? std::numeric_limits<float>::infinity() : max;
  shared_n_ = peek.elements;
  has_max_ = true;
}

uint32_t IntQCodec::quantize_all(std::span<const float> input, std::byte* payload,
                                 std::span<float> residual, const Grid& g,
                                 const Context& ctx) const {
  const float* x = input.data();
  float* res = residual.empty() ? nullptr : residual.data();
  return reduce_chunks<uint32_t>(
      input.size(), ctx.threads, 0U,
      [&](size_t b, size_t e) {
        const CounterRng rng = chunk_rng(ctx, b);
        float* r = res ? res + b : nullptr;
        if (bits_ == 4) {  // chunks start at even elements, so on a byte
          return quantize_span<true>(x + b, r, reinterpret_cast<uint8_t*>(payload) + b / 2, e - b,
                                     b, g, rng);
        }
        return quantize_span<false>(x + b, r, reinterpret_cast<int8_t*>(payload) + b, e - b, b, g,
                                    rng);
      },
      [](uint32_t a, uint32_t b) { return std::max(a, b); });
}

// A non-finite input: the flag makes decode give NaN everywhere, so the codes are irrelevant
// and written as zero bytes; the residual is input - NaN = NaN.
void IntQCodec::encode_non_finite(size_t n, std::byte* payload, std::span<float> residual) const {
  std::memset(payload, 0, code_bytes(n));
  for (float& r : residual) r = std::numeric_limits<float>::quiet_NaN();
}

size_t IntQCodec::encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                         std::span<float> residual) {
  const size_t n = input.size();
  const uint32_t q = max_code(ctx.world_size);
  if (!has_max_ || shared_n_ != n) {
    throw Error(
        fmt::format("codec 'intq': the last round of {} elements needs the shared max of "
                    "round 0 for the same elements (encode_round(0), allreduce with max, "
                    "absorb_round(0))",
                    n));
  }
  check_intq_residual("intq", input, residual);
  const size_t size = max_frame_bytes(n);
  check_out(out, size);
  std::byte* payload = out.data() + kFrameHeaderBytes;
  FrameHeader h{.codec_id = static_cast<uint8_t>(id()),
                .round = 1,
                .param_hash = param_hash(),
                .elements = n,
                .payload_bytes = code_bytes(n) + 1};
  const Grid g = make_grid(shared_max_, q);
  // The largest |x| seen while quantizing: above the agreed max (when the input changed since
  // round 0) it was clamped and the residual keeps the rest; NaN or Inf must reach the output.
  const bool non_finite =
      !std::isfinite(shared_max_) || quantize_all(input, payload, residual, g, ctx) >= kInfBits;
  if (non_finite) {
    encode_non_finite(n, payload, residual);
    h.flags = kFlagNonFinite;
  } else {
    h.aux = std::bit_cast<uint32_t>(g.scale);
  }
  payload[code_bytes(n)] = static_cast<std::byte>(q);  // sums to summands * q
  write_frame_header(h, out);
  return size;
}

// The scale from aux, after checking the trailer against the summands.
float IntQCodec::checked_scale(const FrameHeader& h, std::span<const std::byte> payload) const {
  const auto raw = std::to_integer<uint8_t>(payload.back());
  const int32_t trailer = bits_ == 8 ? static_cast<int8_t>(raw) : raw;
  const int32_t limit = bits_ == 8 ? 127 : 7;  // q * summands never exceeds these
  if (trailer < 1 || trailer > limit || static_cast<uint32_t>(trailer) % h.summands != 0) {
    throw FrameError(fmt::format(
        "codec 'intq': trailer q * summands = {} must be in [1, {}] and a multiple of the {} "
        "summands: the frame is corrupted or was summed beyond the world size bits={} allows",
        trailer, limit, h.summands, bits_));
  }
  if ((h.flags & ~kFlagNonFinite) != 0) {
    throw FrameError(fmt::format("codec 'intq': frame flags 0x{:02x} hold unknown bits; allowed: "
                                 "0x00 or 0x{:02x} (non-finite)",
                                 h.flags, kFlagNonFinite));
  }
  const float scale = std::bit_cast<float>(h.aux);
  if (!(h.flags & kFlagNonFinite) && !(std::isfinite(scale) && scale >= 0)) {
    throw FrameError(
        fmt::format("codec 'intq': scale {} in the header is not a finite number "
                    ">= 0",
                    scale));
  }
  return scale;
}

template <bool kAdd>
void IntQCodec::decode(std::span<const std::byte> frame, std::span<float> sum,
                       const Context& ctx) const {
  FrameHeader h;
  const auto payload = check_frame(frame, expectation(sum.size(), 1), &h);
  const size_t n = sum.size();
  if (payload.size() != code_bytes(n) + 1) {
    throw FrameError(
        fmt::format("codec 'intq': payload of {} bytes; {} elements at {} bits need "
                    "{} bytes of codes and a 1-byte trailer",
                    payload.size(), n, bits_, code_bytes(n)));
  }
  const float scale = checked_scale(h, payload);
  if (h.flags & kFlagNonFinite) {  // the input held NaN or Inf somewhere
    for (float& s : sum) s = (kAdd ? s : 0.0f) + std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const auto offset = static_cast<float>(std::to_integer<uint8_t>(payload.back()));
  const std::byte* codes = payload.data();
  for_chunks(n, ctx.threads, [&](size_t b, size_t e, size_t) {
    if (bits_ == 8) {
      decode_i8<kAdd>(reinterpret_cast<const int8_t*>(codes) + b, sum.data() + b, e - b, scale);
    } else {  // chunks start at even elements, so on a byte
      decode_i4<kAdd>(reinterpret_cast<const uint8_t*>(codes) + b / 2, sum.data() + b, e - b, scale,
                      offset);
    }
  });
}

}  // namespace

std::unique_ptr<Codec> make_intq(Spec& spec) {
  const std::string bits = spec.get_choice("bits", "8", {"8", "4"});
  return std::make_unique<IntQCodec>(bits == "8" ? 8U : 4U);
}

}  // namespace gradcomp
