// powersgd: shape rule, wire layout (golden bytes), the two summable rounds, orthonormal P,
// low-rank reconstruction, warm start, state, and the errors of a misused protocol.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "codec/powersgd_matrix.h"
#include "gradcomp/error.h"
#include "gradcomp/random.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::aggregate_allreduce;
using testing::encode;
using testing::gradient;
using testing::hex;

// W codecs that persist across steps (aggregate_allreduce builds fresh ones each call), driven
// exactly like an allreduce route.
class Cluster {
 public:
  Cluster(const std::string& spec, uint32_t world, std::span<const TensorShape> layout = {}) {
    for (uint32_t r = 0; r < world; ++r) {
      codecs_.push_back(make_codec(spec));
      if (!layout.empty()) codecs_.back()->set_layout(layout);
    }
  }
  Codec& operator[](size_t r) { return *codecs_[r]; }
  size_t size() const { return codecs_.size(); }

  // One step; returns the aggregate (mean) and keeps the reduced last-round frame.
  std::vector<float> step(const std::vector<std::vector<float>>& inputs, Context ctx) {
    const auto world = static_cast<uint32_t>(codecs_.size());
    const size_t n = inputs[0].size();
    ctx.world_size = world;
    std::vector<std::vector<std::byte>> p(world);
    for (uint32_t r = 0; r < world; ++r) {
      p[r].resize(codecs_[r]->max_round_bytes(0, n));
      p[r].resize(codecs_[r]->encode_round(0, inputs[r], p[r], at(ctx, r)));
    }
    for (uint32_t r = 1; r < world; ++r) reduce_frame_into(p[0], p[r], DType::kF32, ReduceOp::kSum);
    for (uint32_t r = 0; r < world; ++r) codecs_[r]->absorb_round(0, p[0], at(ctx, r));
    std::vector<std::vector<std::byte>> q(world);
    for (uint32_t r = 0; r < world; ++r) q[r] = encode(*codecs_[r], inputs[r], at(ctx, r));
    for (uint32_t r = 1; r < world; ++r) reduce_frame_into(q[0], q[r], DType::kF32, ReduceOp::kSum);
    for (uint32_t r = 0; r < world; ++r) codecs_[r]->absorb_round(1, q[0], at(ctx, r));
    last_frame = q[0];
    std::vector<float> sum(n, 0.0f);
    codecs_[0]->decode_accumulate(q[0], sum, at(ctx, 0));
    codecs_[0]->finalize(sum, world);
    return sum;
  }

  std::vector<std::byte> last_frame;

 private:
  static Context at(Context ctx, uint32_t r) {
    ctx.rank = r;
    return ctx;
  }
  std::vector<std::unique_ptr<Codec>> codecs_;
};

std::vector<float> mean_of(const std::vector<std::vector<float>>& inputs) {
  std::vector<float> m(inputs[0].size(), 0.0f);
  for (const auto& x : inputs) {
    for (size_t i = 0; i < m.size(); ++i) m[i] += x[i];
  }
  for (float& v : m) v /= static_cast<float>(inputs.size());
  return m;
}

double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    den += double{want[i]} * want[i];
  }
  return std::sqrt(num / den);
}

// rows x cols matrix sum_k s[k] u_k v_k^T, u and v from fixed seeds (shared by all ranks).
std::vector<float> low_rank(size_t rows, size_t cols, const std::vector<float>& s) {
  std::vector<float> m(rows * cols, 0.0f);
  for (size_t k = 0; k < s.size(); ++k) {
    const auto u = gradient(rows, 1000 + k), v = gradient(cols, 2000 + k);
    for (size_t i = 0; i < rows; ++i) {
      for (size_t c = 0; c < cols; ++c) m[i * cols + c] += s[k] * u[i] * v[c];
    }
  }
  return m;
}

