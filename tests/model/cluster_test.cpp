#include "gradcomp/model/cluster.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp::model {
namespace {

using testing::contains;

using nlohmann::json;
using testing::error_text;

json good_json() {
  return json::parse(R"({"workers": 64, "per_node": 8,
                         "inter": {"bandwidth": "25gbit", "latency": "10us"},
                         "intra": {"bandwidth": "100gbit", "latency": "5us"}})");
}

std::string cluster_error(const json& j) {
  return error_text([&] { Cluster::from_json(j); });
}

TEST(ParseRate, BitsAndBytesPerSecond) {
  EXPECT_DOUBLE_EQ(parse_rate("25gbit"), 25e9 / 8);
  EXPECT_DOUBLE_EQ(parse_rate("100mbit"), 100e6 / 8);
  EXPECT_DOUBLE_EQ(parse_rate("1.5gbit"), 1.5e9 / 8);
  EXPECT_DOUBLE_EQ(parse_rate("10gbps"), 10e9 / 8);
  EXPECT_DOUBLE_EQ(parse_rate("25Gbit/s"), 25e9 / 8);
  EXPECT_DOUBLE_EQ(parse_rate("3GB/s"), 3e9);
  EXPECT_DOUBLE_EQ(parse_rate("500 MB/s"), 500e6);
}

TEST(ParseRate, ErrorsSayWhatIsAllowed) {
  EXPECT_TRUE(contains(error_text([] { parse_rate("25"); }), "has no unit"));
  EXPECT_TRUE(contains(error_text([] { parse_rate("25furlongs"); }), "unknown unit 'furlongs'"));
  EXPECT_TRUE(contains(error_text([] { parse_rate("fast"); }), "not a number"));
  EXPECT_TRUE(contains(error_text([] { parse_rate("-1gbit"); }), "negative"));
  EXPECT_TRUE(contains(error_text([] { parse_rate("25"); }), "25gbit"));  // the allowed forms
}

TEST(ParseDuration, Units) {
  EXPECT_DOUBLE_EQ(parse_duration("10us"), 10e-6);
  EXPECT_DOUBLE_EQ(parse_duration("1.5ms"), 1.5e-3);
  EXPECT_DOUBLE_EQ(parse_duration("100ns"), 100e-9);
  EXPECT_DOUBLE_EQ(parse_duration("2s"), 2.0);
  EXPECT_EQ(parse_duration("0"), 0.0);
  EXPECT_TRUE(contains(error_text([] { parse_duration("10"); }), "has no unit"));
  EXPECT_TRUE(contains(error_text([] { parse_duration("10parsecs"); }), "unknown unit"));
  EXPECT_TRUE(contains(error_text([] { parse_duration("-5us"); }), "negative"));
}

TEST(FormatRate, ReadableUnits) {
  EXPECT_EQ(format_rate(25e9 / 8), "25 Gbit/s");
  EXPECT_EQ(format_rate(100e6 / 8), "100 Mbit/s");
  EXPECT_EQ(format_rate(1.5e9 / 8), "1.5 Gbit/s");
}

TEST(Cluster, FromJson) {
  const Cluster c = Cluster::from_json(good_json());
  EXPECT_EQ(c.workers, 64);
  EXPECT_EQ(c.per_node, 8);
  EXPECT_EQ(c.nodes(), 8);
  EXPECT_DOUBLE_EQ(c.inter.bytes_per_s, 25e9 / 8);
  EXPECT_DOUBLE_EQ(c.inter.latency_s, 10e-6);
  EXPECT_DOUBLE_EQ(c.intra.bytes_per_s, 100e9 / 8);
  EXPECT_DOUBLE_EQ(c.intra.latency_s, 5e-6);
}

TEST(Cluster, ServersDefaultToTheWorkersAndRoundTrip) {
  json j = good_json();
  EXPECT_EQ(Cluster::from_json(j).servers, 0);
  EXPECT_EQ(Cluster::from_json(j).server_count(), 64);
  j["servers"] = 16;
  const Cluster c = Cluster::from_json(j);
  EXPECT_EQ(c.server_count(), 16);
  EXPECT_EQ(Cluster::from_json(c.to_json()), c);
  j["servers"] = 0;
  EXPECT_TRUE(contains(cluster_error(j), "servers"));
}

TEST(Cluster, NumbersAreBaseUnitsAndRoundTrip) {
  const Cluster c = Cluster::from_json(good_json());
  EXPECT_EQ(Cluster::from_json(c.to_json()), c);
  const Cluster d = Cluster::from_json(
      json::parse(R"({"workers": 4, "inter": {"bandwidth": 1e9, "latency": 2e-6}})"));
  EXPECT_EQ(d.per_node, 1);
  EXPECT_DOUBLE_EQ(d.inter.bytes_per_s, 1e9);
  EXPECT_DOUBLE_EQ(d.inter.latency_s, 2e-6);
}

