#include "model_options.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <nlohmann/json.hpp>

#include "gradcomp/json_text.h"
#include "cli_checks.h"
#include "gradcomp/error.h"

namespace gradcomp::tools {

std::vector<std::string> split_specs(const std::vector<std::string>& texts) {
  std::vector<std::string> specs;
  for (const std::string& text : texts) {
    size_t begin = 0;
    while (begin <= text.size()) {
      const size_t end = std::min(text.find_first_of(",;", begin), text.size());
      const std::string piece = text.substr(begin, end - begin);
      const bool continues = piece.find('=') != std::string::npos &&
                             piece.find(':') == std::string::npos && !specs.empty() &&
                             text[begin - 1] == ',';
      if (piece.empty()) {
        // "--codecs ','" is a mistake, not a request for the default list.
        throw Error(fmt::format("--codecs: '{}' has an empty item; give specs separated by ',' "
                                "or ';', such as 'fp16,topk:ratio=0.01'",
                                text));
      }
      if (continues) {
        specs.back() += "," + piece;
      } else {
        specs.push_back(piece);
      }
      begin = end + 1;
    }
  }
  return specs;
}

void ClusterFlags::add_to(CLI::App& command) {
  command.add_option("--cluster", file_,
                     "Cluster JSON: {\"workers\": 64, \"per_node\": 8, \"inter\": {\"bandwidth\": "
                     "\"25gbit\", \"latency\": \"10us\"}, \"intra\": {...}}; flags override it")
      ->check(CLI::ExistingFile);
  per_node_flag_ = command.add_option("--per-node", per_node_, "Workers per node (default 1)")
                       ->check(CLI::Range(1, model::kMaxWorkers));
  inter_flag_ = command.add_option("--inter", inter_,
                                   "Inter-node bandwidth per node: 25gbit, 100mbit, 3GB/s (default "
                                   "25gbit)");
  intra_flag_ = command.add_option("--intra", intra_, "Intra-node bandwidth (default 100gbit)");
  inter_latency_flag_ = command.add_option("--inter-latency", inter_latency_,
                                           "Inter-node latency per message (default 10us)");
  intra_latency_flag_ = command.add_option("--intra-latency", intra_latency_,
                                           "Intra-node latency per message (default 5us)");
  servers_flag_ = command
                      .add_option("--servers", servers_,
                                  "Dedicated parameter servers of the job (route servers; "
                                  "default 0: none, the route is not offered)")
                      ->check(CLI::Range(0, model::kMaxWorkers));
}

model::Cluster ClusterFlags::cluster(std::optional<int> workers) const {
  model::Cluster c;
  if (!file_.empty()) {
    const nlohmann::json root = read_json_file(file_, "cluster file");
    c = with_context(fmt::format("cluster file '{}'", file_),
                     [&] { return model::Cluster::from_json(root); });
  }
  // Without a file the flags' defaults apply; with one, only the flags given.
  const auto use = [&](const CLI::Option* flag) { return file_.empty() || flag->count() > 0; };
  const auto rate = [](const std::string& text, const char* flag) {
    try {
      return model::parse_rate(text);
    } catch (const Error& e) {
      throw Error(fmt::format("{}: {}", flag, e.what()));
    }
  };
  const auto duration = [](const std::string& text, const char* flag) {
    try {
      return model::parse_duration(text);
    } catch (const Error& e) {
      throw Error(fmt::format("{}: {}", flag, e.what()));
    }
  };
  if (use(per_node_flag_)) c.per_node = per_node_;
  if (use(inter_flag_)) c.inter.bytes_per_s = rate(inter_, "--inter");
  if (use(intra_flag_)) c.intra.bytes_per_s = rate(intra_, "--intra");
  if (use(inter_latency_flag_)) c.inter.latency_s = duration(inter_latency_, "--inter-latency");
  if (use(intra_latency_flag_)) c.intra.latency_s = duration(intra_latency_, "--intra-latency");
  if (use(servers_flag_)) c.servers = servers_;
  if (workers) c.workers = *workers;
  c.validate();
  return c;
}

void CostFlags::add_to(CLI::App& command) {
  command.add_option("--costs", file,
                     "Codec costs JSON (default: the shipped profiles/codec-costs.json, measured "
                     "on this project's machine; make one with `gradcomp costs --fit`)")
      ->check(CLI::ExistingFile);
  command.add_option("--cost-scale", scale,
                     "Multiply every codec cost by this (a device this many times slower)")
      ->check(finite_range(1e-6, 1e6));
}

model::CodecCosts CostFlags::load() const {
  model::CodecCosts costs;
  if (file.empty()) {
    costs = model::CodecCosts::shipped();
  } else {
    const nlohmann::json root = read_json_file(file, "codec costs file");
    costs = with_context(fmt::format("codec costs file '{}'", file),
                         [&] { return model::CodecCosts::from_json(root); });
  }
  return scale == 1 ? costs : costs.scaled(scale);
}

void set_network_bandwidth(model::Cluster& cluster, double bytes_per_s) {
  cluster.inter.bytes_per_s = bytes_per_s;
  if (cluster.nodes() == 1) cluster.intra.bytes_per_s = bytes_per_s;
}

void write_json_file(const std::string& path, const nlohmann::json& doc) {
  std::ofstream out(path);
  if (!out) throw Error(fmt::format("cannot write '{}'", path));
  out << doc.dump(2) << '\n';
  if (!out) throw Error(fmt::format("error writing '{}'", path));
}

std::string format_ms(double seconds) { return fmt::format("{:.1f} ms", seconds * 1e3); }

std::string format_bytes(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.2f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  if (bytes >= 1e3) return fmt::format("{:.1f} kB", bytes / 1e3);
  return fmt::format("{:.0f} B", bytes);
}

}  // namespace gradcomp::tools
