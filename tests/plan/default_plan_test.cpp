#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gradcomp/error.h"
#include "gradcomp/plan.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::error_text;

// A ResNet-like parameter list in backward order: the classifier first, then stages of
// convolutions whose weights are followed by their (small) batch-norm scale and bias.
std::vector<TensorInfo> resnet_like() {
  std::vector<TensorInfo> t = {{"fc.weight", 2048 * 1000}, {"fc.bias", 1000}};
  const size_t widths[] = {2048, 1024, 512, 256, 64};
  int layer = 0;
  for (const size_t c : widths) {
    for (int i = 0; i < 3; ++i, ++layer) {
      const std::string p = "layer" + std::to_string(layer);
      t.push_back({p + ".conv.weight", c * c / 4 * 9});
      t.push_back({p + ".bn.weight", c});
      t.push_back({p + ".bn.bias", c});
    }
  }
  t.push_back({"conv1.weight", 64 * 3 * 7 * 7});  // 9408: small, though a convolution
  return t;
}

DefaultPlanSettings topk_settings(size_t bucket_bytes) {
  DefaultPlanSettings s;
  s.bucket_bytes = bucket_bytes;
  s.compressed = Option{.codec = "topk:ratio=0.01", .feedback = "ef", .route = "allgather"};
  return s;
}

const Option kUncompressed{.codec = "none", .feedback = "none", .route = "allreduce"};

// The properties every default plan has, for any settings.
void expect_default_plan_rules(const std::vector<TensorInfo>& tensors, const Plan& plan,
                               const DefaultPlanSettings& s) {
  ASSERT_EQ(plan.tensors.size(), tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) EXPECT_EQ(plan.tensors[t].name, tensors[t].name);
  plan.validate();  // each tensor in exactly one bucket

  std::vector<int> seen(tensors.size(), 0);
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const Bucket& bucket = plan.buckets[b];
    ASSERT_FALSE(bucket.tensors.empty());
    for (const size_t t : bucket.tensors) ++seen[t];
    // Within the limit, unless the bucket is one tensor that alone exceeds it.
    if (bucket.tensors.size() > 1) {
      EXPECT_LE(plan.bucket_elements(b) * 4, s.bucket_bytes) << "bucket " << b;
    }
    // Fusion follows backward order, and every tensor of a bucket is of the bucket's kind.
    for (size_t i = 1; i < bucket.tensors.size(); ++i) {
      EXPECT_LT(bucket.tensors[i - 1], bucket.tensors[i]);
    }
    for (const size_t t : bucket.tensors) {
      const bool large = plan.tensors[t].elements >= s.min_compress_elements;
      EXPECT_EQ(bucket.option, large ? s.compressed : kUncompressed) << plan.tensors[t].name;
    }
    // Launch order: by the position of the last tensor, the time the bucket completes.
    if (b > 0) {
      EXPECT_LT(plan.buckets[b - 1].tensors.back(), bucket.tensors.back());
    }
  }
  for (size_t t = 0; t < seen.size(); ++t) EXPECT_EQ(seen[t], 1) << tensors[t].name;
}

TEST(DefaultPlan, ResNetLikeObeysTheRules) {
  const auto tensors = resnet_like();
  for (const size_t bytes : {size_t{25} << 20, size_t{4} << 20, size_t{1} << 20, size_t{4096}}) {
    SCOPED_TRACE(bytes);
    const auto s = topk_settings(bytes);
    const Plan plan = make_default_plan(tensors, s);
    expect_default_plan_rules(tensors, plan, s);
  }
}

TEST(DefaultPlan, SmallTensorsStayUncompressed) {
  const auto tensors = resnet_like();
  const Plan plan = make_default_plan(tensors, topk_settings(25u << 20));
  size_t compressed = 0;
  for (const Bucket& b : plan.buckets) {
    for (const size_t t : b.tensors) {
      const std::string& name = tensors[t].name;
      // Biases and norms always; the stem and the 64-channel convolutions (9216 elements) are
      // under the default 16384 too.
      const bool small = name.find(".bn.") != std::string::npos || name == "fc.bias" ||
                         name == "conv1.weight" || tensors[t].elements == 64 * 64 / 4 * 9;
      EXPECT_EQ(b.option.codec, small ? "none" : "topk:ratio=0.01") << name;
      compressed += small ? 0 : 1;
    }
  }
  EXPECT_EQ(compressed, 1u + 12u);  // fc.weight and the convolutions of the wider stages
}