TEST(Cluster, BadClustersNameTheField) {
  json j = good_json();
  j["inter"]["bandwidth"] = 0;
  EXPECT_TRUE(contains(cluster_error(j), "inter.bandwidth"));
  EXPECT_TRUE(contains(cluster_error(j), "is out of range; allowed: 1 kbit/s .. 1 Pbit/s"));

  j = good_json();
  j["intra"]["bandwidth"] = "0gbit";
  EXPECT_TRUE(contains(cluster_error(j), "intra.bandwidth"));

  j = good_json();
  j["per_node"] = 6;  // 64 workers do not split into nodes of 6
  EXPECT_TRUE(contains(cluster_error(j), "per_node = 6 must divide workers = 64"));

  j = good_json();
  j.erase("workers");
  EXPECT_TRUE(contains(cluster_error(j), "workers: missing"));

  j = good_json();
  j["inter"].erase("latency");
  EXPECT_TRUE(contains(cluster_error(j), "inter.latency: missing"));

  j = good_json();
  j.erase("intra");  // needed: 8 workers share a node
  EXPECT_TRUE(contains(cluster_error(j), "intra: missing"));

  j = good_json();
  j["inter"]["latency"] = -1e-6;
  EXPECT_TRUE(contains(cluster_error(j), "inter.latency"));
  EXPECT_TRUE(contains(cluster_error(j), "is out of range; allowed: 0 .. 60 s"));

  j = good_json();
  j["inter"]["latency"] = "-5us";
  EXPECT_TRUE(contains(cluster_error(j), "inter.latency"));

  j = good_json();
  j["inter"]["bandwidth"] = "25furlongs";
  EXPECT_TRUE(contains(cluster_error(j), "inter.bandwidth"));
  EXPECT_TRUE(contains(cluster_error(j), "unknown unit 'furlongs'"));

  j = good_json();
  j["workers"] = 0;
  EXPECT_TRUE(contains(cluster_error(j), "workers"));

  j = good_json();
  j["worker"] = 3;
  EXPECT_TRUE(contains(cluster_error(j), "unknown field 'worker'"));
}

// Finite but absurd values once made the model print "inf ms": every rate and latency, from
// JSON, from text or set in code, is checked against the same finite range.
TEST(Cluster, AbsurdValuesAreOutOfRange) {
  json j = good_json();
  j["inter"]["latency"] = "1e308s";
  EXPECT_EQ(cluster_error(j),
            "cluster: inter.latency: duration '1e308s' = 1e+308 seconds is "
            "out of range; allowed: 0 .. 60 s");
  j["inter"]["latency"] = 1e308;
  EXPECT_EQ(cluster_error(j),
            "cluster: inter.latency = 1e+308 seconds is out of range; allowed: 0 .. 60 s");
  j = good_json();
  j["intra"]["bandwidth"] = 1e300;
  EXPECT_TRUE(contains(cluster_error(j),
                       "cluster: intra.bandwidth = 1e+300 bytes per second "
                       "is out of range; allowed: 1 kbit/s .. 1 Pbit/s"));
  j = good_json();
  j["workers"] = (1 << 20) + 8;
  EXPECT_TRUE(contains(cluster_error(j), "workers: 1048584 is out of range; allowed: 1 .. "));
  EXPECT_TRUE(contains(error_text([] { parse_rate("1e-9bit"); }), "out of range"));
  EXPECT_TRUE(contains(error_text([] { parse_duration("61s"); }), "allowed: 0 .. 60 s"));
  EXPECT_NO_THROW(parse_rate("1kbit"));
  EXPECT_NO_THROW(parse_rate("1000tbit"));
  EXPECT_NO_THROW(parse_duration("60s"));

  Cluster c;
  c.inter.latency_s = std::nan("");
  EXPECT_TRUE(contains(error_text([&] { c.validate(); }), "inter.latency_s = nan seconds"));
  c = Cluster{};
  c.workers = kMaxWorkers + 1;
  EXPECT_TRUE(contains(error_text([&] { c.validate(); }), "must be >= 1 and at most 1048576"));
}

TEST(Cluster, ValidateNamesTheStructField) {
  Cluster c;
  c.workers = 8;
  c.per_node = 8;
  EXPECT_NO_THROW(c.validate());
  c.inter.bytes_per_s = 0;
  EXPECT_TRUE(contains(error_text([&] { c.validate(); }),
                       "inter.bytes_per_s = 0 bytes per second is out of range"));
  c = Cluster{};
  c.intra.latency_s = -1;
  EXPECT_TRUE(contains(error_text([&] { c.validate(); }), "intra.latency_s"));
  c = Cluster{};
  c.workers = 0;
  EXPECT_TRUE(contains(error_text([&] { c.validate(); }), "workers = 0 must be >= 1"));
}

}  // namespace
}  // namespace gradcomp::model
