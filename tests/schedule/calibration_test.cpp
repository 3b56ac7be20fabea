// The link fit behind the auto scheduler's calibration: probes made by a known ring allreduce
// give that link back; probes whose times do not grow with size (a loaded machine) give a
// conservative link, not an infinitely fast one.
#include "schedule/calibration.h"

#include <gtest/gtest.h>

#include <vector>

#include "gradcomp/codec.h"
#include "support/single_rank.h"

namespace gradcomp::schedule {
namespace {

// The probes' sizes (bytes per rank, as calibrate_link sends) timed on a ring allreduce of
// `world` ranks over `link`: 2 (p-1) alpha + 2 (p-1)/p n beta.
std::vector<LinkProbe> ring_probes(const model::Link& link, int world) {
  std::vector<LinkProbe> probes;
  for (double bytes : {4096.0, 65536.0, 1048576.0, 4194304.0}) {
    const double steps = 2.0 * (world - 1);
    probes.push_back({bytes, steps * link.latency_s + steps / world * bytes / link.bytes_per_s});
  }
  return probes;
}

TEST(Calibration, ProbesOfAKnownRingGiveItsLinkBack) {
  for (int world : {2, 4, 8}) {
    const model::Link link{.bytes_per_s = 1.25e8, .latency_s = 150e-6};
    const model::Link fit = fit_ring_link(ring_probes(link, world), world);
    EXPECT_NEAR(fit.bytes_per_s / link.bytes_per_s, 1.0, 1e-6) << world << " ranks";
    EXPECT_NEAR(fit.latency_s, link.latency_s, 1e-9) << world << " ranks";
  }
}

TEST(Calibration, FlatProbesGiveAConservativeLinkNotAnInfiniteOne) {
  // Every size took about 2 ms: the slope is zero or negative.
  const std::vector<LinkProbe> flat{{4096, 2.1e-3}, {65536, 1.9e-3}, {1048576, 2.0e-3},
                                    {4194304, 1.8e-3}};
  const model::Link fit = fit_ring_link(flat, 4);
  // The largest probe's time counted as transfer: 4 MiB moved 1.5x in 1.8 ms.
  EXPECT_NEAR(fit.bytes_per_s, 4194304.0 * 1.5 / 1.8e-3, 1.0);
  // The smallest probe's time counted as latency, over the ring's 6 steps.
  EXPECT_NEAR(fit.latency_s, 2.1e-3 / 6, 1e-12);
  EXPECT_LT(fit.bytes_per_s, model::kMaxBytesPerS);
}

TEST(Calibration, NothingToFitIsAFreeLink) {
  EXPECT_EQ(fit_ring_link({}, 4).bytes_per_s, model::kMaxBytesPerS);
  EXPECT_EQ(fit_ring_link(ring_probes({1e9, 1e-5}, 2), 1).latency_s, 0);
}

// Two settings of one codec among the options are timed apart, each under its canonical spec
// (what the cost model looks up first); the codec's name gets the first one's costs, and
// "none" is always timed (the routes' plain passes).
TEST(Calibration, EachCodecSpecOfTheOptionsIsTimedOnItsOwn) {
  const auto transport = testing::single_rank_transport();
  const model::CodecCosts costs =
      calibrate_codecs(*transport, {"powersgd:rank=1|ef", "fp16", "powersgd:rank=8|ef|allreduce"});
  const auto rank1 = make_codec("powersgd:rank=1");
  const auto rank8 = make_codec("powersgd:rank=8");
  ASSERT_NE(costs.find(rank1->spec()), nullptr);
  ASSERT_NE(costs.find(rank8->spec()), nullptr);
  EXPECT_EQ(&costs.of(*rank8), costs.find(rank8->spec()));
  const model::CodecCost& by_name = costs.of("powersgd");
  EXPECT_EQ(by_name.encode_ef.b, costs.find(rank1->spec())->encode_ef.b);
  EXPECT_EQ(by_name.decode.a, costs.find(rank1->spec())->decode.a);
  EXPECT_NE(costs.find("fp16"), nullptr);
  EXPECT_NE(costs.find("none"), nullptr);
}

}  // namespace
}  // namespace gradcomp::schedule
