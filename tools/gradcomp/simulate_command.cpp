// `gradcomp simulate`: the simulated step of a plan file, or of the default plan with each
// codec, on a profile and a cluster: iteration time and where it goes, a Chrome trace, and
// sweeps over bandwidth and workers written as JSON rows (scripts/plot_simulation.py plots them).
// With --correction (the auto scheduler's fitted model::Correction), the corrected model: what
// auto predicted when it chose.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "gradcomp/json_text.h"
#include "gradcomp/model/correction.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/model/simulator.h"
#include "cli_checks.h"
#include "model_commands.h"
#include "model_options.h"

namespace gradcomp::tools {
namespace {

using nlohmann::json;

struct SimulateOptions {
  std::string profile;
  std::string plan_path;
  std::vector<std::string> codecs;
  int workers = 8;
  std::vector<int> sweep_workers;
  std::vector<std::string> sweep_bandwidth;
  double lambda = 1.05;
  double bucket_mb = 25;
  size_t min_compress = 16384;
  std::string encode_on = "engine";
  std::string trace_path;
  std::string json_path;
  std::string correction_path;
  ClusterFlags cluster;
  CostFlags costs;
  CLI::Option* workers_flag = nullptr;
  model::Correction correction;  // read from correction_path in run_simulate

  // --workers, or the cluster file's when only the file says.
  std::optional<int> chosen_workers() const {
    if (workers_flag->count() == 0 && cluster.has_file()) return std::nullopt;
    return workers;
  }
  // The cluster of `workers` (chosen_workers() when absent), with the correction's link.
  model::Cluster corrected_cluster(std::optional<int> w) const {
    return correction.applied(cluster.cluster(w));
  }
  // --lambda, or the correction's slow-down of this plan (its codecs' own).
  model::SimulatorSettings simulator(const Plan& plan) const {
    if (correction_path.empty()) return {.lambda = lambda};
    return correction.simulator(plan);
  }
};

model::Correction load_correction(const std::string& path) {
  const std::string what = fmt::format("correction file '{}'", path);
  const json doc = read_json_file(path, "correction file");
  return with_context(what, [&] { return model::Correction::from_json(doc); });
}

struct NamedPlan {
  std::string name;  // the codec, or the plan file
  Plan plan;
};

std::vector<NamedPlan> make_plans(const SimulateOptions& o, const model::Profile& profile) {
  if (!o.plan_path.empty()) return {{o.plan_path, Plan::load(o.plan_path)}};
  std::vector<std::string> specs = split_specs(o.codecs);
  if (specs.empty()) specs = {"none"};
  std::vector<NamedPlan> plans;
  for (const auto& spec : specs) {
    DefaultPlanSettings settings;
    settings.bucket_bytes = static_cast<size_t>(o.bucket_mb * (1 << 20));
    settings.min_compress_elements = o.min_compress;
    settings.compressed = parse_option(spec);
    settings.compressed.encode_on = o.encode_on == "caller" ? EncodeOn::kCaller : EncodeOn::kEngine;
    plans.push_back({spec, make_default_plan(profile.tensor_infos(), settings)});
  }
  return plans;
}

json row(const model::Profile& profile, const model::Cluster& c, const std::string& plan,
         double lambda, const model::SimResult& r) {
  return {{"profile", profile.model}, {"workers", c.workers}, {"per_node", c.per_node},
          {"bandwidth_bytes_per_s", c.inter.bytes_per_s}, {"bandwidth_gbit", c.inter.bytes_per_s * 8 / 1e9},
          {"plan", plan}, {"lambda", lambda}, {"iteration_s", r.iteration_s},
          {"compute_bound_s", model::compute_bound(profile)}, {"backward_end_s", r.backward_end_s},
          {"exchange_end_s", r.exchange_end_s}, {"bytes_sent", r.bytes_sent}};
}

// Busy seconds per lane of a simulated step.
std::map<std::string, double> busy(const model::SimResult& r) {
  std::map<std::string, double> out;
  for (const model::Span& s : r.spans) {
    if (s.bucket >= 0) out[s.lane == "compute" ? "encode" : s.lane] += s.end_s - s.start_s;
  }
  return out;
}

// The slow-down of compute while communicating: one for every plan, unless a correction's codecs
// have their own (then each plan's is in its row).
std::string lambda_text(const SimulateOptions& o) {
  if (o.correction_path.empty() || o.correction.codec_lambdas.empty()) {
    return fmt::format("lambda {:g}", o.lambda);
  }
  return fmt::format("lambda {:g}, for a codec's buckets its own (the lambda column)", o.lambda);
}

void print_cluster(const SimulateOptions& o, const model::Profile& profile,
                   const model::Cluster& c) {
  fmt::print("{} on {} workers ({} per node): inter {} + {:g} us, intra {} + {:g} us; {}\n",
             profile.model, c.workers, c.per_node, model::format_rate(c.inter.bytes_per_s),
             c.inter.latency_s * 1e6, model::format_rate(c.intra.bytes_per_s),
             c.intra.latency_s * 1e6, lambda_text(o));
  fmt::print("compute bound (forward + backward, no communication): {}\n",
             format_ms(model::compute_bound(profile)));
}

// One cluster: the breakdown of every plan, and the first plan's trace.
void simulate_one(const SimulateOptions& o, const model::Profile& profile,
                  const std::vector<NamedPlan>& plans, const model::CostModel& cost, json& out) {
  print_cluster(o, profile, cost.cluster());
  fmt::print("{:<32} {:>7} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>10} {:>7}\n", "plan",
             "buckets", "iteration", "bwd end", "exposed", "encode", "exchange", "decode",
             "sent/rank", "lambda");
  for (size_t i = 0; i < plans.size(); ++i) {
    const model::SimulatorSettings settings = o.simulator(plans[i].plan);
    const auto r = model::simulate(profile, plans[i].plan, cost, settings, true);
    auto lanes = busy(r);
    fmt::print(
        "{:<32} {:>7} {:>10.1f} {:>10.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>10} {:>7.3g}\n",
        plans[i].name.substr(0, 32), plans[i].plan.buckets.size(), r.iteration_s * 1e3,
        r.backward_end_s * 1e3, (r.iteration_s - model::compute_bound(profile)) * 1e3,
        lanes["encode"] * 1e3, lanes["exchange"] * 1e3, lanes["decode"] * 1e3,
        format_bytes(r.bytes_sent), settings.lambda);
    out["rows"].push_back(row(profile, cost.cluster(), plans[i].name, settings.lambda, r));
    if (i == 0 && !o.trace_path.empty()) write_json_file(o.trace_path, r.chrome_trace());
  }
  fmt::print("(ms; encode, exchange and decode are busy time summed over buckets)\n");
  if (!o.trace_path.empty()) {
    fmt::print("wrote the trace of '{}' to {}\n", plans[0].name, o.trace_path);
  }
}

// Every workers count and bandwidth: one line each, the iteration time of every plan.
void sweep(const SimulateOptions& o, const model::Profile& profile,
           const std::vector<NamedPlan>& plans, const model::CodecCosts& costs, json& out) {
  const model::Cluster base = o.corrected_cluster(o.chosen_workers());
  const std::vector<int> workers =
      o.sweep_workers.empty() ? std::vector<int>{base.workers} : o.sweep_workers;
  std::vector<double> bandwidths;
  for (const auto& text : o.sweep_bandwidth) {
    try {
      bandwidths.push_back(model::parse_rate(text));
    } catch (const Error& e) {
      throw Error(fmt::format("--sweep-bandwidth: {}", e.what()));
    }
  }
  if (bandwidths.empty()) bandwidths.push_back(base.inter.bytes_per_s);
  fmt::print("{}: iteration time (ms); compute bound {}\n{:>8} {:>14}", profile.model,
             format_ms(model::compute_bound(profile)), "workers", "bandwidth");
  for (const auto& p : plans) fmt::print(" {:>14}", p.name.substr(0, 14));
  fmt::print("\n");
  for (int w : workers) {
    for (double bw : bandwidths) {
      model::Cluster c = o.corrected_cluster(w);
      set_network_bandwidth(c, bw);
      const model::CostModel cost(c, costs);
      fmt::print("{:>8} {:>14}", w, model::format_rate(bw));
      for (const auto& p : plans) {
        const model::SimulatorSettings settings = o.simulator(p.plan);
        const auto r = model::simulate(profile, p.plan, cost, settings);
        fmt::print(" {:>14.1f}", r.iteration_s * 1e3);
        out["rows"].push_back(row(profile, c, p.name, settings.lambda, r));
      }
      fmt::print("\n");
    }
  }
}

int run_simulate(SimulateOptions& o) {
  if (!o.plan_path.empty() && !o.codecs.empty()) {
    throw Error("simulate: give either --plan FILE or --codecs, not both");
  }
  if (!o.correction_path.empty()) {
    o.correction = load_correction(o.correction_path);
    o.lambda = o.correction.lambda;
  }
  // The plans come from the measured profile; the overhead is time the step spends outside it.
  const model::Profile measured = model::load_profile(o.profile);
  const std::vector<NamedPlan> plans = make_plans(o, measured);
  const model::Profile profile = o.correction.applied(measured);
  const model::CodecCosts costs = o.correction.applied(o.costs.load());
  json out = {{"command", "gradcomp simulate"}, {"profile", profile.model},
              {"lambda", o.lambda}, {"rows", json::array()}};
  if (!o.correction_path.empty()) {
    out["correction"] = o.correction.to_json();
    fmt::print("corrected by {}: {}\n", o.correction_path, o.correction.summary());
  }
  if (o.sweep_workers.empty() && o.sweep_bandwidth.empty()) {
    simulate_one(o, profile, plans, model::CostModel(o.corrected_cluster(o.chosen_workers()), costs),
                 out);
  } else {
    sweep(o, profile, plans, costs, out);
  }
  if (!o.json_path.empty()) {
    write_json_file(o.json_path, out);
    fmt::print("wrote {}\n", o.json_path);
  }
  return 0;
}

}  // namespace

void add_simulate_command(CLI::App& app, int& exit_code) {
  static SimulateOptions o;
  auto* cmd = app.add_subcommand(
      "simulate", "Simulate one training step of a plan (or of the default plan with each codec) "
                  "on a model profile and a cluster: iteration time, breakdown, Chrome trace, "
                  "sweeps over bandwidth and workers");
  cmd->add_option("--profile", o.profile, "Model profile: a shipped name (resnet50) or a JSON path")
      ->required();
  auto* plan = cmd->add_option("--plan", o.plan_path, "A plan JSON file (docs/plan-format.md)")
                   ->check(CLI::ExistingFile);
  cmd->add_option("--codecs", o.codecs,
                  "Default plans, one per option 'codec[|feedback[|route]]' (default none)")
      ->excludes(plan);
  o.workers_flag = cmd->add_option("--workers", o.workers, "Workers (default 8, or the cluster file's)")
                       ->check(CLI::Range(1, model::kMaxWorkers));
  add_list_option(*cmd, "--sweep-workers", o.sweep_workers, "Worker counts to sweep", ',',
                  CLI::Range(1, model::kMaxWorkers));
  add_list_option(*cmd, "--sweep-bandwidth", o.sweep_bandwidth,
                  "Network bandwidths to sweep (the inter-node link; all links on one node)", ',');
  auto* lambda =
      cmd->add_option("--lambda", o.lambda, "Compute slow-down while communicating (default 1.05)")
          ->check(finite_range(1, model::kMaxLambda));
  cmd->add_option("--correction", o.correction_path,
                  "The auto scheduler's fitted correction (correction.json from "
                  "write_auto_calibration, or a decision's model_correction): extra latency, "
                  "compute slow-down (replaces --lambda), codec cost scale, step overhead")
      ->check(CLI::ExistingFile)
      ->excludes(lambda);
  cmd->add_option("--bucket-mb", o.bucket_mb, "Default plan: bucket size in MiB (default 25)")
      ->check(finite_range(kMinBucketMb, kMaxBucketMb));
  cmd->add_option("--min-compress", o.min_compress,
                  "Default plan: tensors under this many elements stay uncompressed (default 16384)");
  cmd->add_option("--encode-on", o.encode_on, "Default plan: engine or caller (default engine)")
      ->check(CLI::IsMember({"engine", "caller"}));
  cmd->add_option("--trace", o.trace_path, "Write the Chrome trace of the (first) plan's step");
  cmd->add_option("--json", o.json_path, "Also write the results as JSON rows to this file");
  o.cluster.add_to(*cmd);
  o.costs.add_to(*cmd);
  cmd->callback([&exit_code] { exit_code = run_simulate(o); });
}

}  // namespace gradcomp::tools
