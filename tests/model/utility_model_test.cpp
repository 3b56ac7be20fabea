// The utility model against the communication-only times of anchors-utility-model.md section
// 4.2 (alpha = 10 us, 25 MiB buckets, bandwidth per worker), and its forms on small numbers.
#include "gradcomp/model/utility_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp::model {
namespace {

using Shape = std::vector<size_t>;

// torchvision's bottleneck ResNet: conv1 + bn1, four stages of blocks (conv1x1, conv3x3,
// conv1x1, each with a norm; the first block of a stage has a downsample), fc.
std::vector<Shape> resnet(const std::vector<int>& blocks) {
  std::vector<Shape> s = {{64, 3, 7, 7}, {64}, {64}};
  size_t in = 64;
  const size_t widths[] = {64, 128, 256, 512};
  for (size_t stage = 0; stage < 4; ++stage) {
    const size_t w = widths[stage];
    for (int b = 0; b < blocks[stage]; ++b) {
      for (const Shape& t : std::vector<Shape>{{w, in, 1, 1}, {w}, {w}, {w, w, 3, 3}, {w}, {w},
                                               {4 * w, w, 1, 1}, {4 * w}, {4 * w}}) {
        s.push_back(t);
      }
      if (b == 0) s.insert(s.end(), {{4 * w, in, 1, 1}, {4 * w}, {4 * w}});
      in = 4 * w;
    }
  }
  s.insert(s.end(), {{1000, 2048}, {1000}});
  return s;
}

// BERT-base with the Chinese vocabulary, the pooler and a 5-class head (the authors' Sogou
// News runs).
std::vector<Shape> bert_base_zh() {
  const size_t v = 21128, h = 768, positions = 512, types = 2, inner = 3072;
  std::vector<Shape> s = {{v, h}, {positions, h}, {types, h}, {h}, {h}};
  for (int layer = 0; layer < 12; ++layer) {
    for (int i = 0; i < 4; ++i) s.insert(s.end(), {{h, h}, {h}});  // q, k, v, attention output
    s.insert(s.end(), {{h}, {h}, {inner, h}, {inner}, {h, inner}, {h}, {h}, {h}});
  }
  s.insert(s.end(), {{h, h}, {h}, {5, h}, {5}});
  return s;
}

size_t elements(const Shape& s) {
  return std::accumulate(s.begin(), s.end(), size_t{1}, std::multiplies<>());
}

double gradient_bytes(const std::vector<Shape>& shapes) {
  double n = 0;
  for (const Shape& s : shapes) n += static_cast<double>(elements(s));
  return 4 * n;
}

// The authors' PowerSGD reducer: every tensor of 2 or more dimensions viewed as (shape[0],
// rest) and sent as rank-r factors, r (n + m) floats; 1-D tensors whole.
double powersgd_bytes(const std::vector<Shape>& shapes, size_t rank) {
  double floats = 0;
  for (const Shape& s : shapes) {
    if (s.size() == 1) {
      floats += static_cast<double>(s[0]);
      continue;
    }
    const size_t n = s[0], m = elements(s) / n;
    floats += static_cast<double>(std::min({n, m, rank}) * (n + m));
  }
  return 4 * floats;
}

Cluster flat(int workers, double gbps) {
  Cluster c;
  c.workers = workers;
  c.per_node = 1;  // the bandwidth is each worker's
  c.inter = {gbps * 1e9 / 8, 10e-6};
  return c;
}

UtilityMethod serial(double ratio, Collective collective, int rounds = 1) {
  UtilityMethod m;
  m.ratio = ratio;
  m.collective = collective;
  m.rounds = rounds;
  m.schedule = Schedule::kSerial;
  return m;
}

struct Row {
  const char* model;
  std::vector<Shape> shapes;
  double gbps;
  double sync8, sync64, powersgd64, topk64, signsgd64;  // ms, as the anchors print them
};

TEST(UtilityModel, ReproducesTheAnchorsCommunicationOnlyTable) {
  const std::vector<Shape> r50 = resnet({3, 4, 6, 3}), r101 = resnet({3, 4, 23, 3});
  const std::vector<Shape> bert = bert_base_zh();
  // The parameter counts the anchors give (torchvision, HF).
  EXPECT_EQ(gradient_bytes(r50), 4.0 * 25557032);
  EXPECT_EQ(gradient_bytes(r101), 4.0 * 44549160);
  EXPECT_EQ(gradient_bytes(bert), 4.0 * 102271493);
  const Row rows[] = {
      {"ResNet-50", r50, 10, 143.7, 166.0, 4.9, 103.7, 161.6},
      {"ResNet-50", r50, 25, 57.8, 69.4, 3.5, 41.8, 65.0},
      {"ResNet-101", r101, 10, 250.5, 289.5, 7.5, 180.3, 281.3},
      {"ResNet-101", r101, 25, 100.8, 121.1, 4.5, 72.5, 112.9},
      {"BERT-base-zh", bert, 10, 575.0, 664.5, 8.1, 413.0, 644.9},
      {"BERT-base-zh", bert, 25, 231.3, 277.9, 4.8, 165.6, 258.4},
  };
  // Printed to 0.1 ms: the model must round to the same digits.
  const auto expect_ms = [](double seconds, double printed, const std::string& what) {
    EXPECT_NEAR(seconds * 1e3, printed, 0.05 + 1e-9) << what;
  };
  for (const Row& row : rows) {
    const double m = gradient_bytes(row.shapes);
    const std::string at = std::string(row.model) + " at " + std::to_string(row.gbps) + " Gbps";
    const UtilityMethod sync;  // overlapped DDP buckets; with no compute, the sum of allreduces
    expect_ms(utility_iteration_time(m, 0, flat(8, row.gbps), sync), row.sync8, at + ", p=8 sync");
    expect_ms(utility_iteration_time(m, 0, flat(64, row.gbps), sync), row.sync64, at + ", p=64 sync");
    const UtilityMethod powersgd =
        serial(m / powersgd_bytes(row.shapes, 4), Collective::kAllreduce, 2);
    expect_ms(utility_iteration_time(m, 0, flat(64, row.gbps), powersgd), row.powersgd64,
              at + ", PowerSGD r4");
    // Top-K 1%: 8 bytes per kept element (value + index): ratio 4 / (0.01 * 8) = 50.
    expect_ms(utility_iteration_time(m, 0, flat(64, row.gbps), serial(50, Collective::kAllgather)),
              row.topk64, at + ", Top-K 1%");
    expect_ms(utility_iteration_time(m, 0, flat(64, row.gbps), serial(32, Collective::kAllgather)),
              row.signsgd64, at + ", signSGD");
  }
  EXPECT_NEAR(powersgd_bytes(r50, 4), 1.54e6, 0.005e6);  // the anchors' payload column
}

// Small numbers: 4 workers, no latency, 1 MB/s; a ring allreduce of x bytes takes
// 2 * 3/4 * x us = 1.5 x us, an allgather 3 x us.
Cluster small() {
  Cluster c;
  c.workers = 4;
  c.inter = {1e6, 0};
  return c;
}

TEST(UtilityModel, OverlappedAndStrictTails) {
  UtilitySettings s;
  s.bucket_bytes = 1000;  // 2500 bytes: buckets of 1000, 1000, 500
  UtilityMethod sync;
  sync.lambda = 1.1;
  // Communication 1.5 ms + 1.5 ms + 0.75 ms = 3.75 ms; compute 1.1 * 2 ms = 2.2 ms.
  EXPECT_NEAR(utility_iteration_time(2500, 2e-3, small(), sync, s), 3.75e-3, 1e-12);
  s.tail = TailForm::kStrict;
  EXPECT_NEAR(utility_iteration_time(2500, 2e-3, small(), sync, s), 3.0e-3 + 0.75e-3, 1e-12);
  // Compute-bound: the strict form still pays the last bucket after backward.
  EXPECT_NEAR(utility_iteration_time(2500, 10e-3, small(), sync, s), 11e-3 + 0.75e-3, 1e-12);
  s.tail = TailForm::kOverlapped;
  EXPECT_NEAR(utility_iteration_time(2500, 10e-3, small(), sync, s), 11e-3, 1e-12);
}

TEST(UtilityModel, CompressedSerialAndOverlapped) {
  UtilityMethod m = serial(10, Collective::kAllgather);
  m.encode_s = 1e-3;
  m.decode_s = 0.1e-3;  // per worker's message: 4 of them
  // Serial: 2 ms compute + 1 ms encode + allgather of 250 bytes (0.75 ms) + 0.4 ms decode.
  EXPECT_NEAR(utility_iteration_time(2500, 2e-3, small(), m), 2e-3 + 1e-3 + 0.75e-3 + 0.4e-3, 1e-12);
  UtilitySettings s;
  s.bucket_bytes = 1000;
  m.schedule = Schedule::kOverlapped;
  m.lambda = 1.0;
  // Compute side 2 + 1 = 3 ms; exchange 0.75 ms + 0.4 ms of decoding: compute-bound.
  EXPECT_NEAR(utility_iteration_time(2500, 2e-3, small(), m, s), 3e-3, 1e-12);
  // No compute: the buckets' collectives (0.3 + 0.3 + 0.15 ms) and their decode shares.
  EXPECT_NEAR(utility_iteration_time(2500, 0, small(), m, s), std::max(1e-3, 0.75e-3 + 0.4e-3), 1e-12);
  // Rounds pay latency each.
  Cluster slow = small();
  slow.inter.latency_s = 1e-3;
  const UtilityMethod two = serial(10, Collective::kAllreduce, 2);
  EXPECT_NEAR(utility_iteration_time(2500, 0, slow, two), 2 * 6e-3 + 1.5 * 250e-6, 1e-12);
}

TEST(UtilityModel, CrossoverBandwidthByBisection) {
  // Serial, no latency, p workers, M bytes: syncSGD takes 2 (p-1)/p M / B, a method with ratio
  // c and encode E takes E + 2 (p-1)/p M / (c B): it wins below B* = 2 (p-1)/p M (1 - 1/c) / E.
  const double m = 100e6, e = 20e-3, c = 8, p = 16;
  Cluster cluster;
  cluster.workers = static_cast<int>(p);
  cluster.inter.latency_s = 0;
  UtilityMethod base = serial(1, Collective::kAllreduce);
  UtilityMethod method = serial(c, Collective::kAllreduce);
  method.encode_s = e;
  const double expected = 2 * (p - 1) / p * m * (1 - 1 / c) / e;
  const double found = crossover_bandwidth(m, 0, cluster, method, base, 1e6, 1e12);
  EXPECT_NEAR(found / expected, 1, 1e-9);
  EXPECT_EQ(crossover_bandwidth(m, 0, cluster, method, base, 2 * expected, 1e12), 0);  // never
  EXPECT_EQ(crossover_bandwidth(m, 0, cluster, method, base, 1e6, expected / 2), expected / 2);
}

TEST(UtilityModel, MethodsFromCodecSpecs) {
  CodecCosts costs;
  costs.set("none", {.encode = {}, .encode_ef = {}, .decode = {0, 1e-10}});
  costs.set("topk", {.encode = {1e-5, 1e-9}, .encode_ef = {2e-5, 2e-9}, .decode = {1e-6, 1e-10}});
  costs.set("powersgd", {.encode = {0, 3e-9}, .encode_ef = {0, 4e-9}, .decode = {0, 1e-9}});
  const double n = 1e6;
  const UtilityMethod topk = utility_method("topk:ratio=0.01", n, costs, Schedule::kSerial, 1.05);
  EXPECT_EQ(topk.collective, Collective::kAllgather);
  EXPECT_DOUBLE_EQ(topk.ratio, 50);
  EXPECT_DOUBLE_EQ(topk.encode_s, 1e-5 + 1e-3);
  EXPECT_DOUBLE_EQ(topk.decode_s, 1e-6 + 1e-4);
  const UtilityMethod ef = utility_method("topk:ratio=0.01|ef", n, costs, Schedule::kSerial, 1.05);
  EXPECT_DOUBLE_EQ(ef.encode_s, 1e-4 + 2e-5 + 2e-3);  // compensate pass + fused-residual encode
  const UtilityMethod psgd = utility_method("powersgd:rank=4", n, costs, Schedule::kOverlapped, 1.1);
  EXPECT_EQ(psgd.collective, Collective::kAllreduce);
  EXPECT_EQ(psgd.rounds, 2);
  EXPECT_GT(psgd.ratio, 30);
  EXPECT_EQ(psgd.schedule, Schedule::kOverlapped);
  EXPECT_DOUBLE_EQ(psgd.lambda, 1.1);
  const UtilityMethod none = utility_method("none", n, costs, Schedule::kOverlapped, 1.05);
  EXPECT_EQ(none.name, "syncSGD");
  EXPECT_EQ(none.ratio, 1);
  EXPECT_EQ(none.encode_s, 0);
  EXPECT_NE(testing::error_text([&] { utility_method("fp16", n, costs, Schedule::kSerial, 1); }),
            "no error");  // no costs for fp16
}

}  // namespace
}  // namespace gradcomp::model
