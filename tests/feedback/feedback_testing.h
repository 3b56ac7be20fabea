// Helpers shared by the feedback tests: a feedback step around a real codec, and a simple
// stand-in codec step for formula checks.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/feedback.h"
#include "support/codec_testing.h"

namespace gradcomp::testing {

// Encodes with every round of the codec (a world of one), the residual in the last round.
inline std::vector<std::byte> encode_all_rounds(Codec& codec, std::span<const float> input,
                                                const Context& ctx, std::span<float> residual) {
  for (int r = 0; r + 1 < codec.traits().rounds; ++r) {
    std::vector<std::byte> f(codec.max_round_bytes(r, input.size()));
    f.resize(codec.encode_round(r, input, f, ctx));
    codec.absorb_round(r, f, ctx);
  }
  return encode(codec, input, ctx, residual);
}

// One feedback step around `codec`, checking the error-feedback invariant: what was sent
// (the decoded frame) plus what is kept (the residual) equals the compensated vector to 1 ulp.
inline void step_and_check_invariant(Feedback& fb, Codec& codec, std::span<const float> grad,
                                     const StepInfo& info, const Context& ctx) {
  const auto sent_span = fb.compensate(grad, info);
  const std::vector<float> p(sent_span.begin(), sent_span.end());
  const auto residual = fb.residual();
  ASSERT_EQ(residual.size(), p.size());
  const auto frame = encode_all_rounds(codec, sent_span, ctx, residual);
  const auto decoded = decode(codec, frame, p.size(), ctx);
  for (size_t i = 0; i < p.size(); ++i) {
    const float tolerance = std::numeric_limits<float>::epsilon() *
                            std::max({std::fabs(p[i]), std::fabs(decoded[i]), 1e-30f});
    ASSERT_NEAR(decoded[i] + residual[i], p[i], tolerance) << "element " << i;
  }
  fb.commit();
}

// A stand-in for a sparsifying codec: sends the elements with |p| > threshold, so the
// residual is p where nothing was sent and 0 where it was.
inline void sparsify_into_residual(std::span<const float> p, std::span<float> residual,
                                   float threshold) {
  for (size_t i = 0; i < p.size(); ++i) residual[i] = std::fabs(p[i]) > threshold ? 0.0f : p[i];
}

// The SpecError message of make_feedback(spec), or "" when it succeeds.
inline std::string feedback_spec_error(const std::string& spec) {
  try {
    make_feedback(spec);
  } catch (const SpecError& e) {
    return e.what();
  }
  return "";
}

}  // namespace gradcomp::testing