// The relative error of the best rank-r approximation of the rows x cols matrix m, by 500
// steps of orthogonal iteration in double precision.
double best_rank_error(const std::vector<float>& m, size_t rows, size_t cols, size_t r) {
  std::vector<std::vector<double>> p(r, std::vector<double>(rows)), q(r, std::vector<double>(cols));
  for (size_t k = 0; k < r; ++k) {
    const auto g = gradient(cols, 500 + k);
    q[k].assign(g.begin(), g.end());
  }
  for (int it = 0; it < 500; ++it) {
    for (size_t k = 0; k < r; ++k) {  // p_k = M q_k, orthonormalised against p_0 .. p_k-1
      for (size_t i = 0; i < rows; ++i) {
        double v = 0;
        for (size_t c = 0; c < cols; ++c) v += m[i * cols + c] * q[k][c];
        p[k][i] = v;
      }
      for (size_t j = 0; j < k; ++j) {
        double d = 0;
        for (size_t i = 0; i < rows; ++i) d += p[j][i] * p[k][i];
        for (size_t i = 0; i < rows; ++i) p[k][i] -= d * p[j][i];
      }
      double norm = 0;
      for (double v : p[k]) norm += v * v;
      for (double& v : p[k]) v /= std::sqrt(norm);
    }
    for (size_t k = 0; k < r; ++k) {  // q_k = M^T p_k
      for (size_t c = 0; c < cols; ++c) {
        double v = 0;
        for (size_t i = 0; i < rows; ++i) v += m[i * cols + c] * p[k][i];
        q[k][c] = v;
      }
    }
  }
  double err = 0, total = 0;
  for (size_t i = 0; i < rows; ++i) {
    for (size_t c = 0; c < cols; ++c) {
      double approx = 0;
      for (size_t k = 0; k < r; ++k) approx += p[k][i] * q[k][c];
      err += (m[i * cols + c] - approx) * (m[i * cols + c] - approx);
      total += double{m[i * cols + c]} * m[i * cols + c];
    }
  }
  return std::sqrt(err / total);
}

// A last-round frame carrying the given Q (column-major), to read P_hat back through decode.
std::vector<std::byte> q_frame(const Codec& codec, uint64_t n, const std::vector<float>& q) {
  std::vector<std::byte> f(kFrameHeaderBytes + 4 * q.size());
  std::memcpy(f.data() + kFrameHeaderBytes, q.data(), 4 * q.size());
  write_frame_header({.codec_id = static_cast<uint8_t>(codec.id()),
                      .round = 1,
                      .param_hash = codec.param_hash(),
                      .elements = n,
                      .payload_bytes = 4 * q.size()},
                     f);
  return f;
}

// Runs round 0 on one codec (world of one).
void absorb_p(Codec& codec, std::span<const float> x, const Context& ctx) {
  std::vector<std::byte> f(codec.max_round_bytes(0, x.size()));
  f.resize(codec.encode_round(0, x, f, ctx));
  codec.absorb_round(0, f, ctx);
}

TEST(PowerSgd, SpecDefaultsAndRanges) {
  EXPECT_EQ(make_codec("powersgd")->spec(), "powersgd:rank=1,cols=0,warm_start=true");
  EXPECT_EQ(make_codec("powersgd:rank=4,cols=64,warm_start=false")->spec(),
            "powersgd:rank=4,cols=64,warm_start=false");
  try {
    make_codec("powersgd:rank=0");
    FAIL();
  } catch (const SpecError& e) {
    EXPECT_STREQ(e.what(),
                 "codec 'powersgd': parameter 'rank' = 0 is out of range; allowed: an "
                 "integer in [1, 1024]");
  }
  EXPECT_THROW(make_codec("powersgd:cols=-1"), SpecError);
  EXPECT_THROW(make_codec("powersgd:warm_start=maybe"), SpecError);
  const CodecTraits t = make_codec("powersgd:rank=4")->traits();
  EXPECT_EQ(t.rounds, 2);
  EXPECT_TRUE(t.summable && t.shared_randomness && !t.unbiased);
  EXPECT_EQ(t.payload_type, DType::kF32);
}

TEST(PowerSgd, ShapeRule) {
  using powersgd::make_shape;
  const auto s = make_shape(1000, 0, 4);  // ceil(sqrt(1000)) = 32, already a multiple of 16
  EXPECT_EQ(s.cols, 32u);
  EXPECT_EQ(s.rows, 32u);
  EXPECT_EQ(s.rank, 4u);
  EXPECT_EQ(make_shape(10, 0, 4).cols, 4u);  // small: ceil(sqrt(10)) as is
  EXPECT_EQ(make_shape(10, 0, 4).rows, 3u);
  EXPECT_EQ(make_shape(10, 0, 4).rank, 3u);    // clamped to min(rows, cols)
  EXPECT_EQ(make_shape(300, 0, 1).cols, 32u);  // ceil(sqrt(300)) = 18 -> 32
  EXPECT_EQ(make_shape(300, 0, 1).rows, 10u);
  EXPECT_EQ(make_shape(5, 100, 2).cols, 5u);  // an explicit width is capped at n
  EXPECT_EQ(make_shape(5, 100, 2).rank, 1u);
  EXPECT_EQ(make_shape(0, 0, 2).rank, 0u);
  EXPECT_EQ(make_shape(uint64_t{1} << 62, 0, 1).cols, uint64_t{1} << 31);  // no overflow
  EXPECT_EQ(powersgd::ceil_sqrt(~uint64_t{0}), uint64_t{1} << 32);
  auto c = make_codec("powersgd:rank=4");
  EXPECT_EQ(c->max_round_bytes(0, 10), kFrameHeaderBytes + 4 * 3 * 3);
  EXPECT_EQ(c->max_frame_bytes(10), kFrameHeaderBytes + 4 * 4 * 3);
}

