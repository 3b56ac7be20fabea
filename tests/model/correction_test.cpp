// model::Correction: each term changes what it names and nothing else; its JSON round-trips
// exactly, and a bad file is refused naming the field.
#include "gradcomp/model/correction.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp::model {
namespace {

using nlohmann::json;
using testing::contains;
using testing::error_text;

const Correction kCorrection{.extra_latency_s = 2e-4,
                             .lambda = 1.15,
                             .bandwidth_scale = 0.875,
                             .cost_scale = 2.5,
                             .codec_lambdas = {{"powersgd", 2.5}, {"dither", 1.5}},
                             .step_overhead_s = 0.0123,
                             .error_before = 0.31,
                             .error_after = 0.042};

std::string correction_error(const json& j) {
  return error_text([&] { Correction::from_json(j); });
}

TEST(Correction, AddsLatencyToBothLinks) {
  Cluster c;
  c.inter = {1e9, 1e-5};
  c.intra = {1e10, 2e-6};
  const Cluster corrected = kCorrection.applied(c);
  EXPECT_DOUBLE_EQ(corrected.inter.latency_s, 1e-5 + 2e-4);
  EXPECT_DOUBLE_EQ(corrected.intra.latency_s, 2e-6 + 2e-4);
  EXPECT_EQ(corrected.workers, c.workers);
}

TEST(Correction, ScalesBothLinksBandwidth) {
  Cluster c;
  c.inter = {1e9, 1e-5};
  c.intra = {1e10, 2e-6};
  const Cluster corrected = kCorrection.applied(c);
  EXPECT_DOUBLE_EQ(corrected.inter.bytes_per_s, 0.875 * 1e9);
  EXPECT_DOUBLE_EQ(corrected.intra.bytes_per_s, 0.875 * 1e10);
}

TEST(Correction, AddsOverheadToTheForwardPassOnly) {
  Profile p;
  p.forward_s = 0.02;
  p.backward_s = 0.05;
  p.tensors.push_back({"w", 1024, 0.01});
  const Profile corrected = kCorrection.applied(p);
  EXPECT_DOUBLE_EQ(corrected.forward_s, 0.02 + 0.0123);
  EXPECT_EQ(corrected.backward_s, 0.05);
  EXPECT_EQ(corrected.tensors[0].ready_s, 0.01);
}

TEST(Correction, ScalesEveryCodecCost) {
  CodecCosts costs;
  costs.set("fp16", {{2e-6, 4e-10}, {3e-6, 5e-10}, {1e-6, 6e-10}});
  const CodecCost scaled = kCorrection.applied(costs).of("fp16");
  EXPECT_DOUBLE_EQ(scaled.encode.a, 2.5 * 2e-6);
  EXPECT_DOUBLE_EQ(scaled.encode_ef.b, 2.5 * 5e-10);
  EXPECT_DOUBLE_EQ(scaled.decode.b, 2.5 * 6e-10);
}

// A plan's slow-down is its elements' mean of their codec's own (uncompressed buckets and
// codecs without one: lambda), whatever the codec's settings.
TEST(Correction, APlansSlowDownIsItsCodecsByElements) {
  Plan plan;
  for (size_t n : {1000, 3000, 4000, 2000}) plan.tensors.push_back({"t", n});
  const char* codecs[] = {"powersgd:rank=4", "dither", "none", "fp16"};
  for (size_t b = 0; b < 4; ++b) {
    plan.buckets.push_back({.tensors = {b}, .option = {.codec = codecs[b]}});
  }
  EXPECT_DOUBLE_EQ(kCorrection.lambda_of(plan), (1000 * 2.5 + 3000 * 1.5 + 6000 * 1.15) / 10000);
  EXPECT_DOUBLE_EQ(kCorrection.simulator(plan).lambda, kCorrection.lambda_of(plan));
  Correction global = kCorrection;
  global.codec_lambdas.clear();
  EXPECT_EQ(global.lambda_of(plan), 1.15);
  EXPECT_EQ(kCorrection.lambda_of(Plan{}), 1.15);
}

TEST(Correction, TheIdentityChangesNothing) {
  Cluster c;
  c.inter = {1e9, 1e-5};
  EXPECT_EQ(Correction{}.applied(c).inter.latency_s, 1e-5);
  Profile p;
  p.forward_s = 0.02;
  EXPECT_EQ(Correction{}.applied(p).forward_s, 0.02);
  EXPECT_EQ(Correction{}.simulator(Plan{}).lambda, 1);
}

TEST(Correction, JsonRoundTripsExactly) {
  const Correction back = Correction::from_json(json::parse(kCorrection.to_json().dump()));
  EXPECT_EQ(back.extra_latency_s, kCorrection.extra_latency_s);
  EXPECT_EQ(back.lambda, kCorrection.lambda);
  EXPECT_EQ(back.bandwidth_scale, kCorrection.bandwidth_scale);
  EXPECT_EQ(back.cost_scale, kCorrection.cost_scale);
  EXPECT_EQ(back.codec_lambdas, kCorrection.codec_lambdas);
  EXPECT_EQ(back.step_overhead_s, kCorrection.step_overhead_s);
  EXPECT_EQ(back.error_before, kCorrection.error_before);
  EXPECT_EQ(back.error_after, kCorrection.error_after);
  EXPECT_EQ(back.to_json(), kCorrection.to_json());
}

// Files written before the cost scale was fitted hold three terms; before the link's rate and
// the codecs' own scales were fitted, four.
TEST(Correction, JsonWithoutTheLaterTermsMeansNone) {
  json j = kCorrection.to_json();
  for (const char* later : {"cost_scale", "bandwidth_scale", "codec_lambdas"}) j.erase(later);
  const Correction read = Correction::from_json(j);
  EXPECT_EQ(read.cost_scale, 1);
  EXPECT_EQ(read.bandwidth_scale, 1);
  EXPECT_TRUE(read.codec_lambdas.empty());
}

TEST(Correction, BadJsonNamesTheField) {
  EXPECT_TRUE(contains(correction_error(json::array()), "must be an object"));
  json unknown = kCorrection.to_json();
  unknown["latency"] = 1;
  EXPECT_TRUE(
      contains(correction_error(unknown), "'latency' is unknown; expected extra_latency_s"));
  json missing = kCorrection.to_json();
  missing.erase("lambda");
  EXPECT_TRUE(contains(correction_error(missing), "'lambda' is missing"));
  json text = kCorrection.to_json();
  text["step_overhead_s"] = "5ms";
  EXPECT_TRUE(contains(correction_error(text), "'step_overhead_s' must be a number"));
  json small = kCorrection.to_json();
  small["lambda"] = 0.5;
  EXPECT_TRUE(contains(correction_error(small), "'lambda' = 0.5 must be from 1 to 10"));
  json negative = kCorrection.to_json();
  negative["extra_latency_s"] = -1e-3;
  EXPECT_TRUE(contains(correction_error(negative), "'extra_latency_s' = -0.001 must be from 0"));
  json zero_scale = kCorrection.to_json();
  zero_scale["cost_scale"] = 0;
  EXPECT_TRUE(contains(correction_error(zero_scale), "'cost_scale' = 0 must be from"));
  json fast_link = kCorrection.to_json();
  fast_link["bandwidth_scale"] = 5000;
  EXPECT_TRUE(
      contains(correction_error(fast_link), "'bandwidth_scale' = 5000 must be from 0.001 to 1000"));
  json not_codec = kCorrection.to_json();
  not_codec["codec_lambdas"]["zip"] = 2;
  EXPECT_TRUE(
      contains(correction_error(not_codec), "'codec_lambdas.zip' is not a codec; expected"));
  json fast = kCorrection.to_json();
  fast["codec_lambdas"]["dither"] = 0.5;
  EXPECT_TRUE(
      contains(correction_error(fast), "'codec_lambdas.dither' = 0.5 must be from 1 to 10"));
  json as_list = kCorrection.to_json();
  as_list["codec_lambdas"] = json::array({2});
  EXPECT_TRUE(contains(correction_error(as_list), "'codec_lambdas' must be an object"));
}

}  // namespace
}  // namespace gradcomp::model