// settings.start_step reaches the compressed buckets only; the small ones have nothing to warm.
TEST(DefaultPlan, StartStepGoesIntoCompressedBuckets) {
  auto settings = topk_settings(25u << 20);
  EXPECT_EQ(settings.start_step, 0u);
  settings.start_step = 300;
  const Plan plan = make_default_plan(resnet_like(), settings);
  for (const Bucket& b : plan.buckets) {
    EXPECT_EQ(b.option.start_step, b.option.codec == "none" ? 0u : 300u) << b.option.codec;
  }
  EXPECT_EQ(make_default_plan(resnet_like(), topk_settings(25u << 20)).buckets[0].option.start_step,
            0u);
}

TEST(DefaultPlan, ExactBucketsOfAKnownList) {
  // Limit 100 elements (400 bytes), threshold 50 elements.
  DefaultPlanSettings s = topk_settings(400);
  s.min_compress_elements = 50;
  const std::vector<TensorInfo> tensors = {
      {"a", 60}, {"a.b", 30}, {"b", 60}, {"b.b", 40}, {"c", 250}, {"c.b", 45}, {"d", 70},
  };
  const Plan plan = make_default_plan(tensors, s);
  // Large: a + b = 120 > 100, so {a}, {b}, then {c} alone (over the limit by itself), {d}.
  // Small: a.b + b.b = 70, and c.b would make 115, so {a.b, b.b}, {c.b}.
  // Ordered by the last tensor: a(0), b(2), b.b(3), c(4), c.b(5), d(6).
  const std::vector<std::vector<size_t>> expected = {{0}, {2}, {1, 3}, {4}, {5}, {6}};
  ASSERT_EQ(plan.buckets.size(), expected.size());
  for (size_t b = 0; b < expected.size(); ++b) EXPECT_EQ(plan.buckets[b].tensors, expected[b]);
  EXPECT_EQ(plan.buckets[2].option, kUncompressed);
  EXPECT_EQ(plan.buckets[3].option, s.compressed);
  expect_default_plan_rules(tensors, plan, s);
}

TEST(DefaultPlan, FillsBucketsUpToTheLimitExactly) {
  DefaultPlanSettings s = topk_settings(400);  // 100 elements
  s.min_compress_elements = 1;
  const Plan plan = make_default_plan({{"a", 50}, {"b", 50}, {"c", 1}}, s);
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].tensors, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(plan.buckets[1].tensors, (std::vector<size_t>{2}));
}

// DDP's first bucket, in uncompressed plans: closed once it holds first_bucket_bytes (the tensor
// that reaches the cap included), so the gradients ready first leave early; later buckets fill
// to bucket_bytes. Compressed plans keep whole buckets.
TEST(DefaultPlan, FirstBucketClosesOnceItHoldsItsCap) {
  DefaultPlanSettings s;       // uncompressed
  s.bucket_bytes = 4000;       // 1000 elements
  s.first_bucket_bytes = 400;  // 100 elements
  const std::vector<TensorInfo> tensors = {{"a", 60}, {"b", 60}, {"c", 60}, {"d", 60}};
  const auto buckets_of = [&](const DefaultPlanSettings& settings) {
    std::vector<std::vector<size_t>> out;
    for (const Bucket& b : make_default_plan(tensors, settings).buckets) out.push_back(b.tensors);
    return out;
  };
  EXPECT_EQ(buckets_of(s), (std::vector<std::vector<size_t>>{{0, 1}, {2, 3}}));
  expect_default_plan_rules(tensors, make_default_plan(tensors, s), s);
  s.first_bucket_bytes = 0;  // no first bucket of its own
  EXPECT_EQ(buckets_of(s), (std::vector<std::vector<size_t>>{{0, 1, 2, 3}}));
  s.first_bucket_bytes = 4000;  // not below the bucket limit: no effect
  EXPECT_EQ(buckets_of(s), (std::vector<std::vector<size_t>>{{0, 1, 2, 3}}));
  DefaultPlanSettings topk = topk_settings(4000);
  topk.min_compress_elements = 50;
  topk.first_bucket_bytes = 400;
  EXPECT_EQ(buckets_of(topk), (std::vector<std::vector<size_t>>{{0, 1, 2, 3}}));
}