// n = 6 as a 2 x 3 matrix at rank 1, seed 1, bucket 2: round 0 carries P = M Q, the last round
// Q = M^T P_hat. Checked byte for byte and against the documented layout.
TEST(PowerSgd, GoldenBytes) {
  const std::vector<float> x = {1, 2, 3, -4, 0.5f, 6};
  auto c = make_codec("powersgd:rank=1,cols=3");
  const Context ctx{.seed = 1, .bucket = 2, .step = 5};
  std::vector<std::byte> p(c->max_round_bytes(0, 6));
  p.resize(c->encode_round(0, x, p, ctx));
  // header (40 bytes: "GCFR", version 1, id 16, round 0, flags 0, hash, summands 1, n 6,
  // payload 8, aux 0, crc), then P[0], P[1] as float32.
  EXPECT_EQ(hex(p),
            "4743465201100000d8fc3ea3010000000600000000000000080000000000000000000000e40212e5"
            "963907405e27e53f");
  c->absorb_round(0, p, ctx);
  const auto q = encode(*c, x, ctx);
  EXPECT_EQ(hex(q),
            "4743465201100100d8fc3ea30100000006000000000000000c000000000000000000000093da74da"
            "9f53e9bf60b0ec3fd85cc540");

  // Layout: header fields, then P (2 values) and Q (3 values) as float32.
  FrameHeader h = read_frame_header(p);
  EXPECT_EQ(h.codec_id, 16);
  EXPECT_EQ(h.round, 0);
  EXPECT_EQ(h.elements, 6u);
  EXPECT_EQ(h.payload_bytes, 8u);
  EXPECT_EQ(h.aux, 0u);
  const CounterRng rng(1, 2, 0, CounterRng::kSharedRank, 0);  // warm start: step not in the key
  float pv[2];
  std::memcpy(pv, p.data() + kFrameHeaderBytes, 8);
  for (size_t i = 0; i < 2; ++i) {
    double want = 0;
    for (size_t col = 0; col < 3; ++col) {
      want += x[i * 3 + col] * (2.0 * rng.uniform(static_cast<uint32_t>(col)) - 1.0);
    }
    EXPECT_NEAR(pv[i], want, 1e-6) << i;
  }
  h = read_frame_header(q);
  EXPECT_EQ(h.round, 1);
  EXPECT_EQ(h.payload_bytes, 12u);
  const double norm = std::hypot(double{pv[0]}, double{pv[1]});
  float qv[3];
  std::memcpy(qv, q.data() + kFrameHeaderBytes, 12);
  for (size_t col = 0; col < 3; ++col) {
    const double want = (x[col] * pv[0] + x[3 + col] * pv[1]) / norm;
    EXPECT_NEAR(qv[col], want, 1e-5) << col;
  }
}

// ---- one matrix per tensor (the plan gives shapes)

// A convolution (8 x 3 x 5 x 5: 8 x 75), its bias, a linear layer (64 x 100) and a 2 x 3
// matrix too small to gain from rank 2: three of them plain.
const std::vector<TensorShape> kLayout = {
    {600, {8, 3, 5, 5}}, {8, {8}}, {6400, {64, 100}}, {6, {2, 3}}};
constexpr size_t kLayoutElements = 600 + 8 + 6400 + 6;

// Rank-2 matrices where the layout has matrices, anything in the plain tensors.
std::vector<float> layered_input(uint64_t seed) {
  std::vector<float> x;
  const auto conv = low_rank(8, 75, {3.0f, 1.0f});
  const auto fc = low_rank(64, 100, {2.0f, 0.5f});
  const auto bias = gradient(8, seed), small = gradient(6, seed + 1);
  for (const auto* part : {&conv, &bias, &fc, &small}) x.insert(x.end(), part->begin(), part->end());
  return x;
}

