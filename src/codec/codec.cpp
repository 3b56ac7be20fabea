// The Codec base: defaults, the registry of spec names, and the reference payload reduction.
#include "gradcomp/codec.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <utility>

#include "codec/factories.h"
#include "common/half.h"
#include "common/reduce.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

struct Entry {
  const char* name;
  CodecId id;
  std::unique_ptr<Codec> (*make)(Spec&);
};

// Documentation order: casts, stochastic quantizers, signs, sparsifiers, low rank, integers.
constexpr Entry kCodecs[] = {
    {"none", CodecId::kNone, make_none},
    {"fp16", CodecId::kFp16, make_fp16},
    {"bf16", CodecId::kBf16, make_bf16},
    {"qsgd", CodecId::kQsgd, make_qsgd},
    {"terngrad", CodecId::kTernGrad, make_terngrad},
    {"natural", CodecId::kNatural, make_natural},
    {"dither", CodecId::kDither, make_dither},
    {"signsgd", CodecId::kSignSgd, make_signsgd},
    {"efsignsgd", CodecId::kEfSignSgd, make_efsignsgd},
    {"signum", CodecId::kSignum, make_signum},
    {"onebit", CodecId::kOneBit, make_onebit},
    {"topk", CodecId::kTopK, make_topk},
    {"randomk", CodecId::kRandomK, make_randomk},
    {"dgc", CodecId::kDgc, make_dgc},
    {"threshold", CodecId::kThreshold, make_threshold},
    {"powersgd", CodecId::kPowerSgd, make_powersgd},
    {"intq", CodecId::kIntQ, make_intq},
};

}  // namespace

const std::vector<std::string>& codec_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& e : kCodecs) v.emplace_back(e.name);
    return v;
  }();
  return names;
}

const char* codec_name(CodecId id) {
  for (const auto& e : kCodecs) {
    if (e.id == id) return e.name;
  }
  return "unknown";
}

std::unique_ptr<Codec> make_codec(const std::string& text) {
  Spec spec = Spec::parse(text, "codec");
  for (const auto& e : kCodecs) {
    if (spec.name() == e.name) {
      auto codec = e.make(spec);
      spec.finish();
      return codec;
    }
  }
  throw SpecError(fmt::format("unknown codec '{}'; available codecs: {}", spec.name(),
                              fmt::join(codec_names(), ", ")));
}

const char* Codec::name() const { return codec_name(id()); }

uint32_t Codec::param_hash() const {
  uint64_t cached = param_hash_.load(std::memory_order_relaxed);
  if (cached == 0) {  // racing threads compute the same value
    cached = (uint64_t{1} << 32) | fnv1a32(spec());
    param_hash_.store(cached, std::memory_order_relaxed);
  }
  return static_cast<uint32_t>(cached);
}

FrameExpectation Codec::expectation(uint64_t elements, uint8_t round) const {
  return {static_cast<uint8_t>(id()), name(), param_hash(), round, elements};
}

void Codec::decode_into(std::span<const std::byte> frame, std::span<float> out,
                        const Context& ctx) const {
  std::fill(out.begin(), out.end(), 0.0f);
  decode_accumulate(frame, out, ctx);
}

void Codec::finalize(std::span<float> sum, uint32_t count) const {
  if (count <= 1) return;
  const float inv = 1.0f / static_cast<float>(count);
  for (float& x : sum) x *= inv;
}

ReduceOp Codec::round_op(int) const { return ReduceOp::kSum; }

size_t Codec::max_round_bytes(int round, size_t) const {
  throw Error(fmt::format("codec '{}' has a single round; round {} does not exist", name(), round));
}

size_t Codec::encode_round(int round, std::span<const float>, std::span<std::byte>,
                           const Context&) {
  throw Error(fmt::format("codec '{}' has a single round; round {} does not exist", name(), round));
}

void Codec::absorb_round(int round, std::span<const std::byte>, const Context&) {
  throw Error(fmt::format("codec '{}' has a single round; round {} does not exist", name(), round));
}

void Codec::load_state(std::span<const std::byte> state) {
  if (!state.empty()) {
    throw Error(fmt::format("codec '{}' keeps no state, but a state of {} bytes was given",
                            name(), state.size()));
  }
}

namespace {

// The element types a codec's frames of `round` hold when they are summed (the codecs' traits
// and round_op, per round). A header does not name its payload type, so without this a reducer
// given the wrong type would add, say, f16 pairs as f32 without a word. intq's last round holds
// i8 (bits=8) or u8 (bits=4) codes, and a header alone cannot tell which.
std::span<const DType> summed_payload_types(CodecId id, uint8_t round) {
  static constexpr DType kF32[] = {DType::kF32}, kF16[] = {DType::kF16}, kBF16[] = {DType::kBF16},
                         kCodes[] = {DType::kI8, DType::kU8};
  switch (id) {
    case CodecId::kNone:
    case CodecId::kRandomK:
    case CodecId::kPowerSgd:
      return kF32;
    case CodecId::kFp16: return kF16;
    case CodecId::kBf16: return kBF16;
    case CodecId::kIntQ:
      return round == 0 ? std::span<const DType>(kF32) : std::span<const DType>(kCodes);
    default:
      return {};
  }
}

void check_payload_type(const FrameHeader& header, DType type) {
  const auto id = static_cast<CodecId>(header.codec_id);
  const std::span<const DType> allowed = summed_payload_types(id, header.round);
  if (std::find(allowed.begin(), allowed.end(), type) != allowed.end()) return;
  std::vector<const char*> names;
  for (DType t : allowed) names.push_back(dtype_name(t));
  if (names.empty()) {
    throw FrameError(fmt::format("frames of codec '{}' are not summable; they cannot be reduced "
                                 "as {}", codec_name(id), dtype_name(type)));
  }
  throw FrameError(fmt::format("frames of codec '{}' (round {}) hold {} payloads; they cannot be "
                               "reduced as {}",
                               codec_name(id), header.round, fmt::join(names, " or "),
                               dtype_name(type)));
}

}  // namespace

void reduce_frame_into(std::span<std::byte> dst, std::span<const std::byte> src, DType type,
                       ReduceOp op) {
  FrameHeader a = read_frame_header(dst);
  const FrameHeader b = read_frame_header(src);
  if (a.codec_id != b.codec_id || a.param_hash != b.param_hash || a.round != b.round ||
      a.elements != b.elements || a.payload_bytes != b.payload_bytes || a.aux != b.aux) {
    throw FrameError(fmt::format(
        "frames cannot be summed: codec {}/{}, round {}/{}, elements {}/{}, payload {}/{} bytes, "
        "aux 0x{:x}/0x{:x} must all be equal",
        codec_name(static_cast<CodecId>(a.codec_id)), codec_name(static_cast<CodecId>(b.codec_id)),
        a.round, b.round, a.elements, b.elements, a.payload_bytes, b.payload_bytes, a.aux, b.aux));
  }
  check_payload_type(a, type);
  const size_t width = dtype_size(type);
  if (width == 0 || a.payload_bytes % width != 0) {
    throw FrameError(fmt::format("payload of {} bytes is not an array of {}-byte elements",
                                 a.payload_bytes, width));
  }
  // The kernels every transport uses, so this reference adds exactly as an allreduce would.
  reduce_into(dst.data() + kFrameHeaderBytes, src.data() + kFrameHeaderBytes,
              a.payload_bytes / width, type, op);
  a.summands += b.summands;
  a.flags |= b.flags;
  write_frame_header(a, dst);
}

}  // namespace gradcomp
