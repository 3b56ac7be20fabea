// dgc: the compression half of Deep Gradient Compression (Lin et al., ICLR 2018): a sampled
// magnitude threshold with an exact top-k fix-up, and DGC's warm-up schedule in one of two
// forms: smooth (warmup_steps: the sent share decays exponentially from warmup_ratio to ratio
// over warmup_steps steps) or staged as in the paper (stage_steps = N: N steps at each of
// warmup_ratio / 4^s for s = 0..3, i.e. 25%, 6.25%, 1.5625%, 0.39% by default, never below
// ratio, then ratio from step 4N on).
//
// Unlike Espresso's DGC, which kept the first k indices above the threshold (a positional
// bias), the fix-up keeps the k largest, so the frame equals exact top-k (ties to the lower
// index). Momentum correction, momentum-factor masking and local clipping are the "dgc"
// feedback's job. Payload: the shared sparse payload (docs/wire-format.md, dgc).
#include <algorithm>
#include <cmath>

#include "codec/factories.h"
#include "codec/sparse_count.h"
#include "codec/sparse_payload.h"
#include "codec/sparse_select.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

// CounterRng stream of the magnitude sample; it only affects speed, never the frame.
constexpr uint32_t kDgcSampleStream = 1;
// Fewer sampled magnitudes than this estimate the threshold too coarsely to be worth a pass.
constexpr size_t kMinSample = 1024;

struct DgcParams {
  double ratio;
  double sample;
  int64_t warmup_steps;
  double warmup_ratio;
  int64_t stage_steps;
};

// The paper's warm-up has four stages, each sending a quarter of the share of the one before.
constexpr int kStages = 4;

class DgcCodec final : public Codec {
 public:
  explicit DgcCodec(const DgcParams& p) : p_(p) {}

  CodecId id() const override { return CodecId::kDgc; }
  // stage_steps is spelt out only when set, so the canonical spec, and with it the parameter
  // hash in every frame, stays what it was before the staged schedule existed.
  std::string spec() const override {
    const std::string staged =
        p_.stage_steps > 0 ? ",stage_steps=" + std::to_string(p_.stage_steps) : "";
    return "dgc:ratio=" + format_number(p_.ratio) +
           ",warmup_steps=" + std::to_string(p_.warmup_steps) +
           ",warmup_ratio=" + format_number(p_.warmup_ratio) + staged +
           ",sample=" + format_number(p_.sample);
  }
  CodecTraits traits() const override {
    return {.summable = false,
            .payload_type = DType::kNone,
            .bits_per_element = 64 * p_.ratio,  // after warm-up: u32 index + f32 value each
            .kept_fraction = p_.ratio,
            .unbiased = false,
            .fixed_frame_size = false};  // the count follows the warm-up schedule
  }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + sparse::payload_bytes(max_count(n));
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    sparse::check_index_range(name(), n);
    const size_t k = sparse::count_for_ratio(ratio_at(ctx.step), n);
    const size_t bytes = kFrameHeaderBytes + sparse::payload_bytes(k);
    if (out.size() < bytes) throw Error("dgc: output buffer too small");
    const CounterRng rng(ctx.seed, ctx.bucket, ctx.step, ctx.rank, kDgcSampleStream);
    const auto sampled = static_cast<size_t>(std::ceil(p_.sample * static_cast<double>(n)));
    selector_.select(input, k, std::max(sampled, kMinSample), rng, ctx.threads, selection_,
                     sparse::residual_copy_target(input, residual));
    sparse::write_payload(frame_payload(out), selection_.indices, selection_.values);
    write_frame_header({.codec_id = static_cast<uint8_t>(id()), .param_hash = param_hash(),
                        .elements = n, .payload_bytes = sparse::payload_bytes(k)},
                       out);
    sparse::zero_sent(residual, selection_.indices);
    return bytes;
  }

  // The count depends on the step; a frame is accepted with any count the schedule can give.
  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override {
    FrameHeader header;
    const auto payload = check_frame(frame, expectation(sum.size()), &header);
    check_plain_header(header, name(), /*summable=*/false);
    const size_t n = sum.size();
    sparse::validate_and_scatter_add(name(), payload, sum, sparse::count_for_ratio(p_.ratio, n),
                                     max_count(n), ctx.threads);
    sparse::apply_non_finite_flag(header, sum);
  }

 private:
  // DGC warm-up: ratio(t) = warmup_ratio * (ratio / warmup_ratio)^(t / warmup_steps) for
  // t < warmup_steps, then ratio. With 0.25 -> 0.001 over 4 steps: 25%, 6.3%, 1.6%, 0.4%, 0.1%.
  double ratio_at(uint64_t step) const {
    if (p_.stage_steps > 0) return staged_ratio_at(step);
    if (p_.warmup_steps == 0 || step >= static_cast<uint64_t>(p_.warmup_steps)) return p_.ratio;
    const double progress = static_cast<double>(step) / static_cast<double>(p_.warmup_steps);
    return p_.warmup_ratio * std::pow(p_.ratio / p_.warmup_ratio, progress);
  }
  // Staged warm-up (the paper's, per epoch there): stage s = step / stage_steps sends
  // warmup_ratio / 4^s, an exact power of two times warmup_ratio, so every rank computes the
  // same share; never less than ratio, which every step from stage 4 on sends.
  double staged_ratio_at(uint64_t step) const {
    const uint64_t stage = step / static_cast<uint64_t>(p_.stage_steps);
    if (stage >= kStages) return p_.ratio;
    return std::max(p_.ratio, std::ldexp(p_.warmup_ratio, -2 * static_cast<int>(stage)));
  }
  // Both schedules start at their largest share and decay: frames up to warmup_ratio's count
  // are valid (and max_frame_bytes covers the densest stage).
  size_t max_count(size_t n) const {
    const bool warms_up = p_.warmup_steps > 0 || p_.stage_steps > 0;
    return sparse::count_for_ratio(warms_up ? p_.warmup_ratio : p_.ratio, n);
  }

  DgcParams p_;
  sparse::TopKSelector selector_;
  sparse::Selection selection_;
};

}  // namespace

std::unique_ptr<Codec> make_dgc(Spec& spec) {
  DgcParams p{};
  p.ratio = spec.get_double("ratio", 0.001, 0, 1, /*lo_open=*/true);
  p.warmup_steps = spec.get_int("warmup_steps", 0, 0, std::numeric_limits<int64_t>::max());
  p.warmup_ratio = spec.get_double("warmup_ratio", 0.25, 0, 1, /*lo_open=*/true);
  // Bounded so that step / stage_steps never reaches the end of the warm-up by overflow.
  p.stage_steps = spec.get_int("stage_steps", 0, 0, int64_t{1} << 40);
  p.sample = spec.get_double("sample", 0.01, 0, 1, /*lo_open=*/true);
  if (p.warmup_steps > 0 && p.stage_steps > 0) {
    spec.fail("parameters 'warmup_steps' and 'stage_steps' are both set; allowed: one warm-up "
              "schedule, smooth (warmup_steps) or staged (stage_steps)");
  }
  if ((p.warmup_steps > 0 || p.stage_steps > 0) && p.warmup_ratio < p.ratio) {
    spec.fail("parameter 'warmup_ratio' = " + format_number(p.warmup_ratio) +
              " is below 'ratio' = " + format_number(p.ratio) +
              "; allowed: warmup_ratio >= ratio (warm-up starts less sparse and decays)");
  }
  return std::make_unique<DgcCodec>(p);
}

}  // namespace gradcomp