TEST(PowerSgd, EveryTensorOfTwoOrMoreDimensionsIsItsOwnMatrix) {
  auto c = make_codec("powersgd:rank=2");
  c->set_layout(kLayout);
  // Round 0: P of the convolution (8 x 2) and of the linear layer (64 x 2); round 1: their Q
  // (75 x 2 and 100 x 2), then the 8 + 6 plain values.
  EXPECT_EQ(c->max_round_bytes(0, kLayoutElements), kFrameHeaderBytes + 4 * (16 + 128));
  EXPECT_EQ(c->max_frame_bytes(kLayoutElements), kFrameHeaderBytes + 4 * (150 + 200 + 14));
  try {
    c->max_frame_bytes(kLayoutElements + 1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the bucket's tensors hold 7014"), std::string::npos)
        << e.what();
  }
}

TEST(PowerSgd, PerTensorMatricesReconstructLowRankTensorsAndSendTheRestExactly) {
  const std::vector<std::vector<float>> inputs = {layered_input(1), layered_input(2)};
  const auto want = mean_of(inputs);
  Cluster per_tensor("powersgd:rank=2", 2, kLayout);
  Cluster fused("powersgd:rank=2", 2);
  std::vector<float> got, fused_got;
  for (uint64_t step = 0; step < 4; ++step) {
    got = per_tensor.step(inputs, Context{.seed = 3, .step = step});
    fused_got = fused.step(inputs, Context{.seed = 3, .step = step});
  }
  EXPECT_LT(relative_error(got, want), 1e-4);
  EXPECT_GT(relative_error(fused_got, want), 0.1);  // one matrix of all four: rank 2 is not enough
  for (size_t i : {600, 601, 607, 7008, 7013}) EXPECT_FLOAT_EQ(got[i], want[i]) << i;
}

TEST(PowerSgd, PlainTensorsLeaveNoResidual) {
  auto c = make_codec("powersgd:rank=1");
  c->set_layout(kLayout);
  const auto x = layered_input(4);
  absorb_p(*c, x, Context{});
  std::vector<std::byte> f(c->max_frame_bytes(x.size()));
  std::vector<float> residual(x.size(), 99.0f);
  c->encode(x, f, Context{}, residual);
  for (size_t i = 600; i < 608; ++i) EXPECT_EQ(residual[i], 0.0f) << i;
  for (size_t i = 7008; i < 7014; ++i) EXPECT_EQ(residual[i], 0.0f) << i;
  // Rank 1 of a rank-2 matrix leaves something of the convolution.
  double conv = 0;
  for (size_t i = 0; i < 600; ++i) conv += std::abs(residual[i]);
  EXPECT_GT(conv, 1.0);
}

// Without shapes (a plan written before them, or an explicit cols) the bucket stays one matrix:
// the same bytes as a codec never told a layout.
TEST(PowerSgd, WithoutShapesTheBucketIsOneMatrixAsBefore) {
  const std::vector<TensorShape> unknown = {{600, {}}, {8, {}}, {6400, {}}, {6, {}}};
  const auto x = layered_input(5);
  for (const auto& [spec, layout] :
       {std::pair{"powersgd:rank=2", unknown}, std::pair{"powersgd:rank=2,cols=100", kLayout}}) {
    auto plain = make_codec(spec), told = make_codec(spec);
    told->set_layout(layout);
    absorb_p(*plain, x, Context{.seed = 2});
    absorb_p(*told, x, Context{.seed = 2});
    EXPECT_EQ(encode(*told, x, Context{.seed = 2}), encode(*plain, x, Context{.seed = 2})) << spec;
  }
}

TEST(PowerSgd, PerTensorStateContinuesBitExactlyAndVersion1StillLoads) {
  const std::vector<std::vector<float>> inputs = {layered_input(1), layered_input(2)};
  Cluster a("powersgd:rank=2", 2, kLayout);
  for (uint64_t step = 0; step < 2; ++step) a.step(inputs, Context{.seed = 6, .step = step});
  Cluster b("powersgd:rank=2", 2, kLayout);
  for (size_t r = 0; r < 2; ++r) b[r].load_state(a[r].save_state());
  EXPECT_EQ(b.step(inputs, Context{.seed = 6, .step = 2}),
            a.step(inputs, Context{.seed = 6, .step = 2}));
  // A per-tensor state does not fit the fused view of the same elements.
  try {
    make_codec("powersgd:rank=2")->load_state(a[0].save_state());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("version 2; expected"), std::string::npos) << e.what();
  }
  // The fused view keeps version 1 (one matrix, no count), as checkpoints before per-tensor
  // matrices hold it: it loads and saves the same bytes.
  Cluster fused("powersgd:rank=1,cols=3", 1);
  fused.step({{1, 2, 3, -4, 0.5f, 6}}, Context{});
  const auto v1 = fused[0].save_state();
  EXPECT_EQ(v1[4], std::byte{1});
  EXPECT_EQ(v1.size(), 9 + 8 * 4 + 4 * 3u);  // magic, version, has, n, rows, cols, rank, Q
  auto c = make_codec("powersgd:rank=1,cols=3");
  c->load_state(v1);
  EXPECT_EQ(c->save_state(), v1);
}

