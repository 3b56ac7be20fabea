// randomk: k elements chosen by randomness all ranks share, one per stratum
// [floor(j*n/k), floor((j+1)*n/k)) (sparse_strata.h). The indices are a pure function of
// (seed, bucket, step, n, k), so only the k values travel and frames of different ranks add
// element-wise: summable as float32, O(k) to encode and decode. With unbiased=true each value
// is scaled by its stratum's size, so E[decode] = x; the default (false) sends raw values, the
// usual choice under error feedback.
//
// NaN and Inf outside the sampled entries cannot travel in the payload: the frame's non-finite
// flag carries them and the decoder then adds NaN to the whole tensor. Finding them is the one
// O(n) step: a read-only scan (fused with the residual copy when there is one).
#include <fmt/format.h>

#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <limits>

#include "codec/factories.h"
#include "codec/sparse_count.h"
#include "codec/sparse_payload.h"
#include "codec/sparse_strata.h"
#include "common/parallel.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

// CounterRng stream of the shared indices (rank = kSharedRank).
constexpr uint32_t kIndexStream = 0;

// True when x[b, e) holds a NaN or an Inf (exponent bits all ones). Copies the block into
// `copy` on the way when it is not null (the residual, when it does not alias the input).
bool scan_non_finite(const float* x, float* copy, size_t b, size_t e) {
  size_t i = b;
  bool bad = false;
#if defined(__AVX512F__)
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  __mmask16 any = 0;
  for (; i + 16 <= e; i += 16) {
    const __m512i v = _mm512_loadu_si512(x + i);
    any |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, exponent), exponent);
    if (copy != nullptr) _mm512_storeu_si512(copy + i, v);
  }
  bad = any != 0;
#endif
  for (; i < e; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    bad |= (bits & 0x7f800000U) == 0x7f800000U;
    if (copy != nullptr) copy[i] = x[i];
  }
  return bad;
}

class RandomKCodec final : public Codec {
 public:
  RandomKCodec(sparse::SparseCount count, bool unbiased) : count_(count), unbiased_(unbiased) {}