// Uncompressed, large and small tensors share one sequence of buckets, as DDP's: the main
// job's CNN in backward order gives DDP's two buckets, the classifier's leaving first.
TEST(DefaultPlan, UncompressedTensorsFuseAsInDDP) {
  const std::vector<TensorInfo> cnn = {
      {"fc2.bias", 10},   {"fc2.weight", 1280},    {"fc1.bias", 128},  {"fc1.weight", 401408},
      {"conv2.bias", 64}, {"conv2.weight", 18432}, {"conv1.bias", 32}, {"conv1.weight", 288}};
  const Plan plan = make_default_plan(cnn);
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].tensors, (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(plan.buckets[1].tensors, (std::vector<size_t>{4, 5, 6, 7}));
  for (const Bucket& b : plan.buckets) EXPECT_EQ(b.option, kUncompressed);
  // Compressed, the small tensors still go apart, after the large ones, in whole buckets.
  const Plan fp16 = make_default_plan(cnn, DefaultPlanSettings{.compressed = {.codec = "fp16"}});
  ASSERT_EQ(fp16.buckets.size(), 2u);
  EXPECT_EQ(fp16.buckets[0].tensors, (std::vector<size_t>{3, 5}));
  EXPECT_EQ(fp16.buckets[1].tensors, (std::vector<size_t>{0, 1, 2, 4, 6, 7}));
}

TEST(DefaultPlan, DefaultsAndEdgeCases) {
  // Default settings: DDP's 25 MB, the default (uncompressed) option for large tensors too.
  const Plan plan = make_default_plan({{"w", 1 << 20}, {"b", 10}});
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].option, Option{});
  EXPECT_EQ(make_default_plan({}).buckets.size(), 0u);
  // A zero-element tensor still needs a bucket (the engine waits for every tensor).
  const Plan empty = make_default_plan({{"w", 0}});
  ASSERT_EQ(empty.buckets.size(), 1u);
  EXPECT_EQ(empty.buckets[0].tensors, (std::vector<size_t>{0}));
}

TEST(DefaultPlan, SettingsAndTensorErrors) {
  EXPECT_EQ(error_text([] { make_default_plan({{"w", 1}}, topk_settings(0)); }),
            "default plan: bucket_bytes must be > 0 (the size limit of a fusion bucket in bytes; "
            "DDP uses 25 MB)");
  DefaultPlanSettings bad = topk_settings(1024);
  bad.compressed.route = "allreduce";  // topk is not summable
  const std::string fit = error_text([&] { make_default_plan({{"w", 1}}, bad); });
  EXPECT_EQ(fit.find("default plan: settings.compressed: "), 0u) << fit;
  bad.compressed.codec = "zip";
  EXPECT_THROW(make_default_plan({{"w", 1}}, bad), SpecError);
  EXPECT_EQ(error_text([] { make_default_plan({{"w", 1}, {"w", 2}}); }),
            "tensors[1]: the name 'w' is already used by tensors[0]; tensor names must be unique");
}

// The DDP hook's plan: DDP's buckets as given, each compressed by the default plan's rule (its
// elements against min_compress_elements), the option's warm-up on compressed buckets only.
TEST(BucketedPlan, KeepsTheGivenBucketsAndCompressesTheLargeOnes) {
  DefaultPlanSettings s;
  s.min_compress_elements = 1000;
  s.compressed = parse_option("powersgd:rank=2|ef||start=5");
  const Plan plan = make_bucketed_plan(
      {{{"b0.0", 600, {20, 30}}, {"b0.1", 600, {600}}}, {{"b1.0", 999, {999}}}, {{"b2", 10000}}},
      s);
  ASSERT_EQ(plan.tensors.size(), 4u);
  EXPECT_EQ(plan.tensors[0].shape, (std::vector<size_t>{20, 30}));
  ASSERT_EQ(plan.buckets.size(), 3u);
  EXPECT_EQ(plan.buckets[0].tensors, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(plan.buckets[0].option.codec, "powersgd:rank=2");  // 1200 elements in all
  EXPECT_EQ(plan.buckets[0].option.start_step, 5u);
  EXPECT_EQ(plan.buckets[1].option, Option{});  // 999 < 1000: uncompressed, no warm-up
  EXPECT_EQ(plan.buckets[2].tensors, (std::vector<size_t>{3}));
  EXPECT_EQ(plan.buckets[2].option.feedback, "ef");
  EXPECT_NE(error_text([&] { make_bucketed_plan({{{"a", 1}}, {}}, s); }).find("bucket 1 holds no tensor"),
            std::string::npos);
  s.compressed.route = "allreduce";
  s.compressed.codec = "topk";  // not summable
  EXPECT_EQ(error_text([&] { make_bucketed_plan({{{"a", 1}}}, s); }).find("default plan: settings.compressed: "),
            0u);
}

}  // namespace
}  // namespace gradcomp
