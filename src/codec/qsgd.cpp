// qsgd: QSGD (Alistarh et al., NeurIPS 2017), stochastic quantization to `levels` levels of
// the L2 norm, per tensor or per block of `block` elements. Unbiased; not summable (each rank
// has its own norms).
//
//   level_i = floor(|x_i| / norm * s + u_i),  u_i uniform in [0, 1)
//   decoded_i = sign(x_i) * level_i * norm / s
//
// Payload (docs/wire-format.md (qsgd)): ceil(n / L) float32 norms (L = block, or n when block = 0), then
// n codes of width = ceil(log2(s + 1)) + 1 bits, code = level << 1 | sign, packed LSB-first.
#include <fmt/format.h>

#include "codec/factories.h"
#include "codec/stochastic_levels.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

using namespace levels;

class QsgdCodec final : public Codec {
 public:
  QsgdCodec(uint32_t levels, uint64_t block)
      : levels_(levels), block_(block), width_(level_bits(levels) + 1) {}

  CodecId id() const override { return CodecId::kQsgd; }
  std::string spec() const override {
    return fmt::format("qsgd:levels={},block={}", levels_, block_);
  }
  CodecTraits traits() const override {
    return {.bits_per_element = width_ + (block_ == 0 ? 0.0 : 32.0 / static_cast<double>(block_))};
  }
  size_t max_frame_bytes(size_t n) const override { return kFrameHeaderBytes + payload_bytes(n); }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override;
  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override;

 private:
  // Elements per norm; the whole tensor when block = 0.
  size_t block_length(size_t n) const {
    return block_ == 0 ? std::max<size_t>(n, 1) : static_cast<size_t>(block_);
  }
  size_t block_count(size_t n) const { return (n + block_length(n) - 1) / block_length(n); }
  size_t payload_bytes(size_t n) const { return 4 * block_count(n) + packed_bytes(n, width_); }

  // Calls fn(first, count, block) for the pieces of [first, first + count) cut at block edges.
  template <typename Fn>
  static void for_block_pieces(size_t first, size_t count, size_t length, Fn&& fn) {
    const size_t end = first + count;
    for (size_t i = first; i < end;) {
      const size_t block = i / length;
      const size_t piece_end = std::min(end, (block + 1) * length);
      fn(i, piece_end - i, block);
      i = piece_end;
    }
  }

  // The norm of every block of x into `result` (resized to the block count).
  void norms(std::span<const float> x, int threads, std::vector<float>& result) const;

  uint32_t levels_;
  uint64_t block_;
  unsigned width_;  // bits per code
  // encode's per-block norms and scales, kept from step to step (no allocation per step).
  std::vector<float> norms_;
  std::vector<LinearScale> scales_;
};

void QsgdCodec::norms(std::span<const float> x, int threads, std::vector<float>& result) const {
  const size_t n = x.size(), length = block_length(n), count = block_count(n);
  result.resize(count);
  if (length >= kChunk) {  // long blocks: each summed in parallel pieces
    for (size_t b = 0; b < count; ++b) {
      result[b] = l2_norm(x.data(), b * length, std::min(n, (b + 1) * length), threads);
    }
  } else {  // short blocks: tasks of about kChunk elements, each block summed alone
    const size_t per_task = kChunk / length;
    const auto tasks = static_cast<std::ptrdiff_t>((count + per_task - 1) / per_task);
    const int t = static_cast<int>(std::min<std::ptrdiff_t>(std::max(threads, 1), tasks));
#pragma omp parallel for schedule(static) num_threads(t) if (t > 1)
    for (std::ptrdiff_t task = 0; task < tasks; ++task) {
      const size_t first = static_cast<size_t>(task) * per_task;
      for (size_t b = first; b < std::min(count, first + per_task); ++b) {
        const size_t begin = b * length, len = std::min(n - begin, length);
        result[b] = static_cast<float>(std::sqrt(sum_squares(x.data() + begin, len)));
      }
    }
  }
}

