// `gradcomp plan`.
#include "plan_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "gradcomp/model/planner.h"
#include "gradcomp/model/simulator.h"
#include "gradcomp/option.h"
#include "gradcomp/plan.h"
#include "gradcomp/recommended.h"
#include "cli_checks.h"
#include "model_options.h"

namespace gradcomp::tools {
namespace {

struct PlanFlags {
  std::string profile;
  int workers = 0;
  ClusterFlags cluster;
  CostFlags costs;
  // Empty: the options that held under `optimizer` (gradcomp/recommended.h; "any": the
  // recommended ones).
  std::vector<std::string> codecs;
  std::string optimizer = "any";
  double lambda = 1.0;
  bool one_lossy_step = false;
  bool no_caller_encoding = false;
  size_t min_compress_elements = 0;
  size_t small_tensor_elements = 0;
  size_t slice_from_elements = model::PlannerSettings{}.slice_from_elements;
  uint64_t start_step = 0;
  std::string json_path;
  std::string trace_path;
};

std::string option_text(const Option& o) {
  return fmt::format("{} | {} | {}{}{}", o.codec, o.feedback, o.route,
                     o.encode_on == EncodeOn::kCaller ? " | caller" : "",
                     o.start_step != 0 ? fmt::format(" | from {}", o.start_step) : "");
}

void print_plan(const Plan& plan, const model::CostModel& cost) {
  fmt::print("{:>6} {:>9} {:>12}  {:<52} {:>10}\n", "bucket", "tensors", "elements", "option",
             "exch ms");
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bucket = plan.buckets[b];
    const double n = static_cast<double>(plan.bucket_elements(b));
    const auto c = cost.bucket(bucket.option, n);
    fmt::print("{:>6} {:>4}-{:<4} {:>12}  {:<52} {:>10.3f}\n", b, bucket.tensors.front(),
               bucket.tensors.back(), plan.bucket_elements(b), option_text(bucket.option),
               c.exchange_s() * 1e3);
  }
}

// The tensors the plan cuts into slices (bucket indices count every slice).
void print_sliced(const Plan& plan) {
  std::vector<std::string> sliced;
  for (const TensorInfo& t : plan.tensors) {
    if (t.slices > 1) sliced.push_back(fmt::format("{} ({:.1f}M elements) in {}", t.name, t.elements / 1e6, t.slices));
  }
  if (sliced.empty()) return;
  fmt::print("slices   {} (bucket tensor indices count each slice)\n\n", fmt::join(sliced, ", "));
}

// Says so when buckets compress again on the way back (twoway, servers): the accuracy tables
// measured every option with one lossy step, and a second adds its error again.
void print_twice_compressed(const Plan& plan) {
  size_t twice = 0;
  for (const BucketOption& option : plan.validate()) {
    const RouteKind route = option.codec_route();
    const bool back_encoded = route == RouteKind::kTwoway || route == RouteKind::kServers;
    if (option.text.codec != "none" && back_encoded) ++twice;
  }
  if (twice == 0) return;
  fmt::print("\nnote     {} bucket{} compress{} twice (the way back re-encodes the sum); the "
             "accuracy tables measured one lossy step\n         (docs/recommended.md), and dither "
             "over twoway ended 3.8-4.1% above uncompressed on the language model:\n"
             "         --one-lossy-step plans with one\n",
             twice, twice == 1 ? "" : "s", twice == 1 ? "es" : "");
}

double single_codec_time(const model::Profile& profile, const std::string& codec,
                         const model::CostModel& cost, const model::SimulatorSettings& sim) {
  DefaultPlanSettings settings;
  settings.compressed = parse_option(codec);
  const Plan plan = make_default_plan(profile.tensor_infos(), settings);
  return model::simulate(profile, plan, cost, sim).iteration_s;
}

// The options the accuracy tables back under that optimizer family; "any": under both (the
// recommended options).
std::vector<std::string> recommended_candidates(const std::string& optimizer) {
  if (optimizer == "sgd") return recommended_options({OptimizerFamily::kSgd});
  if (optimizer == "adam") return recommended_options({OptimizerFamily::kAdam});
  return recommended_options({OptimizerFamily::kSgd, OptimizerFamily::kAdam});
}

int run_plan(const PlanFlags& flags) {
  const model::Profile profile = model::load_profile(flags.profile);
  const model::CostModel cost(
      flags.cluster.cluster(flags.workers > 0 ? std::optional<int>(flags.workers) : std::nullopt),
      flags.costs.load());
  model::PlannerSettings settings;
  settings.codecs = flags.codecs.empty() ? recommended_candidates(flags.optimizer)
                                         : split_specs(flags.codecs);
  settings.one_lossy_step = flags.one_lossy_step;
  settings.try_caller_encoding = !flags.no_caller_encoding;
  settings.min_compress_elements = flags.min_compress_elements;
  settings.small_tensor_elements = flags.small_tensor_elements;
  settings.start_step = flags.start_step;
  settings.slice_from_elements = flags.slice_from_elements;
  settings.simulator.lambda = flags.lambda;
  const model::PlanResult result = model::make_plan(profile, cost, settings);

  fmt::print("profile  {} ({} tensors, {:.1f}M elements, forward {:.1f} ms, backward {:.1f} ms)\n",
             profile.model, profile.tensors.size(), profile.total_elements() / 1e6,
             profile.forward_s * 1e3, profile.backward_s * 1e3);
  const auto& c = cost.cluster();
  fmt::print("cluster  {} workers ({} nodes x {}), inter {} + {:.3g} us, intra {} + {:.3g} us\n",
             c.workers, c.nodes(), c.per_node, model::format_rate(c.inter.bytes_per_s),
             c.inter.latency_s * 1e6, model::format_rate(c.intra.bytes_per_s),
             c.intra.latency_s * 1e6);
  const char* why = flags.optimizer == "sgd"    ? "held under SGD"
                    : flags.optimizer == "adam" ? "held under Adam-family optimizers"
                                                : "recommended: held under SGD and under AdamW";
  fmt::print("options  {}{}\n\n", fmt::join(settings.codecs, ", "),
             flags.codecs.empty() ? fmt::format(" ({})", why) : "");
  print_sliced(result.plan);
  print_plan(result.plan, cost);
  print_twice_compressed(result.plan);
  const double best = result.predicted.iteration_s;
  fmt::print("\n{:<44} {:>10.2f} ms\n", "predicted iteration time of this plan", best * 1e3);
  if (result.plan.sliced()) {  // what the slices gain
    model::PlannerSettings whole = settings;
    whole.slice_from_elements = 0;
    const double t = model::make_plan(profile, cost, whole).predicted.iteration_s;
    fmt::print("{:<44} {:>10.2f} ms  ({:.2f}x)\n", "best plan of whole tensors", t * 1e3, t / best);
  }
  fmt::print("{:<44} {:>10.2f} ms  ({:.2f}x)\n", "best uncompressed plan",
             result.uncompressed_s * 1e3, result.uncompressed_s / best);
  for (const auto& codec : settings.codecs) {
    const double t = single_codec_time(profile, codec, cost, settings.simulator);
    fmt::print("{:<44} {:>10.2f} ms  ({:.2f}x)\n",
               fmt::format("single-codec default plan: {}", codec), t * 1e3, t / best);
  }
  fmt::print("{:<44} {:>10.2f} ms\n", "upper bound (free compression: compute only)",
             model::compute_bound(profile) * 1e3);
  fmt::print("{:<44} {:>10.3f} ms  ({} bucket options evaluated)\n", "decision time",
             result.decision_s * 1e3, result.options_considered);
  if (!flags.json_path.empty()) {
    result.plan.save(flags.json_path);
    fmt::print("plan written to {}\n", flags.json_path);
  }
  if (!flags.trace_path.empty()) {
    const auto sim = model::simulate(profile, result.plan, cost, settings.simulator, true);
    std::ofstream(flags.trace_path) << sim.chrome_trace().dump() << "\n";
    fmt::print("simulated timeline written to {}\n", flags.trace_path);
  }
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app, int& exit_code) {
  static PlanFlags flags;
  auto* plan = app.add_subcommand(
      "plan", "Find the plan (buckets and per-bucket compression) with the least predicted "
              "iteration time for a model profile on a cluster");
  plan->add_option("--profile", flags.profile, "A shipped profile name or a profile JSON path")
      ->required();
  plan->add_option("--workers", flags.workers, "Workers (data-parallel ranks)")
      ->check(CLI::Range(1, model::kMaxWorkers));
  flags.cluster.add_to(*plan);
  flags.costs.add_to(*plan);
  plan->add_option("--codecs", flags.codecs,
                   "Allowed compression, 'codec[|feedback[|route]]' separated by ',' (none is "
                   "always allowed; default: the recommended options, or those that held "
                   "under --optimizer, docs/recommended.md)");
  plan->add_option("--optimizer", flags.optimizer,
                   "Without --codecs: candidates that held under sgd, adam (Adam-family), or "
                   "any (both: the recommended options, the default)")
      ->check(CLI::IsMember({"sgd", "adam", "any"}));
  plan->add_option("--lambda", flags.lambda, "Compute slow-down while communicating (>= 1)")
      ->check(finite_range(1, 10));
  plan->add_flag("--one-lossy-step", flags.one_lossy_step,
                 "At most one lossy compression per tensor (no two-way, no fp16 inside nodes)");
  plan->add_flag("--no-caller-encoding", flags.no_caller_encoding,
                 "Encode on the engine's thread only");
  plan->add_option("--min-compress", flags.min_compress_elements,
                   "Buckets under this many elements stay uncompressed");
  plan->add_option("--small-tensors", flags.small_tensor_elements,
                   "Tensors under this many elements (biases, norms) stay uncompressed, in one "
                   "bucket of their own, as in the default plan (compression=\"auto\": its "
                   "min_compress_elements; default 0: any tensor may be compressed)");
  plan->add_option("--slice-from", flags.slice_from_elements,
                   "Tensors of at least this many elements may be cut into slices (default 0: "
                   "never; 4194304 = 2^22 is where slices gain in docs/simulation.md)");
  plan->add_option("--start-step", flags.start_step,
                   "Compressed buckets travel uncompressed before this step (warm-up; the "
                   "prediction is of the steady state after it)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 40));
  plan->add_option("--json", flags.json_path, "Write the plan (plan-format.md) to this file");
  plan->add_option("--trace", flags.trace_path, "Write the simulated step as a Chrome trace");
  plan->callback([&exit_code] { exit_code = run_plan(flags); });
}

}  // namespace gradcomp::tools
