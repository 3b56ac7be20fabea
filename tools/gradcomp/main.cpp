// The gradcomp command line tool.
//   gradcomp codecs                       list the codecs with their traits
//   gradcomp recommended                  the options the accuracy tables back (SGD, AdamW)
//   gradcomp bench codecs [--json FILE]   codec throughput next to memcpy, on one core
//   gradcomp bench routes [--json FILE]   exchange time per route and codec on W processes
//   gradcomp launch -n N -- cmd args...   start N local ranks as torchrun would (launch.h)
//   gradcomp server --index s ...         one dedicated parameter server (server_command.h)
//   gradcomp plan --profile P ...         the planner on a model profile and a cluster
//   gradcomp utility | simulate | costs | correct   the cost model (model_commands.h)
#include <filesystem>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "bench_codecs.h"
#include "gradcomp/recommended.h"
#include "cli_checks.h"
#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "launch.h"
#include "bench_routes.h"
#include "plan_command.h"
#include "server_command.h"
#include "model_commands.h"

namespace {

// This program's path, to start copies of itself (/proc/self/exe survives a relative argv[0]).
std::string self_executable(const char* argv0) {
  std::error_code error;
  auto path = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::string(argv0) : path.string();
}

// What the accuracy tables say of the codec (gradcomp/recommended.h): "yes" (recommended: it
// held under both families), "sgd only", "adam only" or "no".
std::string recommended_text(const gradcomp::Recommendation& r) {
  if (gradcomp::recommended(r)) return "yes";
  if (r.sgd && !r.adam) return "sgd only";
  if (r.adam && !r.sgd) return "adam only";
  return "no";
}

std::string recommended_under(const std::string& codec) {
  const auto* r = gradcomp::recommendation_for(codec == "threshold" ? "threshold:tau=1" : codec);
  return r == nullptr ? "" : recommended_text(*r);
}

void list_codecs() {
  fmt::print("{:<10} {:>8} {:>6} {:>8} {:>8} {:<14} {:<12} {}\n", "codec", "bits/el", "rounds",
             "summable", "unbiased", "aggregation", "recommended", "canonical spec (the defaults)");
  for (const auto& name : gradcomp::codec_names()) {
    // threshold has no default tau: list it with a placeholder value and say so.
    const bool needs_tau = name == "threshold";
    const auto codec = gradcomp::make_codec(needs_tau ? "threshold:tau=1" : name);
    const auto t = codec->traits();
    fmt::print("{:<10} {:>8.3g} {:>6} {:>8} {:>8} {:<14} {:<12} {}\n", name, t.bits_per_element,
               t.rounds, t.summable ? "yes" : "no", t.unbiased ? "yes" : "no",
               t.aggregation == gradcomp::Aggregation::kMajorityVote ? "majority vote" : "mean",
               recommended_under(name), needs_tau ? "threshold:tau=<required>" : codec->spec());
  }
  fmt::print("\nrecommended: within 0.5 pp of uncompressed training on the Fashion-MNIST CNN "
             "under SGD and within 2% of the uncompressed validation loss on a small language "
             "model under AdamW, at the settings `gradcomp recommended` lists "
             "(docs/recommended.md); 'sgd only': held under SGD but not under AdamW\n");
}

void list_recommended() {
  fmt::print("{:<40} {:>4} {:>5}  {}\n", "option (as measured)", "sgd", "adam", "recommended");
  for (const auto& r : gradcomp::recommendations()) {
    fmt::print("{:<40} {:>4} {:>5}  {}\n", r.option, r.sgd ? "yes" : "no", r.adam ? "yes" : "no",
               recommended_text(r));
  }
  for (const auto& r : gradcomp::recommendations()) {
    if (!r.lans.empty()) {
      fmt::print("\nunder LANS (CLAN, docs/optimizers-accuracy.md): {} also held as {}\n",
                 r.codec, r.lans);
    }
  }
}

void add_bench_routes(CLI::App& bench, int& exit_code, const char* argv0) {
  static gradcomp::tools::BenchRoutesOptions options;
  auto* routes = bench.add_subcommand(
      "routes", "Time to exchange one bucket through each route and codec on W processes, next "
                "to the transport's own allreduce of the same bytes (mpirun, gradcomp launch, "
                "or alone: it launches W processes itself)");
  routes->add_option("-n,--processes", options.processes,
                     "Processes to launch when not started by a launcher")
      ->check(CLI::Range(1, 256));
  routes->add_option("--transport", options.transport, "mpi or gloo (default: from the launcher)")
      ->check(CLI::IsMember({"mpi", "gloo"}));
  gradcomp::tools::add_list_option(*routes, "--cases", options.cases,
                  "Cases 'codec|feedback|route' (default: every route with representative codecs)",
                  ';');
  gradcomp::tools::add_list_option(*routes, "--sizes", options.log2_sizes, "log2 of the bucket sizes in elements",
                  ',', CLI::Range(0, 27));
  routes->add_option("--repeats", options.repeats, "Measured exchanges per case (median)")
      ->check(CLI::Range(1, 1000));
  routes->add_option("--buckets", options.buckets,
                     "Cut each size into this many equal buckets, exchanged in one step (the "
                     "engine's streams overlap them)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  routes->add_option("--local-size", options.local_size,
                     "Ranks per node for the hierarchical route")
      ->check(CLI::Range(1, 256));
  routes->add_option("--servers", options.servers,
                     "Started alone: parameter servers to launch beside the W processes, for "
                     "cases of route servers")
      ->check(CLI::Range(0, 4096));
  routes->add_flag("!--no-allreduce", options.allreduce,
                   "Skip the transport's allreduce (its columns read 0): the bytes on the links "
                   "are then the cases' alone");
  routes->add_option("--json", options.json_path, "Also write the results as JSON to this file");
  routes->callback([&exit_code, argv0] {
    exit_code = gradcomp::tools::bench_routes(options, self_executable(argv0));
  });
}

int run(int argc, char** argv) {
  CLI::App app{"gradcomp: compressed gradient communication for data-parallel training"};
  app.require_subcommand(1);

  app.add_subcommand("codecs", "List the codecs, their canonical specs and traits")
      ->callback(list_codecs);
  app.add_subcommand("recommended",
                     "The compression options the accuracy tables back, under SGD and AdamW")
      ->callback(list_recommended);

  auto* bench = app.add_subcommand("bench", "Measure gradcomp's parts on this machine");
  bench->require_subcommand(1);
  gradcomp::tools::BenchCodecsOptions options;
  auto* codecs = bench->add_subcommand(
      "codecs", "Encode, decode-accumulate and decode-into throughput of every codec on one core, with "
                "memcpy and a pure read of the same bytes as the physical limit");
  gradcomp::tools::add_list_option(*codecs, "--codecs", options.specs,
                  "Codec specs to measure (default: every codec, recommended settings)", ';');
  gradcomp::tools::add_list_option(*codecs, "--sizes", options.log2_sizes, "log2 of the element counts", ',',
                  CLI::Range(0, 28));
  codecs->add_option("--min-time", options.min_seconds,
                     "Seconds to repeat each measurement for (the best call counts)")
      ->check(gradcomp::tools::finite_range(0, 60));
  codecs->add_option("--json", options.json_path, "Also write the results as JSON to this file");
  int exit_code = 0;
  codecs->callback([&] { exit_code = gradcomp::tools::bench_codecs(options); });
  add_bench_routes(*bench, exit_code, argv[0]);

  gradcomp::tools::add_launch_command(app, exit_code);
  gradcomp::tools::add_server_command(app, exit_code);
  gradcomp::tools::add_plan_command(app, exit_code);
  gradcomp::tools::add_model_commands(app, exit_code);  // utility, simulate, costs, correct

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const gradcomp::Error& e) {
    fmt::print(stderr, "gradcomp: {}\n", e.what());
    return 2;
  }
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // e.g. out of memory at the largest benchmark sizes
    fmt::print(stderr, "gradcomp: internal error: {}\n", e.what());
    return 3;
  }
}
