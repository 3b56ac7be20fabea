// What the model commands (utility, simulate, costs, plan) share: the cluster flags, codec
// lists, codec costs, and output helpers.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gradcomp/model/cluster.h"
#include "gradcomp/model/cost_model.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace gradcomp::tools {

// "fp16,powersgd:rank=4,cols=8,topk:ratio=0.01" -> {"fp16", "powersgd:rank=4,cols=8",
// "topk:ratio=0.01"}: a piece with '=' but no ':' continues the parameters of the spec before
// it (a codec name never holds '='); ';' separates too. An empty item is an Error naming --codecs.
std::vector<std::string> split_specs(const std::vector<std::string>& texts);

// The cluster flags: --cluster FILE, --per-node, --inter, --intra, --inter-latency,
// --intra-latency, --servers. Flags given on the command line override the file's values.
class ClusterFlags {
 public:
  void add_to(CLI::App& command);
  // The cluster, with `workers` workers when given (else the file's, else 1).
  model::Cluster cluster(std::optional<int> workers = std::nullopt) const;
  bool has_file() const { return !file_.empty(); }

 private:
  std::string file_;
  int per_node_ = 1;
  std::string inter_ = "25gbit", intra_ = "100gbit";
  std::string inter_latency_ = "10us", intra_latency_ = "5us";
  CLI::Option* per_node_flag_ = nullptr;
  CLI::Option* inter_flag_ = nullptr;
  CLI::Option* intra_flag_ = nullptr;
  CLI::Option* inter_latency_flag_ = nullptr;
  CLI::Option* intra_latency_flag_ = nullptr;
  int servers_ = 0;
  CLI::Option* servers_flag_ = nullptr;
};

// --costs FILE (a codec-costs JSON; default: the shipped profiles/codec-costs.json) and
// --cost-scale X (a device X times slower than the one measured).
struct CostFlags {
  std::string file;
  double scale = 1;
  void add_to(CLI::App& command);
  model::CodecCosts load() const;
};

// --bucket-mb: 1 byte (one tensor per bucket) .. 1 TiB, so the size in bytes is representable.
inline constexpr double kMinBucketMb = 1.0 / (1 << 20), kMaxBucketMb = 1 << 20;

// Sets the bandwidth a sweep varies, as crossover_bandwidth does: the inter-node link, and the
// intra-node link too when all workers share one node (the flat ring runs on it then).
void set_network_bandwidth(model::Cluster& cluster, double bytes_per_s);

void write_json_file(const std::string& path, const nlohmann::json& doc);
std::string format_ms(double seconds);  // "143.7 ms"
std::string format_bytes(double bytes);  // "102.2 MB"

}  // namespace gradcomp::tools