TEST(PowerSgd, ReconstructsALowRankMeanAtSufficientRank) {
  const size_t rows = 48, cols = 40;
  std::vector<std::vector<float>> inputs;
  for (uint32_t r = 0; r < 4; ++r) {  // same row and column spaces, rank-specific weights
    inputs.push_back(low_rank(rows, cols, {3.0f + r, 1.0f - 0.3f * r}));
  }
  const auto mean = mean_of(inputs);
  for (int rank : {2, 3}) {
    const std::string spec = "powersgd:rank=" + std::to_string(rank) + ",cols=40";
    const auto agg = aggregate_allreduce(spec, inputs, Context{.seed = 9});
    EXPECT_LT(relative_error(agg, mean), 1e-4) << "rank " << rank;
  }
  // Rank 1 cannot: the second direction is missing.
  const auto agg1 = aggregate_allreduce("powersgd:rank=1,cols=40", inputs, Context{.seed = 9});
  EXPECT_GT(relative_error(agg1, mean), 1e-2);
}

TEST(PowerSgd, WarmStartDecreasesTheErrorOnAFixedInput) {
  // A decaying spectrum plus noise: power iteration converges to the top directions.
  const size_t rows = 64, cols = 64;
  std::vector<std::vector<float>> inputs;
  for (uint32_t r = 0; r < 4; ++r) {
    auto m = low_rank(rows, cols, {8, 6, 4.5f, 3.4f});
    const auto noise = gradient(rows * cols, 77 + r, 0.05f);
    for (size_t i = 0; i < m.size(); ++i) m[i] += noise[i];
    inputs.push_back(std::move(m));
  }
  const auto mean = mean_of(inputs);
  Cluster warm("powersgd:rank=2,cols=64", 4), cold("powersgd:rank=2,cols=64,warm_start=false", 4);
  std::vector<double> warm_err, cold_err;
  for (uint64_t step = 0; step < 12; ++step) {
    warm_err.push_back(relative_error(warm.step(inputs, Context{.seed = 3, .step = step}), mean));
    cold_err.push_back(relative_error(cold.step(inputs, Context{.seed = 3, .step = step}), mean));
  }
  for (size_t s = 1; s < warm_err.size(); ++s) {
    EXPECT_LE(warm_err[s], warm_err[s - 1] * (1 + 1e-4)) << "step " << s;
  }
  EXPECT_LT(warm_err.back(), 0.9 * warm_err.front());
  // Converges to the best rank-2 approximation, which the first step does not reach.
  const double best = best_rank_error(mean, rows, cols, 2);
  EXPECT_LT(warm_err.back(), 1.01 * best);
  EXPECT_GT(warm_err.front(), 1.05 * best);
  // Without warm start every step starts from a fresh random Q: no steady improvement.
  EXPECT_GT(cold_err.back(), warm_err.back());
  // Step 0 of a persistent cluster is what the one-shot reference route computes.
  Cluster again("powersgd:rank=2,cols=64", 4);
  EXPECT_EQ(again.step(inputs, Context{.seed = 3}),
            aggregate_allreduce("powersgd:rank=2,cols=64", inputs, Context{.seed = 3}));
}