size_t QsgdCodec::encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                         std::span<float> residual) {
  const size_t n = input.size();
  if (out.size() < max_frame_bytes(n)) throw Error("qsgd: output buffer too small");
  if (!residual.empty() && residual.size() != n) {
    throw Error(fmt::format("qsgd: residual has {} elements, input {}", residual.size(), n));
  }
  norms(input, ctx.threads, norms_);
  const std::vector<float>& block_norms = norms_;
  std::byte* payload = out.data() + kFrameHeaderBytes;
  bool finite = true;
  for (size_t b = 0; b < block_norms.size(); ++b) {
    store_f32(payload + 4 * b, block_norms[b]);
    finite &= std::isfinite(block_norms[b]);
  }

  std::vector<LinearScale>& scales = scales_;
  scales.resize(block_norms.size());
  for (size_t b = 0; b < scales.size(); ++b) scales[b] = LinearScale::make(block_norms[b], levels_);
  const size_t length = block_length(n);
  const ElementRng rng(ctx, n);
  const float* x = input.data();
  float* res = residual.empty() ? nullptr : residual.data();
  // Quantizes the group [first, first + count), cut where blocks end.
  auto quantize_group = [&](size_t first, size_t count, uint32_t* codes) {
    for_block_pieces(first, count, length, [&](size_t i, size_t len, size_t block) {
      const auto index = static_cast<uint32_t>(i);
      uint32_t* piece_codes = codes + (i - first);
      if (res) {
        quantize_linear<true>(x + i, len, index, rng.at(i), scales[block], piece_codes, res + i);
      } else {
        quantize_linear<false>(x + i, len, index, rng.at(i), scales[block], piece_codes, nullptr);
      }
    });
  };
  with_width(width_, [&](auto bits) {
    pack_codes<decltype(bits)::value>(n, ctx.threads, payload + 4 * block_norms.size(),
                                      quantize_group);
  });

  const FrameHeader h{.codec_id = static_cast<uint8_t>(id()),
                      .flags = finite ? uint8_t{0} : kFlagNonFinite,
                      .param_hash = param_hash(),
                      .elements = n,
                      .payload_bytes = payload_bytes(n)};
  write_frame_header(h, out);
  return kFrameHeaderBytes + h.payload_bytes;
}

void QsgdCodec::decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                                  const Context& ctx) const {
  FrameHeader header;
  const auto payload = check_frame(frame, expectation(sum.size()), &header);
  check_plain_header(header, "qsgd", /*summable=*/false);
  const size_t n = sum.size();
  if (payload.size() != payload_bytes(n)) {
    throw FrameError(fmt::format(
        "qsgd: payload is {} bytes; expected {} for {} elements ({} float32 norms, then "
        "{}-bit codes)",
        payload.size(), payload_bytes(n), n, block_count(n), width_));
  }
  const size_t blocks = block_count(n), length = block_length(n);
  for (size_t b = 0; b < blocks; ++b) {
    const float norm = load_f32(payload.data() + 4 * b);
    if (norm < 0.0f) {
      throw FrameError(fmt::format("qsgd: norm of block {} is {}; norms are >= 0", b, norm));
    }
  }
  // A block's step is read from its norm where it is used: the decoder allocates nothing.
  const std::byte* norms_in = payload.data();
  const auto step_of = [&](size_t block) {
    return load_f32(norms_in + 4 * block) / static_cast<float>(levels_);
  };
  const std::byte* codes_in = payload.data() + 4 * blocks;
  check_padding(codes_in, n, width_, "qsgd");
  float* out = sum.data();
  // Adds the group [first, first + count), cut where blocks end.
  auto add_group = [&](size_t first, size_t count, const uint32_t* codes) {
    for_block_pieces(first, count, length, [&](size_t i, size_t len, size_t block) {
      add_linear(codes + (i - first), len, step_of(block), out + i);
    });
  };
  with_width(width_, [&](auto bits) {
    constexpr unsigned B = decltype(bits)::value;
    check_levels<B>(codes_in, n, ctx.threads, levels_, "qsgd");
    unpack_codes<B>(codes_in, n, ctx.threads, add_group);
  });
}

}  // namespace

std::unique_ptr<Codec> make_qsgd(Spec& spec) {
  // 15 levels fill a 4-bit level field exactly (5 bits per element with the sign).
  const auto levels = spec.get_int("levels", 15, 1, int64_t{1} << 15);
  // 0: one norm for the whole tensor. The QSGD paper's experiments use blocks of 512.
  const auto block = spec.get_int("block", 0, 0, int64_t{1} << 40);
  return std::make_unique<QsgdCodec>(static_cast<uint32_t>(levels), static_cast<uint64_t>(block));
}

}  // namespace gradcomp
