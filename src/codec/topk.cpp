// topk: the k elements of largest magnitude with their indices (Stich et al., "Sparsified SGD
// with Memory"). Biased and not summable (supports differ across ranks): frames are gathered.
//
// Exact: sampled threshold, one vectorised filtering pass, exact fix-up on the candidates
// (sparse_select.h). Payload: the shared sparse payload (sparse_payload.h, docs/wire-format.md, topk).
#include "codec/factories.h"
#include "codec/sparse_count.h"
#include "codec/sparse_payload.h"
#include "codec/sparse_select.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

// CounterRng stream of the magnitude sample; it only affects speed, never the frame.
constexpr uint32_t kTopkSampleStream = 1;

class TopKCodec final : public Codec {
 public:
  explicit TopKCodec(sparse::SparseCount count) : count_(count) {}

  CodecId id() const override { return CodecId::kTopK; }
  std::string spec() const override { return "topk:" + count_.spec_text(); }
  CodecTraits traits() const override {
    return {.summable = false,
            .payload_type = DType::kNone,
            .bits_per_element = 64 * count_.nominal_ratio(),  // u32 index + f32 value each
            .kept_fraction = count_.kept_fraction(),
            .unbiased = false};
  }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + sparse::payload_bytes(count_.bound(n));
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    sparse::check_index_range(name(), n);
    const size_t k = count_.for_elements(name(), n);
    const size_t bytes = kFrameHeaderBytes + sparse::payload_bytes(k);
    if (out.size() < bytes) throw Error("topk: output buffer too small");
    const CounterRng rng(ctx.seed, ctx.bucket, ctx.step, ctx.rank, kTopkSampleStream);
    selector_.select(input, k, sparse::default_sample_count(n), rng, ctx.threads, selection_,
                     sparse::residual_copy_target(input, residual));
    sparse::write_payload(frame_payload(out), selection_.indices, selection_.values);
    write_frame_header({.codec_id = static_cast<uint8_t>(id()), .param_hash = param_hash(),
                        .elements = n, .payload_bytes = sparse::payload_bytes(k)},
                       out);
    sparse::zero_sent(residual, selection_.indices);
    return bytes;
  }

  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override {
    FrameHeader header;
    const auto payload = check_frame(frame, expectation(sum.size()), &header);
    check_plain_header(header, name(), /*summable=*/false);
    const size_t k = count_.bound(sum.size());
    sparse::validate_and_scatter_add(name(), payload, sum, k, k, ctx.threads);
    sparse::apply_non_finite_flag(header, sum);
  }

 private:
  sparse::SparseCount count_;
  sparse::TopKSelector selector_;
  sparse::Selection selection_;
};

}  // namespace

std::unique_ptr<Codec> make_topk(Spec& spec) {
  return std::make_unique<TopKCodec>(sparse::SparseCount::parse(spec, 0.01));
}

}  // namespace gradcomp