TEST(PowerSgd, BothRoundsAreSummable) {
  const size_t n = 3000;
  const uint32_t world = 3;
  std::vector<std::unique_ptr<Codec>> codecs;
  std::vector<std::vector<float>> x;
  std::vector<std::vector<std::byte>> p(world);
  for (uint32_t r = 0; r < world; ++r) {
    codecs.push_back(make_codec("powersgd:rank=3"));
    x.push_back(gradient(n, 40 + r));
    const Context ctx{.seed = 5, .rank = r, .world_size = world};
    p[r].resize(codecs[r]->max_round_bytes(0, n));
    p[r].resize(codecs[r]->encode_round(0, x[r], p[r], ctx));
  }
  // Round 0: the reduced payload is the float sum of the payloads.
  auto reduced = p[0];
  for (uint32_t r = 1; r < world; ++r)
    reduce_frame_into(reduced, p[r], DType::kF32, ReduceOp::kSum);
  const size_t values = (p[0].size() - kFrameHeaderBytes) / 4;
  for (size_t i = 0; i < values; ++i) {
    float want = 0, got;
    for (uint32_t r = 0; r < world; ++r) {
      float v;
      std::memcpy(&v, p[r].data() + kFrameHeaderBytes + 4 * i, 4);
      want += v;
    }
    std::memcpy(&got, reduced.data() + kFrameHeaderBytes + 4 * i, 4);
    ASSERT_EQ(got, want) << i;
  }
  EXPECT_EQ(read_frame_header(reduced).summands, world);
  // Last round: decoding the summed Q equals the sum of decoding each rank's Q.
  for (uint32_t r = 0; r < world; ++r) codecs[r]->absorb_round(0, reduced, Context{.seed = 5});
  std::vector<std::vector<std::byte>> q(world);
  std::vector<float> separate(n, 0.0f);
  for (uint32_t r = 0; r < world; ++r) {
    q[r] = encode(*codecs[r], x[r], Context{.seed = 5, .rank = r, .world_size = world});
    codecs[0]->decode_accumulate(q[r], separate, Context{});
  }
  for (uint32_t r = 1; r < world; ++r) reduce_frame_into(q[0], q[r], DType::kF32, ReduceOp::kSum);
  const auto summed = testing::decode(*codecs[0], q[0], n);
  for (size_t i = 0; i < n; ++i)
    ASSERT_NEAR(summed[i], separate[i], 1e-4f * (1 + std::fabs(separate[i]))) << i;
}

// Reads P_hat back: decoding Q = e_c in column k puts column k of P_hat into matrix column c.
std::vector<std::vector<double>> read_p_hat(const Codec& c, const powersgd::Shape& s) {
  std::vector<std::vector<double>> cols(s.rank);
  for (size_t k = 0; k < s.rank; ++k) {
    std::vector<float> q(s.rank * s.cols, 0.0f);
    q[k * s.cols] = 1.0f;  // matrix column 0
    const auto out = testing::decode(c, q_frame(c, s.n, q), s.n);
    for (size_t i = 0; i < s.rows; ++i) cols[k].push_back(out[i * s.cols]);
  }
  return cols;
}

TEST(PowerSgd, PIsOrthonormalAfterAbsorb) {
  const size_t n = 4096;
  auto c = make_codec("powersgd:rank=4");
  const auto s = powersgd::make_shape(n, 0, 4);
  absorb_p(*c, gradient(n, 8), Context{.seed = 2});
  const auto p = read_p_hat(*c, s);
  for (size_t a = 0; a < s.rank; ++a) {
    for (size_t b = 0; b < s.rank; ++b) {
      double dot = 0;
      for (size_t i = 0; i < s.rows; ++i) dot += p[a][i] * p[b][i];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5) << a << "," << b;
    }
  }
}

TEST(PowerSgd, DependentColumnsOfPBecomeZero) {
  // A rank-1 matrix at rank 2: M Q has one direction; the second column of P_hat is zero.
  const size_t rows = 16, cols = 16;
  const auto m = low_rank(rows, cols, {2.0f});
  auto c = make_codec("powersgd:rank=2,cols=16");
  absorb_p(*c, m, Context{.seed = 4});
  const auto p = read_p_hat(*c, powersgd::make_shape(rows * cols, 16, 2));
  double n0 = 0, n1 = 0;
  for (size_t i = 0; i < rows; ++i) {
    n0 += p[0][i] * p[0][i];
    n1 += p[1][i] * p[1][i];
  }
  EXPECT_NEAR(n0, 1.0, 1e-5);
  EXPECT_EQ(n1, 0.0);
  // An all-zero input: P_hat is zero, and the aggregate is exactly zero.
  const std::vector<float> zero(rows * cols, 0.0f);
  for (float v : aggregate_allreduce("powersgd:rank=2,cols=16", {zero, zero})) ASSERT_EQ(v, 0.0f);
}

