// The recommended table's look-ups (what it says is checked against the accuracy documents by
// tests/python/test_recommended.py).
#include "gradcomp/recommended.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/plan.h"

namespace gradcomp {
namespace {

TEST(Recommended, EveryCodecButNoneHasOneEntryInTableOrder) {
  std::vector<std::string> codecs;
  for (const auto& r : recommendations()) codecs.push_back(r.codec);
  std::vector<std::string> expected = codec_names();
  expected.erase(std::find(expected.begin(), expected.end(), "none"));
  EXPECT_EQ(codecs, expected);
  for (const auto& r : recommendations()) {
    // The option measured parses and names its own codec.
    const auto* found = recommendation_for(r.option);
    ASSERT_NE(found, nullptr) << r.option;
    EXPECT_EQ(found->codec, r.codec);
  }
}

TEST(Recommended, AnOptionFindsItsCodecWhateverItsSettings) {
  const auto* topk = recommendation_for("topk:ratio=0.05|ef|allgather");
  ASSERT_NE(topk, nullptr);
  EXPECT_EQ(topk->codec, "topk");
  EXPECT_EQ(recommendation_for("none"), nullptr);
  EXPECT_THROW(recommendation_for("topk|ef|nosuchroute|x|y"), SpecError);
}

TEST(Recommended, DefaultCandidatesHeldAndChangeNoOptimizer) {
  for (const auto family : {OptimizerFamily::kSgd, OptimizerFamily::kAdam}) {
    const auto options = recommended_options({family});
    ASSERT_FALSE(options.empty());
    EXPECT_EQ(options.front(), "none");
    for (size_t i = 1; i < options.size(); ++i) {
      const auto* r = recommendation_for(options[i]);
      ASSERT_NE(r, nullptr) << options[i];
      EXPECT_TRUE(held_under(*r, family)) << options[i];
      EXPECT_FALSE(r->changes_optimizer) << options[i];
    }
    // Every entry that held and changes nothing is offered.
    size_t held = 0;
    for (const auto& r : recommendations()) {
      held += held_under(r, family) && !r.changes_optimizer;
    }
    EXPECT_EQ(options.size(), held + 1);
  }
}

TEST(Recommended, BothFamiliesAreTheOptionsThatHeldUnderEach) {
  const auto both = recommended_options({OptimizerFamily::kSgd, OptimizerFamily::kAdam});
  const auto sgd = recommended_options({OptimizerFamily::kSgd});
  const auto adam = recommended_options({OptimizerFamily::kAdam});
  std::vector<std::string> expected;
  for (const auto& option : sgd) {
    if (std::find(adam.begin(), adam.end(), option) != adam.end()) expected.push_back(option);
  }
  EXPECT_EQ(both, expected);
  EXPECT_LT(both.size(), sgd.size());  // some option held under SGD only (topk today)
}

TEST(Recommended, WarningSaysWhyAnOptionIsNotBacked) {
  const auto sgd = OptimizerFamily::kSgd;
  const auto adam = OptimizerFamily::kAdam;
  EXPECT_EQ(recommendation_warning("none", adam, "AdamW"), "");
  EXPECT_EQ(recommendation_warning("topk:ratio=0.05|ef", sgd, "SGD"), "");
  const auto lost = recommendation_warning("topk:ratio=0.05|ef", adam, "AdamW");
  EXPECT_NE(lost.find("'topk:ratio=0.05|ef' is not recommended with AdamW: topk "
                      "(topk:ratio=0.01|ef) lost accuracy under Adam-family optimizers"),
            std::string::npos)
      << lost;
  EXPECT_NE(lost.find("these held: none, fp16"), std::string::npos) << lost;
  // efsignsgd held under SGD only after its warm-up.
  const auto* efsign = recommendation_for("efsignsgd");
  ASSERT_NE(efsign, nullptr);
  ASSERT_TRUE(efsign->sgd);
  ASSERT_GT(parse_option(efsign->option).start_step, 0u);
  const auto cold = recommendation_warning("efsignsgd|ef", sgd, "SGD");
  EXPECT_NE(cold.find("only after an uncompressed warm-up"), std::string::npos) << cold;
  EXPECT_NE(cold.find("'efsignsgd|ef|allgather|start=1000'"), std::string::npos) << cold;
  EXPECT_EQ(recommendation_warning("efsignsgd|ef||start=10", sgd, "SGD"), "");
  // dgc held with plain error feedback; its own momentum correction (|dgc) lost, and topk
  // without feedback was never measured.
  EXPECT_EQ(recommendation_warning("dgc:ratio=0.01|ef:lr_correction=true", sgd, "SGD"), "");
  const auto other = recommendation_warning("dgc:ratio=0.001|dgc", sgd, "SGD");
  EXPECT_NE(other.find("held under SGD with feedback 'ef'"), std::string::npos) << other;
  EXPECT_NE(other.find("feedback 'dgc' has no such evidence"), std::string::npos) << other;
  EXPECT_NE(recommendation_warning("topk:ratio=0.01", sgd, "SGD").find("feedback 'none'"),
            std::string::npos);
  // A plan's bucket option is written out in full.
  Option bucket = parse_option("topk:ratio=0.01|ef||start=7");
  EXPECT_NE(recommendation_warning(bucket, adam, "Adam").find("'topk:ratio=0.01|ef|allgather|start=7'"),
            std::string::npos);
  EXPECT_THROW(recommendation_warning("nosuch", sgd, "SGD"), SpecError);
}

}  // namespace
}  // namespace gradcomp
