// `gradcomp utility`: the utility study's iteration-time model over workers and bandwidths:
// syncSGD (DDP) next to each compression method, serial and overlapped, the speedup, and the
// bandwidth below which each method pays.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <array>
#include <cmath>
#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/model/utility_model.h"
#include "cli_checks.h"
#include "model_commands.h"
#include "model_options.h"

namespace gradcomp::tools {
namespace {

using model::Schedule;
using model::UtilityMethod;
using nlohmann::json;

struct UtilityOptions {
  std::string profile;
  std::vector<int> workers = {8, 16, 32, 64};
  std::vector<std::string> bandwidths = {"1gbit", "2gbit", "5gbit", "10gbit", "25gbit",
                                         "40gbit", "100gbit"};
  std::vector<std::string> codecs = {"fp16,powersgd:rank=4,topk:ratio=0.01,signsgd"};
  double lambda = 1.05;
  std::string tail = "overlapped";
  double bucket_mb = 25;
  std::string json_path;
  ClusterFlags cluster;
  CostFlags costs;
  CLI::Option* workers_flag = nullptr;

  // --workers, or the cluster file's count when only the file says.
  std::vector<int> chosen_workers() const {
    if (workers_flag->count() == 0 && cluster.has_file()) return {cluster.cluster().workers};
    return workers;
  }
};

// The bandwidths crossovers are searched in: 10 Mbit/s to 1 Tbit/s.
constexpr double kLowest = 10e6 / 8, kHighest = 1e12 / 8;

struct Setup {
  model::Profile profile;
  double bytes = 0;
  model::UtilitySettings settings;
  std::vector<std::string> specs;
  std::vector<double> bandwidths;
  model::CodecCosts costs;
};

const char* schedule_name(Schedule s) { return s == Schedule::kSerial ? "serial" : "overlapped"; }

std::string crossover_text(double bw) {
  if (bw == 0) return "never pays";
  if (bw >= kHighest) return fmt::format("pays at every bandwidth up to {}", model::format_rate(kHighest));
  return fmt::format("pays below {}", model::format_rate(bw));
}

using Methods = std::vector<std::array<UtilityMethod, 2>>;  // per spec: serial, overlapped

void print_header(const Setup& s, const model::Cluster& cluster) {
  fmt::print("\n{} workers, {} per node: iteration (backward + exchange), speedup over syncSGD\n",
             cluster.workers, cluster.per_node);
  fmt::print("{:>12} {:>10}", "bandwidth", "syncSGD");
  for (const auto& spec : s.specs) fmt::print(" | {:>24}", spec.substr(0, 24));
  fmt::print("\n{:>12} {:>10}", "", "ms");
  for (size_t i = 0; i < s.specs.size(); ++i) fmt::print(" | {:>7} {:>7} {:>8}", "serial", "overl.", "best");
  fmt::print("\n");
}

// One bandwidth: a line of the table, and a JSON row per method and schedule.
void print_bandwidth(const Setup& s, const model::Cluster& cluster, const UtilityMethod& sync,
                     const Methods& methods, json& out) {
  const auto time = [&](const UtilityMethod& m) {
    return model::utility_iteration_time(s.bytes, s.profile.backward_s, cluster, m, s.settings);
  };
  const double bw = cluster.inter.bytes_per_s, base = time(sync);
  fmt::print("{:>12} {:>10.1f}", model::format_rate(bw), base * 1e3);
  for (size_t i = 0; i < methods.size(); ++i) {
    const double serial = time(methods[i][0]), overlapped = time(methods[i][1]);
    fmt::print(" | {:>7.1f} {:>7.1f} {:>7.2f}x", serial * 1e3, overlapped * 1e3,
               base / std::min(serial, overlapped));
    for (const UtilityMethod& m : methods[i]) {
      out["rows"].push_back({{"workers", cluster.workers}, {"per_node", cluster.per_node},
                             {"bandwidth_bytes_per_s", bw}, {"bandwidth_gbit", bw * 8 / 1e9},
                             {"method", s.specs[i]}, {"schedule", schedule_name(m.schedule)},
                             {"iteration_s", time(m)}, {"sync_s", base}, {"speedup", base / time(m)}});
    }
  }
  fmt::print("\n");
}

void print_crossovers(const Setup& s, const model::Cluster& cluster, const UtilityMethod& sync,
                      const Methods& methods, json& out) {
  for (size_t i = 0; i < methods.size(); ++i) {
    for (const UtilityMethod& m : methods[i]) {
      const double bw = model::crossover_bandwidth(s.bytes, s.profile.backward_s, cluster, m, sync,
                                                   kLowest, kHighest, s.settings);
      fmt::print("  {:<28} {:<10} {}\n", s.specs[i], schedule_name(m.schedule), crossover_text(bw));
      out["crossovers"].push_back({{"workers", cluster.workers}, {"method", s.specs[i]},
                                   {"schedule", schedule_name(m.schedule)},
                                   {"bandwidth_bytes_per_s", bw}, {"bandwidth_gbit", bw * 8 / 1e9}});
    }
  }
}

// One workers count: the table of times over bandwidths, then each method's crossover.
void run_workers(const UtilityOptions& o, const Setup& s, int workers, json& out) {
  model::Cluster cluster = o.cluster.cluster(workers);
  const double elements = static_cast<double>(s.profile.total_elements());
  UtilityMethod sync;
  sync.lambda = o.lambda;
  Methods methods;
  for (const auto& spec : s.specs) {
    methods.push_back({model::utility_method(spec, elements, s.costs, Schedule::kSerial, o.lambda),
                       model::utility_method(spec, elements, s.costs, Schedule::kOverlapped, o.lambda)});
  }
  print_header(s, cluster);
  for (double bw : s.bandwidths) {
    set_network_bandwidth(cluster, bw);
    print_bandwidth(s, cluster, sync, methods, out);
  }
  print_crossovers(s, cluster, sync, methods, out);
}

Setup make_setup(const UtilityOptions& o) {
  Setup s;
  s.profile = model::load_profile(o.profile);
  s.bytes = 4.0 * static_cast<double>(s.profile.total_elements());
  s.settings.bucket_bytes = o.bucket_mb * (1 << 20);
  s.settings.tail = o.tail == "strict" ? model::TailForm::kStrict : model::TailForm::kOverlapped;
  s.specs = split_specs(o.codecs);
  for (const auto& text : o.bandwidths) {
    try {
      s.bandwidths.push_back(model::parse_rate(text));
    } catch (const Error& e) {
      throw Error(fmt::format("--bandwidths: {}", e.what()));
    }
  }
  s.costs = o.costs.load();
  return s;
}

int run_utility(const UtilityOptions& o) {
  const Setup s = make_setup(o);
  fmt::print("{}: {:.2f} M parameters ({}), backward {} on one worker; lambda {}, tail {}, "
             "{} MiB buckets\n",
             s.profile.model, s.profile.total_elements() / 1e6, format_bytes(s.bytes),
             format_ms(s.profile.backward_s), o.lambda, o.tail, o.bucket_mb);
  json out = {{"command", "gradcomp utility"}, {"profile", s.profile.model},
              {"gradient_bytes", s.bytes}, {"backward_s", s.profile.backward_s},
              {"lambda", o.lambda}, {"tail", o.tail}, {"bucket_bytes", s.settings.bucket_bytes},
              {"rows", json::array()}, {"crossovers", json::array()}};
  for (int w : o.chosen_workers()) run_workers(o, s, w, out);
  if (!o.json_path.empty()) {
    write_json_file(o.json_path, out);
    fmt::print("\nwrote {}\n", o.json_path);
  }
  return 0;
}

}  // namespace

void add_utility_command(CLI::App& app, int& exit_code) {
  static UtilityOptions o;
  auto* cmd = app.add_subcommand(
      "utility", "The iteration-time model of 'On the Utility of Gradient Compression' (MLSys "
                 "2022): syncSGD against compression methods over workers and bandwidths, and "
                 "the bandwidth below which each method pays");
  cmd->add_option("--profile", o.profile, "Model profile: a shipped name (resnet50) or a JSON path")
      ->required();
  o.workers_flag = add_list_option(*cmd, "--workers", o.workers,
                                   "Worker counts (default 8,16,32,64, or the cluster file's)",
                                   ',', CLI::Range(1, model::kMaxWorkers));
  add_list_option(*cmd, "--bandwidths", o.bandwidths,
                  "Network bandwidths per node (default 1gbit,2gbit,5gbit,10gbit,25gbit,40gbit,"
                  "100gbit)",
                  ',');
  cmd->add_option("--codecs", o.codecs,
                  "Methods: codec specs, or codec|feedback|route with route allreduce or "
                  "allgather (default fp16,powersgd:rank=4,topk:ratio=0.01,signsgd)");
  cmd->add_option("--lambda", o.lambda, "Compute slow-down while communicating (default 1.05)")
      ->check(finite_range(1, 10));
  cmd->add_option("--tail", o.tail, "overlapped (the paper's form) or strict (the last bucket "
                                    "waits for backward)")
      ->check(CLI::IsMember({"overlapped", "strict"}));
  cmd->add_option("--bucket-mb", o.bucket_mb, "DDP bucket cap in MiB (default 25)")
      ->check(finite_range(kMinBucketMb, kMaxBucketMb));
  cmd->add_option("--json", o.json_path, "Also write the results as JSON to this file");
  o.cluster.add_to(*cmd);
  o.costs.add_to(*cmd);
  cmd->callback([&exit_code] { exit_code = run_utility(o); });
}

}  // namespace gradcomp::tools