TEST(PowerSgd, StateContinuesBitExactly) {
  const size_t n = 5000;
  std::vector<std::vector<float>> inputs = {gradient(n, 1), gradient(n, 2)};
  Cluster a("powersgd:rank=2", 2);
  for (uint64_t step = 0; step < 3; ++step) a.step(inputs, Context{.seed = 6, .step = step});
  Cluster b("powersgd:rank=2", 2);
  for (size_t r = 0; r < 2; ++r) {
    b[r].load_state(a[r].save_state());
    EXPECT_EQ(b[r].save_state(), a[r].save_state());
  }
  EXPECT_EQ(b.step(inputs, Context{.seed = 6, .step = 3}),
            a.step(inputs, Context{.seed = 6, .step = 3}));
  EXPECT_EQ(b.last_frame, a.last_frame);
  // Without the state the continuation differs (the warm start matters).
  Cluster fresh("powersgd:rank=2", 2);
  fresh.step(inputs, Context{.seed = 6, .step = 4});
  EXPECT_NE(fresh.last_frame, a.last_frame);
}

TEST(PowerSgd, BadStatesAreRejected) {
  Cluster a("powersgd:rank=2", 1);
  a.step({gradient(1000, 1)}, Context{});
  const auto state = a[0].save_state();
  auto c = make_codec("powersgd:rank=2");
  EXPECT_THROW(c->load_state(std::span(state).first(state.size() - 1)), Error);
  auto longer = state;
  longer.push_back(std::byte{0});
  EXPECT_THROW(c->load_state(longer), Error);
  auto magic = state;
  magic[0] = std::byte{'X'};
  EXPECT_THROW(c->load_state(magic), Error);
  // The Q of rank 2 does not fit a rank-3 codec.
  try {
    make_codec("powersgd:rank=3")->load_state(state);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3"), std::string::npos) << e.what();
  }
  // The state before any step is valid too.
  auto empty = make_codec("powersgd");
  c = make_codec("powersgd");
  c->load_state(empty->save_state());
}

// Found by codec_state_fuzz: the state saved after a step on 0 elements (a Q of 0 floats) made
// load_state memcpy into a null pointer (undefined behaviour, caught by UBSan).
TEST(PowerSgd, StateOfAnEmptyBucketLoads) {
  for (const char* spec : {"powersgd:rank=2", "powersgd:rank=1,cols=8"}) {
    Cluster a(spec, 1);
    a.step({gradient(0, 1)}, Context{});
    const auto state = a[0].save_state();
    auto c = make_codec(spec);
    c->load_state(state);
    EXPECT_EQ(c->save_state(), state) << spec;
  }
}

TEST(PowerSgd, ProtocolMisuseIsAClearError) {
  const auto x = gradient(100, 1);
  auto c = make_codec("powersgd:rank=2");
  std::vector<std::byte> out(c->max_frame_bytes(100));
  EXPECT_THROW(c->encode(x, out, Context{}), Error);  // round 0 not absorbed
  auto other = make_codec("powersgd:rank=2");
  absorb_p(*other, x, Context{});
  const auto q = encode(*other, x, Context{});
  std::vector<float> sum(100);
  EXPECT_THROW(c->decode_accumulate(q, sum, Context{}), Error);  // no P_hat here
  absorb_p(*c, gradient(99, 1), Context{});                      // P_hat for another length
  EXPECT_THROW(c->decode_accumulate(q, sum, Context{}), Error);
  EXPECT_THROW(c->encode_round(1, x, out, Context{}), Error);
  EXPECT_THROW(c->max_round_bytes(1, 100), Error);
  EXPECT_THROW(c->absorb_round(2, q, Context{}), Error);
  // A round-0 frame whose payload does not match its element count.
  std::vector<std::byte> p(c->max_round_bytes(0, 100));
  p.resize(c->encode_round(0, x, p, Context{}));
  FrameHeader h = read_frame_header(p);
  h.elements = 400;  // a 20 x 20 matrix needs 20 x 2 values, not 10 x 2
  write_frame_header(h, p);
  EXPECT_THROW(c->absorb_round(0, p, Context{}), FrameError);
  // A residual that partly overlaps the input.
  auto y = gradient(200, 3);
  absorb_p(*c, std::span(y).first(100), Context{});
  EXPECT_THROW(c->encode(std::span(y).first(100), out, Context{}, std::span(y).subspan(50, 100)),
               Error);
}

