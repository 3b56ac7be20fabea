#include "gradcomp/model/cost_model.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/frame.h"
#include "support/codec_testing.h"

namespace gradcomp::model {
namespace {

using testing::contains;

using nlohmann::json;
using testing::error_text;

constexpr double kAlpha = 10e-6;   // inter latency
constexpr double kBeta = 1 / 1e9;  // inter: 1 GB/s
constexpr double kAlphaIn = 2e-6;  // intra latency
constexpr double kBetaIn = 1 / 8e9;

Cluster cluster(int workers, int per_node) {
  Cluster c;
  c.workers = workers;
  c.per_node = per_node;
  c.inter = {1e9, kAlpha};
  c.intra = {8e9, kAlphaIn};
  return c;
}

// Costs chosen so every term can be told apart: encode 1 ns/element + 1 us, and so on.
CodecCosts costs() {
  CodecCosts c;
  const CodecCost generic{.encode = {1e-6, 1e-9}, .encode_ef = {2e-6, 2e-9}, .decode = {3e-6, 3e-9}};
  for (const auto& name : codec_names()) c.set(name, generic);
  c.set("none", {.encode = {0, 0.5e-9}, .encode_ef = {0, 0.5e-9}, .decode = {0.1e-6, 0.25e-9}});
  return c;
}
double pass(double n) { return 0.1e-6 + 0.25e-9 * n; }
double enc(double n) { return 1e-6 + 1e-9 * n; }
double enc_ef(double n) { return 2e-6 + 2e-9 * n; }
double dec(double n) { return 3e-6 + 3e-9 * n; }

double frame(const std::string& spec, size_t n) {
  return static_cast<double>(make_codec(spec)->max_frame_bytes(n));
}

std::vector<std::string> names(const BucketCost& b) {
  std::vector<std::string> out;
  for (const Phase& p : b.phases) out.push_back(p.name);
  return out;
}

// ---- the collectives, closed form

TEST(Collectives, RingAllreduce) {
  const Link link{1e9, kAlpha};
  const double n = 1e6, p = 8;
  EXPECT_DOUBLE_EQ(CostModel::ring_allreduce(link, 8, n), 2 * (p - 1) * kAlpha + 2 * (p - 1) / p * n * kBeta);
  EXPECT_EQ(CostModel::ring_allreduce(link, 1, n), 0);
}

TEST(Collectives, AllgatherAlltoallBroadcast) {
  const Link link{1e9, kAlpha};
  const double m = 1e5;
  EXPECT_DOUBLE_EQ(CostModel::ring_allgather(link, 16, m), 15 * kAlpha + 15 * m * kBeta);
  EXPECT_DOUBLE_EQ(CostModel::alltoall(link, 16, m), 15 * kAlpha + 15.0 / 16 * m * kBeta);
  EXPECT_DOUBLE_EQ(CostModel::broadcast(link, 8, m), 3 * kAlpha + m * kBeta);
  EXPECT_DOUBLE_EQ(CostModel::broadcast(link, 5, m), 3 * kAlpha + m * kBeta);  // ceil(log2 5)
  EXPECT_EQ(CostModel::ring_allgather(link, 1, m), 0);
  EXPECT_EQ(CostModel::alltoall(link, 1, m), 0);
}

TEST(Collectives, FlatOnesRunAtTheNicAcrossNodesAndInsideOneNode) {
  const double n = 4e6;
  const CostModel across(cluster(16, 4), costs());
  EXPECT_DOUBLE_EQ(across.allreduce(n), 2 * 15 * kAlpha + 2 * 15.0 / 16 * n * kBeta);
  EXPECT_DOUBLE_EQ(across.allgather(n), 15 * kAlpha + 15 * n * kBeta);
  // Each NIC carries its 4 ranks' shares for the 12 ranks elsewhere: 4 * 12/16 n.
  EXPECT_DOUBLE_EQ(across.alltoall(n), 15 * kAlpha + 3 * n * kBeta);
  const CostModel one_node(cluster(4, 4), costs());
  EXPECT_DOUBLE_EQ(one_node.allreduce(n), 2 * 3 * kAlphaIn + 2 * 3.0 / 4 * n * kBetaIn);
  EXPECT_DOUBLE_EQ(one_node.alltoall(n), 3 * kAlphaIn + 3.0 / 4 * n * kBetaIn);
}

// ---- routes

TEST(Routes, NoneAllreducesTheRawBuffer) {
  const CostModel model(cluster(16, 1), costs());
  const double n = 1 << 20;
  const BucketCost b = model.bucket({}, n);
  EXPECT_EQ(names(b), std::vector<std::string>{"allreduce"});
  EXPECT_DOUBLE_EQ(b.exchange_s(), model.allreduce(4 * n));
  EXPECT_DOUBLE_EQ(b.bytes_sent(), 4 * n);
  EXPECT_EQ(b.encode_s, 0);
  EXPECT_DOUBLE_EQ(b.decode_s, pass(n));
}

TEST(Routes, AllreduceOfAFrameAndTheNonFiniteFlag) {
  const CostModel model(cluster(16, 1), costs());
  const size_t n = 1 << 20;
  // fp16 carries NaN in its payload: one collective.
  const BucketCost half = model.bucket(parse_option("fp16"), n);
  const double payload = frame("fp16", n) - kFrameHeaderBytes;
  EXPECT_EQ(payload, 2.0 * n);
  EXPECT_EQ(names(half), std::vector<std::string>{"allreduce"});
  EXPECT_DOUBLE_EQ(half.exchange_s(), model.allreduce(payload));
  EXPECT_DOUBLE_EQ(half.encode_s, enc(n));
  EXPECT_DOUBLE_EQ(half.decode_s, dec(n) + pass(n));
  // intq's payload cannot carry NaN: the flag costs one more latency-bound allreduce; with
  // feedback, encode is compensate + the fused-residual encode, split over its two rounds.
  const BucketCost q = model.bucket(parse_option("intq:bits=8|ef"), n);
  EXPECT_EQ(names(q), (std::vector<std::string>{"round 0", "encode", "allreduce", "non-finite flag"}));
  EXPECT_DOUBLE_EQ(q.phases.back().seconds, model.allreduce(4));
  EXPECT_DOUBLE_EQ(q.encode_s, pass(n) + enc_ef(n) / 2);
  EXPECT_DOUBLE_EQ(q.phases[1].seconds, enc_ef(n) / 2);
}

TEST(Routes, PowerSgdPaysTwoRoundsOfLatency) {
  const CostModel model(cluster(8, 1), costs());
  const size_t n = 1 << 20;
  const auto codec = make_codec("powersgd:rank=4");
  const double p_bytes = static_cast<double>(codec->max_round_bytes(0, n)) - kFrameHeaderBytes;
  const double q_bytes = static_cast<double>(codec->max_frame_bytes(n)) - kFrameHeaderBytes;
  const BucketCost b = model.bucket(parse_option("powersgd:rank=4"), n);
  EXPECT_EQ(names(b), (std::vector<std::string>{"round 0", "encode", "allreduce"}));
  EXPECT_DOUBLE_EQ(b.phases[0].seconds, model.allreduce(p_bytes));
  EXPECT_DOUBLE_EQ(b.phases[2].seconds, model.allreduce(q_bytes));
  EXPECT_DOUBLE_EQ(b.bytes_sent(), p_bytes + q_bytes);
}

TEST(Routes, AllgatherDecodesEveryWorkersFrame) {
  const int w = 16;
  const CostModel model(cluster(w, 1), costs());
  const size_t n = 1 << 20;
  const BucketCost b = model.bucket(parse_option("signsgd"), n);
  // signsgd's frames have a fixed size: no sizes go first.
  EXPECT_EQ(names(b), (std::vector<std::string>{"allgather"}));
  EXPECT_DOUBLE_EQ(b.phases[0].seconds, model.allgather(frame("signsgd", n)));
  EXPECT_DOUBLE_EQ(b.phases[0].seconds, (w - 1) * kAlpha + (w - 1) * (40 + n / 8.0) * kBeta);
  EXPECT_DOUBLE_EQ(b.encode_s, enc(n));
  EXPECT_DOUBLE_EQ(b.decode_s, w * dec(n) + pass(n));
  // threshold's depend on the data: 8 bytes per rank first.
  const BucketCost t = model.bucket(parse_option("threshold:tau=0.01|ef|allgather"), n);
  EXPECT_EQ(names(t), (std::vector<std::string>{"sizes", "allgather"}));
  EXPECT_DOUBLE_EQ(t.phases[0].seconds, model.allgather(8));
  EXPECT_DOUBLE_EQ(t.bytes_sent(), 8 + frame("threshold:tau=0.01", n));
}

TEST(Routes, TwowayShardsServesAndGathers) {
  const int w = 8;
  const CostModel model(cluster(w, 1), costs());
  const size_t n = 1 << 20, shard = n / w;
  const double f = frame("topk:ratio=0.01", shard);
  const BucketCost b = model.bucket(parse_option("topk:ratio=0.01|ef|twoway"), n);
  // top-k's frames have a fixed size: no sizes go first.
  EXPECT_EQ(names(b), (std::vector<std::string>{"shards", "server", "results"}));
  EXPECT_DOUBLE_EQ(b.phases[0].seconds, model.alltoall(f * w));
  // The server decodes W frames of its shard, finalizes, compensates (server feedback = the
  // worker's, ef) and re-encodes.
  EXPECT_DOUBLE_EQ(b.phases[1].seconds, w * dec(shard) + pass(shard) + pass(shard) + enc_ef(shard));
  EXPECT_DOUBLE_EQ(b.phases[2].seconds, model.allgather(f));
  EXPECT_DOUBLE_EQ(b.encode_s, pass(n) + w * enc_ef(shard));
  EXPECT_DOUBLE_EQ(b.decode_s, w * dec(shard) + pass(n));
  EXPECT_DOUBLE_EQ(b.bytes_sent(), f * (w - 1) + f);  // its own shard's frame stays here
  // Server feedback none: a plain encode on the server.
  const BucketCost plain =
      model.bucket(parse_option("topk:ratio=0.01|ef|twoway:server_feedback=none"), n);
  EXPECT_DOUBLE_EQ(plain.phases[1].seconds, w * dec(shard) + pass(shard) + enc(shard));
  // threshold's frame sizes depend on the data: both exchanges send sizes first.
  const BucketCost t = model.bucket(parse_option("threshold:tau=0.01|ef|twoway"), n);
  EXPECT_EQ(names(t), (std::vector<std::string>{"shard sizes", "shards", "server", "result sizes",
                                                "results"}));
  EXPECT_DOUBLE_EQ(t.phases[0].seconds, model.alltoall(8.0 * w));
  const double tf = frame("threshold:tau=0.01", shard);
  EXPECT_DOUBLE_EQ(t.bytes_sent(), 8.0 * (w - 1) + tf * (w - 1) + 8 + tf);
}

// Dedicated servers: a push (each worker's S shard frames, each server's W) and a pull the
// other way, the busier NIC setting each; the servers' work off the workers' thread.
TEST(Routes, ServersPushThenPullOverTheBusierNic) {
  const int w = 8;
  const size_t n = 1 << 20;
  for (int s : {8, 2}) {
    Cluster c = cluster(w, 1);
    c.servers = s;
    const CostModel model(c, costs());
    const size_t shard = n / static_cast<size_t>(s);
    const double f = frame("topk:ratio=0.01", shard);
    const BucketCost b = model.bucket(parse_option("topk:ratio=0.01|ef|servers"), n);
    // The pull runs in the decode stage (it overlaps the next push): not an exchange phase.
    EXPECT_EQ(names(b), (std::vector<std::string>{"control", "shards", "server"}));
    // Worker NIC: s frames of the shard; server NIC: w frames. The busier sets the time.
    const double worker_nic = s * kAlpha + s * f * kBeta;
    const double server_nic = w * kAlpha + w * f * kBeta;
    EXPECT_DOUBLE_EQ(b.phases[1].seconds, std::max(worker_nic, server_nic)) << s;
    EXPECT_DOUBLE_EQ(b.phases[2].seconds, w * dec(shard) + pass(shard) + pass(shard) + enc_ef(shard));
    EXPECT_DOUBLE_EQ(b.encode_s, pass(n) + s * enc_ef(shard));
    EXPECT_DOUBLE_EQ(b.decode_s, b.phases[1].seconds + s * dec(shard) + pass(n)) << s;
    // A worker sends one compressed bucket, whatever W and S (the header is worker 0's alone).
    EXPECT_NEAR(b.bytes_sent(), s * f, 1e-9) << s;
  }
  // Fewer servers than workers: the servers' NICs are the bottleneck.
  Cluster few = cluster(w, 1);
  few.servers = 2;
  Cluster many = cluster(w, 1);  // 0: as many as workers
  const auto time = [&](const Cluster& c) {
    return CostModel(c, costs()).bucket_times(parse_option("qsgd|none|servers"), n).exchange_s;
  };
  EXPECT_GT(time(few), 2 * time(many));
  // Sizes go first for codecs whose frames vary.
  const BucketCost t =
      CostModel(many, costs()).bucket(parse_option("threshold:tau=0.01|ef|servers"), n);
  EXPECT_EQ(names(t), (std::vector<std::string>{"control", "shard sizes", "shards", "server"}));
  // A word from each worker to each server: W = S messages at either end, none to workers.
  EXPECT_DOUBLE_EQ(t.phases[1].seconds, w * kAlpha);
}

TEST(Routes, HierarchicalIntraThenLeadersThenBroadcast) {
  const int w = 32, local = 8, nodes = 4;
  const Cluster c = cluster(w, local);
  const CostModel model(c, costs());
  const double n = 1 << 20;
  const BucketCost b = model.bucket(parse_option("none||hierarchical"), n);
  EXPECT_EQ(names(b), (std::vector<std::string>{"intra allreduce", "node mean", "encode",
                                                "allreduce", "decode", "intra broadcast"}));
  const double intra_ar = 2 * (local - 1) * kAlphaIn + 2.0 * (local - 1) / local * 4 * n * kBetaIn;
  const double leaders = 2 * (nodes - 1) * kAlpha + 2.0 * (nodes - 1) / nodes * 4 * n * kBeta;
  const double bcast = 3 * kAlphaIn + 4 * n * kBetaIn;
  EXPECT_DOUBLE_EQ(b.phases[0].seconds, intra_ar);
  EXPECT_DOUBLE_EQ(b.phases[3].seconds, leaders);
  EXPECT_DOUBLE_EQ(b.phases[5].seconds, bcast);
  EXPECT_DOUBLE_EQ(b.exchange_s(), intra_ar + pass(n) + 0 + leaders + pass(n) + bcast);
  EXPECT_DOUBLE_EQ(b.bytes_sent(), 4 * n + 4 * n + 4 * n);

  // fp16 inside the node halves the intra bytes; the inner codec's work is on the exchanger.
  const BucketCost h =
      model.bucket(parse_option("signsgd||hierarchical:inner=allgather,intra=fp16"), n);
  EXPECT_DOUBLE_EQ(h.phases[0].seconds,
                   2 * (local - 1) * kAlphaIn + 2.0 * (local - 1) / local * 2 * n * kBetaIn);
  EXPECT_DOUBLE_EQ(h.encode_s, enc(n));  // the cast to float16 (fp16's encode)
  EXPECT_EQ(h.phases[2].name, "encode");
  EXPECT_DOUBLE_EQ(h.phases[2].seconds, enc(n));  // signsgd's, among leaders
  EXPECT_EQ(h.phases[3].name, "allgather");
  EXPECT_EQ(h.phases[4].name, "decode");
  EXPECT_DOUBLE_EQ(h.phases[4].seconds, nodes * dec(n) + pass(n));
}

// Every rank of a node works across nodes on its shard: inside the node 2 (L - 1) / L of the
// bucket per rank (the leader route: the bucket twice, allreduce and broadcast); across nodes
// each rank's inner route carries n / L elements, its L flows sharing the node's NIC.
TEST(Routes, ShardedReduceScattersThenShardsAcrossNodesThenAllgathers) {
  const int w = 32, local = 8, nodes = 4;
  const Cluster c = cluster(w, local);
  const CostModel model(c, costs());
  const double n = 1 << 20, shard = n / local;
  const BucketCost b = model.bucket(parse_option("none||sharded"), n);
  EXPECT_EQ(names(b), (std::vector<std::string>{"intra reduce-scatter", "node mean", "encode",
                                                "allreduce", "decode", "intra allgather"}));
  const double scatter = (local - 1) * kAlphaIn + (local - 1.0) / local * 4 * n * kBetaIn;
  const double cross =
      2 * (nodes - 1) * kAlpha + 2.0 * (nodes - 1) / nodes * 4 * shard * kBeta * local;
  const double gather = (local - 1) * kAlphaIn + (local - 1) * 4 * shard * kBetaIn;
  EXPECT_DOUBLE_EQ(b.phases[0].seconds, scatter);
  EXPECT_DOUBLE_EQ(b.phases[3].seconds, cross);
  EXPECT_DOUBLE_EQ(b.phases[5].seconds, gather);
  const double intra_bytes = b.phases[0].bytes + b.phases[5].bytes;
  EXPECT_DOUBLE_EQ(intra_bytes, 2.0 * (local - 1) / local * 4 * n);  // 1.75 buckets at L = 8
  const BucketCost leader = model.bucket(parse_option("none||hierarchical"), n);
  EXPECT_DOUBLE_EQ(leader.phases[0].bytes + leader.phases[5].bytes, 2 * 4 * n);
  // The planner's model prices it below the leader route where the inter link is the limit.
  EXPECT_LT(b.exchange_s(), leader.exchange_s());
}

TEST(Routes, BucketTimesAreTheSums) {
  const CostModel model(cluster(32, 8), costs());
  for (const char* text : {"none", "fp16|ef", "topk:ratio=0.01|ef", "signsgd||twoway",
                           "powersgd:rank=4", "qsgd||hierarchical:inner=twoway,intra=fp16",
                           "qsgd||sharded:inner=twoway,intra=fp16"}) {
    const Option o = parse_option(text);
    const BucketCost b = model.bucket(o, 123457);
    const BucketTimes t = model.bucket_times(o, 123457);
    EXPECT_DOUBLE_EQ(t.encode_s, b.encode_s) << text;
    EXPECT_DOUBLE_EQ(t.exchange_s, b.exchange_s()) << text;
    EXPECT_DOUBLE_EQ(t.decode_s, b.decode_s) << text;
    EXPECT_DOUBLE_EQ(t.bytes, b.bytes_sent()) << text;
  }
}

TEST(Routes, OptionsARouteCannotCarryAreErrors) {
  const CostModel model(cluster(8, 1), costs());
  Option topk = parse_option("topk:ratio=0.01");
  topk.route = "allreduce";
  EXPECT_TRUE(contains(error_text([&] { model.bucket(topk, 1000); }), "is not summable"));
  Option zip;
  zip.codec = "zip";
  EXPECT_TRUE(contains(error_text([&] { model.bucket(zip, 1000); }), "unknown codec 'zip'"));
  CodecCosts only_none;
  only_none.set("none", {});
  const CostModel sparse(cluster(8, 1), only_none);
  EXPECT_TRUE(contains(error_text([&] { sparse.bucket(parse_option("fp16"), 1000); }),
                       "no entry for codec 'fp16'; entries: none"));
  EXPECT_NO_THROW(sparse.bucket({}, 1000));
}

// ---- codec costs

TEST(CodecCosts, JsonRoundTripAndFieldErrors) {
  const CodecCosts c = costs();
  const CodecCosts back = CodecCosts::from_json(c.to_json());
  EXPECT_EQ(back.of("topk"), c.of("topk"));
  EXPECT_EQ(back.of("none"), c.of("none"));
  // Wrapped with its source; encode_ef defaults to encode.
  const CodecCosts w = CodecCosts::from_json(json::parse(
      R"({"source": "hand", "codecs": {"x": {"encode": {"a": 1, "b": 2}, "decode": {"a": 3, "b": 4}}}})"));
  EXPECT_EQ(w.of("x").encode_ef, (Linear{1, 2}));
  const auto error = [](const char* text) {
    return error_text([&] { CodecCosts::from_json(json::parse(text)); });
  };
  EXPECT_TRUE(contains(error(R"({"topk": {"encode": {"a": 1}, "decode": {"a": 0, "b": 0}}})"),
                       "topk.encode.b: missing"));
  EXPECT_TRUE(contains(error(R"({"topk": {"encode": {"a": -1, "b": 0}, "decode": {"a": 0, "b": 0}}})"),
                       "topk.encode.a"));
  EXPECT_TRUE(contains(error(R"({"topk": {"encode": {"a": 0, "b": 0}}})"), "topk.decode: missing"));
  // Finite but absurd: an hour per call or per element is the most the model accepts.
  EXPECT_TRUE(contains(error(R"({"topk": {"encode": {"a": 0, "b": 1e308}, "decode": {"a": 0, "b": 0}}})"),
                       "codec costs: topk.encode.b: 1e+308 is not allowed; expected a number of "
                       "seconds in 0 .. 3600"));
  EXPECT_TRUE(contains(error_text([&] { c.of("zip"); }), "no entry for codec 'zip'"));
}

TEST(CodecCosts, ScaledMultipliesEverything) {
  const CodecCosts c = costs().scaled(2);
  EXPECT_DOUBLE_EQ(c.of("topk").decode.b, 6e-9);
  EXPECT_DOUBLE_EQ(c.of("topk").encode_ef.a, 4e-6);
}

// A bench report as `gradcomp bench codecs --json` writes it, from exact a + b n costs.
json synthetic_bench(Linear encode, Linear encode_ef, Linear decode) {
  json results = json::array();
  const auto gbps = [](Linear l, double n) { return 4 * n / l.at(n) / 1e9; };
  for (int log2n = 16; log2n <= 24; log2n += 2) {
    const double n = std::ldexp(1.0, log2n);
    results.push_back({{"codec", "topk"}, {"spec", "topk:ratio=0.01"}, {"elements", n},
                       {"encode_gbps", gbps(encode, n)}, {"encode_ef_gbps", gbps(encode_ef, n)},
                       {"decode_gbps", gbps(decode, n)}});
    // A second spec of the same codec, listed later, is not mixed in: it gets its own entry.
    results.push_back({{"codec", "topk"}, {"spec", "topk:ratio=0.1"}, {"elements", n},
                       {"encode_gbps", 1.0}, {"encode_ef_gbps", 1.0}, {"decode_gbps", 1.0}});
  }
  return {{"command", "gradcomp bench codecs"}, {"results", results}};
}

TEST(CodecCosts, FitBenchRecoversAAndB) {
  const Linear encode{20e-6, 0.3e-9}, encode_ef{35e-6, 0.5e-9}, decode{4e-6, 0.05e-9};
  const CodecCosts fitted = CodecCosts::fit_bench(synthetic_bench(encode, encode_ef, decode));
  const CodecCost& c = fitted.of("topk");
  EXPECT_NEAR(c.encode.a, encode.a, 1e-6 * encode.a);
  EXPECT_NEAR(c.encode.b, encode.b, 1e-6 * encode.b);
  EXPECT_NEAR(c.encode_ef.a, encode_ef.a, 1e-6 * encode_ef.a);
  EXPECT_NEAR(c.encode_ef.b, encode_ef.b, 1e-6 * encode_ef.b);
  EXPECT_NEAR(c.decode.a, decode.a, 1e-6 * decode.a);
  EXPECT_NEAR(c.decode.b, decode.b, 1e-6 * decode.b);
}

// Each spec measured prices that spec: PowerSGD rank 4 costs more than rank 1, and a model
// given both must not price one with the other's costs. A spec not measured takes its codec
// name's entry, the first spec listed.
TEST(CodecCosts, EachSpecMeasuredIsPricedOnItsOwn) {
  const Linear encode{20e-6, 0.3e-9}, encode_ef{35e-6, 0.5e-9}, decode{4e-6, 0.05e-9};
  const CodecCosts fitted = CodecCosts::fit_bench(synthetic_bench(encode, encode_ef, decode));
  const auto first = make_codec("topk:ratio=0.01");
  const auto second = make_codec("topk:ratio=0.1");
  const auto unmeasured = make_codec("topk:ratio=0.5");
  EXPECT_NEAR(fitted.of(*first).encode.b, encode.b, 1e-6 * encode.b);
  // 1 GB/s at every size: 4 ns per element, no fixed cost.
  EXPECT_NEAR(fitted.of(*second).encode.b, 4e-9, 1e-12);
  EXPECT_NEAR(fitted.of(*second).decode.a, 0, 1e-12);
  EXPECT_EQ(fitted.of(*unmeasured).encode.b, fitted.of("topk").encode.b);
  EXPECT_EQ(fitted.of("topk").encode.b, fitted.of(*first).encode.b);
  // Saved and read again, the entries by spec stay.
  const CodecCosts again = CodecCosts::from_json(fitted.to_json());
  EXPECT_EQ(again.of(*second).encode.b, fitted.of(*second).encode.b);
  EXPECT_TRUE(
      contains(error_text([&] { fitted.of(*make_codec("qsgd")); }), "no entry for codec 'qsgd'"));
}

TEST(CodecCosts, FitNeverGivesNegativeCosts) {
  // Small sizes cheaper per element than large ones (caches): the intercept would be negative.
  json bench = {{"results", json::array()}};
  for (double n : {1e4, 1e5, 1e6, 1e7}) {
    const double seconds = n < 1e6 ? 0.1e-9 * n : 0.2e-9 * n;
    const double gbps = 4 * n / seconds / 1e9;
    bench["results"].push_back({{"codec", "x"}, {"elements", n}, {"encode_gbps", gbps},
                                {"encode_ef_gbps", gbps}, {"decode_gbps", gbps}});
  }
  const CodecCost c = CodecCosts::fit_bench(bench).of("x");
  EXPECT_EQ(c.encode.a, 0);
  EXPECT_GT(c.encode.b, 0);
  EXPECT_TRUE(contains(error_text([] { CodecCosts::fit_bench(json::object()); }), "\"results\""));
}

// Found by codec_costs_fuzz (a long run): a "spec" that is not a string escaped as nlohmann's
// type_error instead of a gradcomp::Error naming the row.
TEST(CodecCosts, FitBenchRefusesASpecThatIsNotAString) {
  const json bench = {{"results", {{{"codec", "x"}, {"spec", 7}, {"elements", 1e6},
                                    {"encode_gbps", 1.0}, {"encode_ef_gbps", 1.0},
                                    {"decode_gbps", 1.0}}}}};
  const std::string text = error_text([&] { CodecCosts::fit_bench(bench); });
  EXPECT_TRUE(contains(text, "results[0]")) << text;
  EXPECT_TRUE(contains(text, "\"spec\" must be a string")) << text;
}

// Points GRADCOMP_PROFILES somewhere for one test, then restores it.
class CostsProfilesDir {
 public:
  explicit CostsProfilesDir(const std::string& dir) {
    if (const char* old = std::getenv("GRADCOMP_PROFILES")) old_ = old;
    setenv("GRADCOMP_PROFILES", dir.c_str(), 1);
  }
  ~CostsProfilesDir() {
    if (old_.empty()) unsetenv("GRADCOMP_PROFILES");
    else setenv("GRADCOMP_PROFILES", old_.c_str(), 1);
  }

 private:
  std::string old_;
};

TEST(CodecCosts, ShippedCoversEveryCodec) {
  const CodecCosts shipped = CodecCosts::shipped();
  for (const auto& name : codec_names()) {
    const CodecCost& c = shipped.of(name);
    EXPECT_GT(c.encode.b + c.encode.a, 0) << name;
    EXPECT_GT(c.decode.b + c.decode.a, 0) << name;
  }
}

TEST(CodecCosts, ShippedHonoursGradcompProfiles) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("gradcomp_cost_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "codec-costs.json") << costs().to_json().dump();
  {
    CostsProfilesDir env(dir.string());
    EXPECT_EQ(CodecCosts::shipped().of("topk"), costs().of("topk"));
  }
  {
    CostsProfilesDir env((dir / "nowhere").string());
    EXPECT_TRUE(contains(error_text([] { CodecCosts::shipped(); }), "GRADCOMP_PROFILES"));
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace gradcomp::model
