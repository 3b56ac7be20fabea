// threshold: every element with |x| >= tau, plus every NaN and Inf (Strom 2015; GRACE's
// "threshold"). The count depends on the data, so the frame length varies; biased, not
// summable. Payload: the shared sparse payload (docs/wire-format.md, threshold).
#include <cfloat>
#include <cmath>
#include <limits>

#include "codec/factories.h"
#include "codec/sparse_payload.h"
#include "codec/sparse_select.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

// The smallest magnitude key that satisfies |x| >= tau: the key of the least float >= tau.
// Inf and NaN keys are above every finite one, so they always pass.
uint32_t key_for_tau(double tau) {
  if (tau > static_cast<double>(FLT_MAX)) return sparse::kNonFiniteKey;
  float f = static_cast<float>(tau);
  if (static_cast<double>(f) < tau) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return sparse::magnitude_key(f);  // >= 1, since tau > 0
}

class ThresholdCodec final : public Codec {
 public:
  explicit ThresholdCodec(double tau) : tau_(tau), key_(key_for_tau(tau)) {}

  CodecId id() const override { return CodecId::kThreshold; }
  std::string spec() const override { return "threshold:tau=" + format_number(tau_); }
  CodecTraits traits() const override {
    // The count is data-dependent; 64 bits (index + value) per element is the bound.
    return {.summable = false, .payload_type = DType::kNone, .bits_per_element = 64,
            .unbiased = false, .fixed_frame_size = false};
  }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + sparse::payload_bytes(n);
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    sparse::check_index_range(name(), n);
    if (out.size() < max_frame_bytes(n)) throw Error("threshold: output buffer too small");
    sparse::select_at_least(input, key_, ctx.threads, parts_, selection_,
                            sparse::residual_copy_target(input, residual));
    const size_t count = selection_.indices.size();
    sparse::write_payload(frame_payload(out), selection_.indices, selection_.values);
    write_frame_header({.codec_id = static_cast<uint8_t>(id()), .param_hash = param_hash(),
                        .elements = n, .payload_bytes = sparse::payload_bytes(count)},
                       out);
    sparse::zero_sent(residual, selection_.indices);
    return kFrameHeaderBytes + sparse::payload_bytes(count);
  }

  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override {
    FrameHeader header;
    const auto payload = check_frame(frame, expectation(sum.size()), &header);
    check_plain_header(header, name(), /*summable=*/false);
    sparse::validate_and_scatter_add(name(), payload, sum, 0, sum.size(), ctx.threads);
    sparse::apply_non_finite_flag(header, sum);
  }

 private:
  double tau_;
  uint32_t key_;
  std::vector<sparse::ChunkCandidates> parts_;
  sparse::Selection selection_;
};

}  // namespace

std::unique_ptr<Codec> make_threshold(Spec& spec) {
  const auto tau = spec.find_double("tau", 0, std::numeric_limits<double>::infinity(),
                                    /*lo_open=*/true, /*hi_open=*/true);
  if (!tau) {
    spec.fail("parameter 'tau' is required; allowed: a finite number > 0 (elements with "
              "|x| >= tau are sent), e.g. 'threshold:tau=0.01'");
  }
  return std::make_unique<ThresholdCodec>(*tau);
}

}  // namespace gradcomp