  CodecId id() const override { return CodecId::kRandomK; }
  std::string spec() const override {
    return "randomk:" + count_.spec_text() + ",unbiased=" + (unbiased_ ? "true" : "false");
  }
  CodecTraits traits() const override {
    return {.summable = true,
            .payload_type = DType::kF32,
            .shared_randomness = true,
            .bits_per_element = 32 * count_.nominal_ratio(),  // values only
            .kept_fraction = count_.kept_fraction(),
            .unbiased = unbiased_};
  }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + 4 * count_.bound(n);
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    sparse::check_index_range(name(), n);
    const size_t k = count_.for_elements(name(), n);
    const size_t bytes = kFrameHeaderBytes + 4 * k;
    if (out.size() < bytes) throw Error("randomk: output buffer too small");
    const bool non_finite = sample(input, residual, k, indices_rng(ctx), frame_payload(out).data(),
                                   ctx.threads);
    write_frame_header({.codec_id = static_cast<uint8_t>(id()),
                        .flags = non_finite ? kFlagNonFinite : uint8_t{0},
                        .param_hash = param_hash(), .elements = n, .payload_bytes = 4 * k},
                       out);
    return bytes;
  }

  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override {
    FrameHeader header;
    const auto payload = check_frame(frame, expectation(sum.size()), &header);
    check_plain_header(header, name(), /*summable=*/true);
    const size_t n = sum.size();
    sparse::check_index_range(name(), n);
    const size_t k = count_.bound(n);
    if (payload.size() != 4 * k) {
      throw FrameError(fmt::format("randomk: payload of {} bytes; for {} elements this codec "
                                   "sends {} float32 values ({} bytes)",
                                   payload.size(), n, k, 4 * k));
    }
    if (k > 0) scatter_add(payload.data(), sum, k, indices_rng(ctx), ctx.threads);
    sparse::apply_non_finite_flag(header, sum);
  }

 private:
  static CounterRng indices_rng(const Context& ctx) {
    return CounterRng(ctx.seed, ctx.bucket, ctx.step, CounterRng::kSharedRank, kIndexStream);
  }

  // Writes the k sampled values into `values` (unaligned f32) and the residual. Each chunk
  // walks its elements in sub-blocks: scan (and copy) a sub-block, then handle the strata whose
  // sampled index falls inside it. So an in-place residual is read before it is zeroed, chunks
  // never touch each other's elements, and the gathers hit lines just streamed into L1/L2
  // while the hardware prefetcher keeps the stream going. Returns whether the input held NaN
  // or Inf.
  bool sample(std::span<const float> input, std::span<float> residual, size_t k,
              const CounterRng& rng, std::byte* values, int threads) const {
    constexpr size_t kSubBlock = 4096;
    const size_t n = input.size();
    const bool separate = !residual.empty() && residual.data() != input.data();
    const sparse::Strata strata(n, k == 0 ? 1 : k);
    return reduce_chunks<int>(
        n, threads, 0,
        [&](size_t b, size_t e) -> int {
          bool bad = false;
          uint64_t j = strata.stratum_of(b);
          sparse::Strata::Cursor cursor(strata, j);
          for (size_t sb = b; sb < e; sb += kSubBlock) {
            const size_t se = std::min(e, sb + kSubBlock);
            bad |= scan_non_finite(input.data(), separate ? residual.data() : nullptr, sb, se);
            for (; j < k && cursor.lo() < se; ++j, cursor.next()) {
              const uint64_t size = cursor.size();
              const uint64_t i = sparse::stratum_pick(rng, j, cursor.lo(), size);
              if (i >= se) break;  // lands in a later sub-block (or chunk): handled there
              if (i < b) continue;  // a stratum straddling from the previous chunk: its pick is there
              const float x = input[i];
              const float sent = unbiased_ ? x * static_cast<float>(size) : x;
              std::memcpy(values + 4 * j, &sent, 4);
              if (!residual.empty()) residual[i] = unbiased_ ? x - sent : 0.0f;
            }
          }
          return bad;
        },
        [](int a, int b) { return a | b; }) != 0;
  }

  // Adds value j into sum[index of stratum j]; strata are disjoint, so chunks of them run in
  // parallel. Indices are computed (and their cache lines prefetched) a batch ahead of the
  // adds: interleaved, the long index arithmetic leaves room for only a few cache misses in
  // flight, and the adds are almost all misses (5x slower at 2^24 elements).
  static void scatter_add(const std::byte* values, std::span<float> sum, size_t k,
                          const CounterRng& rng, int threads) {
    constexpr size_t kBatch = 256;
    const sparse::Strata strata(sum.size(), k);
    for_chunks(k, threads, [&](size_t b, size_t e, size_t) {
      sparse::Strata::Cursor cursor(strata, b);
      uint32_t index[kBatch];
      for (size_t j0 = b; j0 < e; j0 += kBatch) {
        const size_t m = std::min(kBatch, e - j0);
        for (size_t t = 0; t < m; ++t, cursor.next()) {
          index[t] = static_cast<uint32_t>(sparse::stratum_pick(rng, j0 + t, cursor.lo(), cursor.size()));
          __builtin_prefetch(&sum[index[t]], 1);
        }
        for (size_t t = 0; t < m; ++t) {
          float v;
          std::memcpy(&v, values + 4 * (j0 + t), 4);
          sum[index[t]] += v;
        }
      }
    });
  }

  sparse::SparseCount count_;
  bool unbiased_;
};

}  // namespace

std::unique_ptr<Codec> make_randomk(Spec& spec) {
  const auto count = sparse::SparseCount::parse(spec, 0.01);
  return std::make_unique<RandomKCodec>(count, spec.get_bool("unbiased", false));
}

}  // namespace gradcomp