TEST(PowerSgd, NonFiniteInputPropagatesAndTheNextStepRecovers) {
  const size_t n = 2000;
  auto bad = gradient(n, 1);
  bad[17] = std::numeric_limits<float>::quiet_NaN();
  Cluster c("powersgd:rank=2", 2);
  const auto out = c.step({bad, gradient(n, 2)}, Context{});
  size_t nan = 0;
  for (float v : out) nan += std::isnan(v);
  EXPECT_GT(nan, 0u);
  // The NaN in the stored Q is redrawn: the next finite step is finite again.
  for (float v : c.step({gradient(n, 3), gradient(n, 4)}, Context{.step = 1}))
    ASSERT_TRUE(std::isfinite(v));
}

// The kernels (SIMD or not, blocked in rows and columns) compute exactly the documented sums:
// P[i][k] over 16 lanes (lane j takes the elements with index j mod 16, in order) folded
// 8-4-2-1; Q[c][k] summed down the rows in order; P Q^T as an fma chain over k from +0.
TEST(PowerSgd, KernelsComputeTheDocumentedSums) {
  for (const auto& [n, cols, rank] : {std::tuple<size_t, size_t, size_t>{5000, 37, 6},
                                      {4096, 64, 4},
                                      {1001, 0, 3},
                                      {70, 70, 1}}) {
    SCOPED_TRACE(::testing::Message() << n << " " << cols << " " << rank);
    const auto s = powersgd::make_shape(n, cols, rank);
    const auto m = gradient(n, 31);
    const auto qt = gradient(s.rank * s.cols, 32);
    std::vector<float> pt(s.rank * s.rows);
    powersgd::multiply_q(m, s, qt.data(), pt.data(), 2);
    for (size_t i = 0; i < s.rows; ++i) {
      for (size_t k = 0; k < s.rank; ++k) {
        float lanes[16] = {};
        for (size_t c = 0; c < powersgd::row_length(s, i); ++c) {
          lanes[c % 16] = std::fma(m[i * s.cols + c], qt[k * s.cols + c], lanes[c % 16]);
        }
        for (size_t w = 8; w >= 1; w /= 2) {
          for (size_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
        }
        ASSERT_EQ(pt[k * s.rows + i], lanes[0]) << i << " " << k;
      }
    }
    std::vector<float> q(s.rank * s.cols);
    powersgd::multiply_p(m, s, pt.data(), q.data(), 2);
    for (size_t k = 0; k < s.rank; ++k) {
      for (size_t c = 0; c < s.cols; ++c) {
        float want = 0;
        for (size_t i = 0; i < s.rows; ++i) {
          if (c < powersgd::row_length(s, i))
            want = std::fma(m[i * s.cols + c], pt[k * s.rows + i], want);
        }
        ASSERT_EQ(q[k * s.cols + c], want) << k << " " << c;
      }
    }
    std::vector<float> sum(n, 1.0f);
    powersgd::for_each_reconstructed_row(s, pt.data(), q.data(), 2,
                                         [&](size_t begin, const float* row, size_t len) {
                                           powersgd::add_row(row, sum.data() + begin, len);
                                         });
    for (size_t e = 0; e < n; ++e) {
      const size_t i = e / s.cols, c = e % s.cols;
      float v = 0.0f;
      for (size_t k = 0; k < s.rank; ++k) v = std::fma(pt[k * s.rows + i], q[k * s.cols + c], v);
      ASSERT_EQ(sum[e], 1.0f + v) << e;
    }
  }
}

TEST(PowerSgd, ThreadCountDoesNotChangeAnyRound) {
  const auto x = gradient(1 << 20, 5);
  auto run = [&](int threads) {
    auto c = make_codec("powersgd:rank=4");
    const Context ctx{.seed = 1, .threads = threads};
    std::vector<std::byte> p(c->max_round_bytes(0, x.size()));
    p.resize(c->encode_round(0, x, p, ctx));
    c->absorb_round(0, p, ctx);
    std::vector<float> residual(x.size());
    auto q = encode(*c, x, ctx, residual);
    const auto decoded = testing::decode(*c, q, x.size(), ctx);
    return std::make_tuple(p, q, residual, decoded);
  };
  EXPECT_TRUE(run(1) == run(2));
}

}  // namespace
}  // namespace gradcomp
