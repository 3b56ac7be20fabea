// `gradcomp costs`: the codec costs the model uses (a + b n per codec), shown, or fitted to a
// `gradcomp bench codecs --json` report and written as a codec-costs file.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "gradcomp/json_text.h"
#include "model_commands.h"
#include "model_options.h"

namespace gradcomp::tools {
namespace {

using nlohmann::json;

struct CostsOptions {
  std::vector<std::string> fit_paths;
  std::string source;
  std::string json_path;
  CostFlags costs;
};

// GB/s of float32 input at the per-element cost: what `bench codecs` prints.
double gbps(const model::Linear& l) { return l.b > 0 ? 4 / l.b / 1e9 : INFINITY; }

void print_costs(const model::CodecCosts& costs) {
  constexpr double kN = 1 << 22;  // a 16 MB bucket
  size_t width = 10;              // entries by spec are longer than codec names
  for (const auto& name : costs.names()) width = std::max(width, name.size());
  fmt::print("{:<{}} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n", "codec", width,
             "enc a us", "enc GB/s", "ef a us", "ef GB/s", "dec a us", "dec GB/s", "enc 2^22",
             "ef 2^22", "dec 2^22");
  for (const auto& name : costs.names()) {
    const model::CodecCost& c = costs.of(name);
    fmt::print("{:<{}} {:>9.1f} {:>9.2f} {:>9.1f} {:>9.2f} {:>9.1f} {:>9.2f} {:>9} {:>9} {:>9}\n",
               name, width, c.encode.a * 1e6, gbps(c.encode), c.encode_ef.a * 1e6,
               gbps(c.encode_ef), c.decode.a * 1e6, gbps(c.decode), format_ms(c.encode.at(kN)),
               format_ms(c.encode_ef.at(kN)), format_ms(c.decode.at(kN)));
  }
}

// Several bench runs as one: per codec spec and size, the best (fastest) of the runs, as the
// bench itself keeps the best of repeated calls (the runs that other load disturbed least).
// A bench report, checked enough to merge: an object with a "results" array.
json read_bench(const std::string& path) {
  json bench = read_json_file(path, "codec bench report");
  if (!bench.is_object() || !bench.contains("results") || !bench["results"].is_array()) {
    throw Error(fmt::format("'{}' is not a `gradcomp bench codecs --json` report (no \"results\" "
                            "array)", path));
  }
  return bench;
}

json merge_runs(const std::vector<std::string>& paths) {
  json merged = read_bench(paths[0]);
  std::map<std::pair<std::string, double>, json*> rows;
  json extra = json::array();
  for (json& row : merged.at("results")) rows[{row.value("spec", ""), row.value("elements", 0.0)}] = &row;
  for (size_t i = 1; i < paths.size(); ++i) {
    const json run = read_bench(paths[i]);  // a named copy: the loop must not outlive it
    for (const json& row : run.at("results")) {
      auto it = rows.find({row.value("spec", ""), row.value("elements", 0.0)});
      if (it == rows.end()) {
        extra.push_back(row);  // appended after the loop: pushing now could move the rows
        continue;
      }
      for (const char* key : {"encode_gbps", "encode_ef_gbps", "decode_gbps"}) {
        (*it->second)[key] = std::max((*it->second)[key].get<double>(), row.at(key).get<double>());
      }
    }
  }
  for (json& row : extra) merged["results"].push_back(std::move(row));
  return merged;
}

int run_costs(const CostsOptions& o) {
  if (o.fit_paths.empty()) {
    if (!o.json_path.empty() || !o.source.empty()) {
      throw Error("costs: --json and --source go with --fit BENCH_JSON (what to write)");
    }
    print_costs(o.costs.load());
    return 0;
  }
  const json bench = merge_runs(o.fit_paths);
  const model::CodecCosts costs = model::CodecCosts::fit_bench(bench);
  print_costs(costs);
  if (!o.json_path.empty()) {
    const std::string source =
        o.source.empty() ? fmt::format("fitted from {} ({})", fmt::join(o.fit_paths, ", "),
                                       bench.value("command", std::string("gradcomp bench codecs")))
                         : o.source;
    write_json_file(o.json_path,
                    {{"source", source},
                     {"command", fmt::format("gradcomp costs --fit {} --json {}",
                                             fmt::join(o.fit_paths, " --fit "), o.json_path)},
                     {"codecs", costs.to_json()}});
    fmt::print("wrote {}\n", o.json_path);
  }
  return 0;
}

}  // namespace

void add_costs_command(CLI::App& app, int& exit_code) {
  static CostsOptions o;
  auto* cmd = app.add_subcommand(
      "costs", "Codec costs of the model (seconds = a + b n per codec): show them, or fit them "
               "to a `gradcomp bench codecs --json` report");
  cmd->add_option("--fit", o.fit_paths,
                  "A `gradcomp bench codecs --json` report to fit; several: the best of the runs "
                  "per codec and size")
      ->check(CLI::ExistingFile);
  cmd->add_option("--source", o.source, "With --fit: where and how it was measured, in words");
  cmd->add_option("--json", o.json_path, "With --fit: write the fitted costs to this file");
  o.costs.add_to(*cmd);
  cmd->callback([&exit_code] { exit_code = run_costs(o); });
}

}  // namespace gradcomp::tools
